"""Time one Karula projection (karula.md §4) for n clients and d parameters, cold and warm-started.

    python benchmarks/bench_projection.py [--sizes 30,100,300] [--dims 50,100000] [--write]

Instances: ϑ = common offset + N(0, I) rows, D_ij ~ U(0.2, 2), t chosen so that the squared radii are
half the typical squared pair distance (many constraints active). ``warm`` re-projects ϑ + 1e-3·noise
with the solver state of the first call, as in consecutive Karula rounds. Dykstra keeps O(n²d)
corrections and is run only where they fit in ``--dykstra-gb``. ``--write`` replaces the "Karula
projection" section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import numpy as np

from mpifl.algorithms.projection import Projector

RESULTS = Path(__file__).with_name("RESULTS.md")
SECTION = "## Karula projection"


def instance(n: int, d: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    target = rng.standard_normal((n, d)) + rng.standard_normal(d)
    r2 = 0.5 * (2 * d) * rng.uniform(0.2, 2.0, n * (n - 1) // 2) / 1.1  # E‖ϑ_i − ϑ_j‖² = 2d
    return target, r2


def measure(solver: str, n: int, d: int, tol: float) -> dict[str, float]:
    target, r2 = instance(n, d)
    projector = Projector(r2, solver, tol=tol, max_iter=5000)
    start = time.perf_counter()
    cold = projector(target)
    cold_s = time.perf_counter() - start
    nudged = target + 1e-3 * np.random.default_rng(1).standard_normal(target.shape)
    start = time.perf_counter()
    warm = projector(nudged)
    warm_s = time.perf_counter() - start
    scale = 0.5 * float(np.sum((target - target.mean(0)) ** 2))
    return {"cold_s": cold_s, "cold_iter": cold.iterations, "warm_s": warm_s, "warm_iter": warm.iterations,
            "rel_gap": cold.gap / scale, "violation": cold.max_violation}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="30,100,300")
    parser.add_argument("--dims", default="50,100000")
    parser.add_argument("--tol", type=float, default=1e-6)
    parser.add_argument("--dykstra-gb", type=float, default=1.0)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    lines = ["| solver | n | d | cold s | cold iters | warm s | warm iters | certified gap / ½‖ϑ−ϑ̄‖² | max violation |",
             "|---|---|---|---|---|---|---|---|---|"]
    for d in (int(x) for x in args.dims.split(",")):
        for n in (int(x) for x in args.sizes.split(",")):
            for solver in ("dual", "dykstra"):
                if solver == "dykstra" and n * n * d * 4 / 1e9 > args.dykstra_gb:
                    continue
                m = measure(solver, n, d, args.tol)
                line = (f"| {solver} | {n} | {d} | {m['cold_s']:.3f} | {m['cold_iter']} | {m['warm_s']:.3f} | "
                        f"{m['warm_iter']} | {m['rel_gap']:.1e} | {m['violation']:.1e} |")
                print(line, flush=True)
                lines.append(line)
    if args.write:
        body = "\n".join([
            SECTION, "",
            f"Command: `python benchmarks/bench_projection.py --write` (tol {args.tol}); "
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared with other jobs.",
            "Cost: dual = O(n²d) (Gram matrix and final θ = Wϑ) + O(n³) per iteration, memory O(n² + nd); "
            "Dykstra = O(n²d) per sweep, memory O(n²d).", "", *lines, ""])
        text = RESULTS.read_text() if RESULTS.exists() else "# Benchmark results\n"
        if SECTION in text:
            head, _, rest = text.partition(SECTION)
            tail = rest[rest.find("\n## "):] if "\n## " in rest else ""
            text = head + body + tail
        else:
            text = text.rstrip("\n") + "\n\n" + body
        RESULTS.write_text(text)


if __name__ == "__main__":
    main()
