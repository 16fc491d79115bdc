"""What the float64-accumulated norm that clipping uses costs against a float32 norm (issue 37).

    python benchmarks/bench_norms.py [--numel 12300000] [--repeats 50] [--threads 1] [--device cpu|cuda] [--write]

One float32 vector of ``--numel`` entries (12.3 M: PeFLL's η for a LeNet target), N(0, 0.01²). Timed, in
interleaved passes so the machine's drift hits all alike: ``torch.linalg.vector_norm`` in float32 (what the clips
used before), the same with ``dtype=torch.float64`` (a float64 copy of the whole vector first) and
:func:`mpifl.models.reductions.l2_norm` (float64 chunk by chunk, what they use now). Reported: the median seconds
of each, its ratio to the float32 norm, and its error relative to a float64 reference on the host.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from common import heading, record

from mpifl.models.reductions import l2_norm


def timed(norm: Callable[[], torch.Tensor], device: torch.device) -> float:
    start = time.perf_counter()
    norm()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=12_300_000)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (a rank's default: 1)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    x = (torch.randn(args.numel, generator=torch.Generator().manual_seed(0)) * 0.01).to(device)
    wide = x.cpu().numpy().astype(np.float64)
    exact = float(np.sqrt(np.dot(wide, wide)))
    norms = {"float32 `vector_norm`": lambda: torch.linalg.vector_norm(x),
             "`vector_norm(dtype=float64)` (whole copy)": lambda: torch.linalg.vector_norm(x, dtype=torch.float64),
             "`l2_norm` (float64 chunks)": lambda: l2_norm(x)}
    seconds: dict[str, list[float]] = {name: [] for name in norms}
    for norm in norms.values():
        timed(norm, device)  # warm-up: allocator, kernels
    for _ in range(args.repeats):
        for name, norm in norms.items():
            seconds[name].append(timed(norm, device))
    base = statistics.median(seconds["float32 `vector_norm`"])
    lines = [heading(f"Float64-accumulated norm vs float32, {args.numel:,} entries on {args.device}"), "",
             f"Command: `python benchmarks/bench_norms.py --numel {args.numel} --repeats {args.repeats} "
             f"--threads {args.threads} --device {args.device}`; median of {args.repeats} interleaved passes.", "",
             "| norm | median ms | × float32 | relative error vs float64 |", "|---|---|---|---|"]
    for name, norm in norms.items():
        median = statistics.median(seconds[name])
        error = abs(float(norm()) - exact) / exact
        lines.append(f"| {name} | {median * 1e3:.2f} | {median / base:.2f} | {error:.1e} |")
    record(lines, args.write)


if __name__ == "__main__":
    main()
