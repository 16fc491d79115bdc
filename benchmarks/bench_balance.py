"""Balanced rounds with unequal clients: round time vs the ideal (total client work / workers).

    python benchmarks/bench_balance.py [--rounds 20] [--sigma 1.0] [--ranks 3] [--algorithms ...] [--repeats 3]
                                       [--write]

B1 (configs/b1.yaml) with log-normal client sizes (``data.synthetic.size_sigma``, FEMNIST-like
spread; mean 64 training samples), for FedAvg and for the stateful SCAFFOLD (cᵢ per client) and FedDeper
(vᵢ per client), under static ownership and under dynamic placement (each round's clients re-spread over the
workers by their work; a visiting client's state goes to its host and back). Per round, the ideal time is the
sum of the round's client compute seconds divided by the workers; reported is the median over
rounds 2..R of wall time / ideal, the mean load imbalance (busiest worker's planned samples over the
mean worker's), the median seconds per round, and what moving the visitors' state cost (states moved,
bytes and the slowest rank's seconds in those exchanges per round, which include waiting there for the other
worker). Passes over the configurations are interleaved ``--repeats`` times, so drift in the machine's speed
spreads over all of them; a cell is the median over repeats. Both placements give bitwise the same model
(tests/test_mpi_jobs.py, tests/mpi/test_fault_matrix_mpi.py check it), so only time differs.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from common import REPO, heading, mpifl_job, record

CONFIG = REPO / "configs" / "b1.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--algorithms", nargs="+", default=["fedavg", "scaffold", "feddeper"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    workers = args.ranks - 1
    rows = []
    runs: dict[tuple[str, str], list[list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for algorithm in args.algorithms:
                for placement in ("static", "dynamic"):
                    overrides = [f"algorithm={algorithm}", f"rounds={args.rounds}", f"eval_every={args.rounds}",
                                 f"placement={placement}", f"data.synthetic.size_sigma={args.sigma}"]
                    res = mpifl_job(CONFIG, args.ranks, Path(tmp) / f"{algorithm}_{placement}.h5", overrides)
                    rounds, ranks = res.table("rounds"), res.table("ranks")
                    wall, ideal = rounds["wall_time_s"][1:], rounds["client_compute_time_s"][1:] / workers
                    runs.setdefault((algorithm, placement), []).append([
                        np.median(wall), np.median(wall / ideal), rounds["load_imbalance"].mean(),
                        ranks["visitor_states_moved"].sum() / args.rounds,
                        ranks["visitor_state_bytes"].sum() / 2 / 1024 / args.rounds,  # counted sent and received
                        ranks["visitor_state_wait"].max() / args.rounds * 1e3])
    for (algorithm, placement), values in runs.items():
        s_round, ratio, imbalance, moved, kib, wait = np.median(np.array(values), axis=0)
        rows.append(f"| {algorithm} | {placement} | {s_round:.3f} | {ratio:.3f} | {imbalance:.3f} | {moved:.1f} | "
                    f"{kib:.0f} | {wait:.1f} |")
    record([
        heading(f"Balanced rounds, log-normal client sizes (σ={args.sigma}), B1, P={args.ranks}"),
        "",
        f"`python benchmarks/bench_balance.py --rounds {args.rounds} --sigma {args.sigma} --ranks {args.ranks} "
        f"--algorithms {' '.join(args.algorithms)} --repeats {args.repeats}`",
        "",
        "| algorithm | placement | median s/round | median round time / ideal (target ≤ 1.10) | mean load imbalance "
        "| client states moved / round | state KiB moved / round | state exchange ms / round (slowest rank) |",
        "|---|---|---|---|---|---|---|---|",
        *rows,
    ], args.write)


if __name__ == "__main__":
    main()
