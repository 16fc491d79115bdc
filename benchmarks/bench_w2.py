"""Workload W2, pfl-research's CIFAR-10 benchmark shape (configs/w2.yaml): seconds per round in mpifl.

    python benchmarks/bench_w2.py [--rounds 1500] [--device cpu|cuda] [--ranks 1 3] [--vectorize false true]
                                  [--repeats 1] [--set KEY=VALUE ...] [--write]

1,000 clients of 50 training images (3×32×32, synthetic class-conditional; real CIFAR-10 with
``--set data.dataset=cifar10 --set data.root=DIR --set data.test_fraction=0.1667``), IID, pfl-research's
``simple_cnn``, 50 clients per round, 1 local epoch of batch 10, SGD lr 0.1, server lr 1.0, every client
weighted equally, evaluation every 10 rounds. For every rank count, one job per ``client.vectorize`` setting,
run back to back (``--repeats`` times, alternating) so that their ratio is measured under the same load.
Reported: the median seconds of a training round (rounds 2..R; evaluation is timed apart), the job's seconds
per round all included, the share of clients trained in the kernel, and the load average while the jobs ran.
``benchmarks/pfl_w2.py`` runs the same workload in pfl-research.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from common import REPO, heading, job_options, mpifl_job, record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1500)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--vectorize", nargs="+", choices=["false", "true", "auto"], default=["false", "true"])
    parser.add_argument("--repeats", type=int, default=1, help="passes over the settings; medians over them")
    job_options(parser)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            medians: dict[str, list[float]] = {mode: [] for mode in args.vectorize}
            jobs: dict[str, list[float]] = {mode: [] for mode in args.vectorize}
            share, load = {}, os.getloadavg()[0]
            for _ in range(args.repeats):
                for mode in args.vectorize:
                    settings = [f"rounds={args.rounds}", f"device={args.device}", f"client.vectorize={mode}",
                                *args.overrides]
                    began = time.perf_counter()
                    res = mpifl_job(REPO / "configs" / "w2.yaml", ranks, Path(tmp) / "w2.h5", settings)
                    jobs[mode].append((time.perf_counter() - began) / args.rounds)
                    walls = np.asarray(res.table("rounds")["wall_time_s"], dtype=float)  # training: eval timed apart
                    medians[mode].append(float(np.median(walls[1:] if len(walls) > 1 else walls)))
                    trained = res.table("rounds")["participants"].sum()
                    share[mode] = res.table("ranks")["clients_trained_vectorized"].sum() / max(trained, 1)
                    print(f"P={ranks} vectorize={mode}: {medians[mode][-1]:.3f} s/round (median), "
                          f"{jobs[mode][-1]:.3f} s/round for the whole job", flush=True)
            first = np.array(medians[args.vectorize[0]])
            for mode in args.vectorize:
                ratio = np.median(np.array(medians[mode]) / first)
                rows.append(f"| {ranks} | {mode} | {np.median(medians[mode]):.3f} ({ratio:.2f}×) | "
                            f"{np.median(jobs[mode]):.3f} | {share[mode]:.0%} | "
                            f"{load:.1f} → {os.getloadavg()[0]:.1f} |")
    record([
        heading(f"W2 (pfl-research's CIFAR-10 shape), FedAvg, simple_cnn, device {args.device}"),
        "",
        f"`python benchmarks/bench_w2.py --rounds {args.rounds} --device {args.device} "
        f"--ranks {' '.join(map(str, args.ranks))} --vectorize {' '.join(args.vectorize)} --repeats {args.repeats}"
        + "".join(f" --set {o}" for o in args.overrides) + "`",
        "",
        "| P | client.vectorize | median s/round (rounds 2..R; median ratio to the first setting) | job s/round "
        "(start-up and evaluation included) | clients in the kernel | load average (1 min) before → after |",
        "|---|---|---|---|---|---|",
        *rows,
    ], args.write)


if __name__ == "__main__":
    main()
