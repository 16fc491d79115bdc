"""Time the exact sum (mpifl.comm.exactsum) against the float64 sum it replaces, on rows of B1's MLP size (or W2's,
``--size 1626442``).

    python benchmarks/bench_exactsum.py [--size 1179146] [--repeats 30] [--write]

Per client, a worker folds weight·row into its total (``ExactSum.add``) where today's server does
``acc += w * row`` on a float64 accumulator; per round, each rank exports its total once (``export``) and
rank 0 rounds the reduced words once (``round_sum``). The fold is timed on both backends over CPU rows: numpy
(the default for host rows, CPU tensors included) and torch on the CPU (``ExactSum(size, device="cpu")``, the
code a CUDA total runs), so that the CPU default can stay the faster one. Rows are float32 deltas with weights
1/50: ``trained`` the change of the 60-2048-512-10 MLP (1,179,146 parameters, repeated to fill a longer row)
after two SGD steps on random data, ``synthetic`` |Δ| log-uniform in 1e-10..1e1 (the span issue 26 names),
``float32 subnormal`` those rows with one float32 subnormal entry, ``float64 subnormal`` them as float64 rows
with one float64 subnormal entry (the worst case: the levels reach down to float64's smallest unit). Timings
are the median and the minimum of ``--repeats`` calls, single-threaded numpy and torch (``torch.set_num_threads(1)``, as
mpifl's ``threads_per_rank: 1``); the load average is printed because the machine is shared. ``--write``
appends the table to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
from common import heading, record

from mpifl.comm.exactsum import ExactSum, round_sum, words

WEIGHT = 1 / 50


def trained_deltas(size: int, count: int) -> list[np.ndarray]:
    """The change of B1's MLP after two SGD steps (lr 0.05) on 16 random samples, per seed."""
    rows = []
    for seed in range(count):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(60, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512),
                                    torch.nn.ReLU(), torch.nn.Linear(512, 10))
        before = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy().copy()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        x, y = torch.randn(16, 60), torch.randint(0, 10, (16,))
        for _ in range(2):
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
        after = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
        rows.append(np.resize(after - before, size))  # repeated to fill a row longer than the MLP
    return rows


def synthetic_deltas(size: int, count: int, subnormal: type | None = None) -> list[np.ndarray]:
    """|Δ| log-uniform in 1e-10..1e1, float32; with ``subnormal`` (a float type) rows of that type whose entry 7
    is its smallest subnormal."""
    rng = np.random.default_rng(0)
    rows = [(rng.standard_normal(size) * 10.0 ** rng.uniform(-10, 1, size)).astype(np.float32) for _ in range(count)]
    if subnormal is not None:
        rows = [row.astype(subnormal) for row in rows]
        for row in rows:
            row[7] = np.finfo(subnormal).smallest_subnormal
    return rows


def timed(calls: int, call) -> tuple[float, float]:  # noqa: ANN001
    """Median and minimum milliseconds of ``call(i)`` over ``calls`` calls (after one warm-up)."""
    call(0)
    seconds = []
    for i in range(calls):
        start = time.perf_counter()
        call(i)
        seconds.append(time.perf_counter() - start)
    return float(np.median(seconds)) * 1e3, min(seconds) * 1e3


def measure(rows: list[np.ndarray], repeats: int) -> dict[str, float | int]:
    size = len(rows[0])
    acc = np.zeros(size)

    def plain(i: int) -> None:
        nonlocal acc
        acc += WEIGHT * rows[i % len(rows)]

    total, on_torch = ExactSum(size), ExactSum(size, device="cpu")
    tensors = [torch.from_numpy(row) for row in rows]
    out = {"plain": timed(repeats, plain), "fold": timed(repeats, lambda i: total.add(rows[i % len(rows)], WEIGHT)),
           "torch fold": timed(repeats, lambda i: on_torch.add(tensors[i % len(rows)], WEIGHT))}
    assert on_torch.backend == "torch-cpu" and on_torch.window == total.window
    window = total.window
    out["export"] = timed(max(3, repeats // 5), lambda i: total.export(window))
    wire = total.export(window)
    out["round"] = timed(max(3, repeats // 5), lambda i: round_sum(wire, window))
    out["levels"] = total.nbytes // (8 * size) - 1
    out["words"] = words(window)
    out["bits"] = window.highest - window.lowest
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=1_179_146)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    kinds = {"trained": trained_deltas(args.size, 4), "synthetic": synthetic_deltas(args.size, 4),
             "float32 subnormal": synthetic_deltas(args.size, 4, np.float32),
             "float64 subnormal": synthetic_deltas(args.size, 4, np.float64)}
    load = os.getloadavg()[0]
    results = {kind: measure(rows, args.repeats) for kind, rows in kinds.items()}
    lines = [heading(f"Exact sum of {args.size:,}-entry rows (weights 1/50), one core"), "",
             f"`python benchmarks/bench_exactsum.py --size {args.size} --repeats {args.repeats}`; load average "
             f"{load:.1f} before, {os.getloadavg()[0]:.1f} after (2 shared cores): medians (minima) in ms; the "
             "folds' ratios and ns per entry are of the minima.", "",
             "| rows | bits spanned | levels (B/entry) | wire words (B/entry) | `acc += w*row` "
             "| numpy fold (ratio; ns/entry) | torch-CPU fold (ratio; ns/entry) | export, per rank and round "
             "| round_sum, rank 0 per round |",
             "|---|---|---|---|---|---|---|---|---|"]
    for kind, r in results.items():
        (plain_med, plain_min) = r["plain"]
        folds = [f"{med:.2f} ({low:.2f}; {low / plain_min:.1f}x; {low * 1e6 / args.size:.1f})"
                 for med, low in (r["fold"], r["torch fold"])]
        lines.append(f"| {kind} | {r['bits']} | {r['levels']} ({8 * (r['levels'] + 1)}) | {r['words']} "
                     f"({8 * r['words']}) | {plain_med:.2f} ({plain_min:.2f}) | {folds[0]} | {folds[1]} | "
                     f"{r['export'][0]:.1f} ({r['export'][1]:.1f}) | {r['round'][0]:.1f} ({r['round'][1]:.1f}) |")
    record(lines, args.write)


if __name__ == "__main__":
    main()
