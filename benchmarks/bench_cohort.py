"""How rank 0 and the workers scale with the cohort: peak memory, bytes rank 0 receives and seconds per round.

    python benchmarks/bench_cohort.py [--sizes 50 200 800 3200] [--ranks 3] [--rounds 3] [--write]

The issue's workload: FedAvg on B1's Gaussian images reshaped to 60 features (``configs/b1.yaml`` with
``data.partition=iid``, 16 samples per client, one epoch), an MLP 60-2048-512-10 of 1,179,146 parameters (4.7 MB
a row), ``clients_per_round`` = each size (``data.num_clients`` = max(1,000, size)), evaluated once at the end.
Each size is one real ``mpirun`` job; reported per size: every rank's peak RSS (the results file's /ranks table),
the bytes rank 0 received in the training rounds' collectives (its physical log, per round), and the median
seconds per round over the rounds after the first (they include the round's gather or reduction).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from common import REPO, heading, mpifl_job, record

CONFIG = REPO / "configs" / "b1.yaml"
WORKLOAD = ["data.partition=iid", "data.synthetic.image_shape=[60]", "data.synthetic.samples_per_client=16",
            "model.name=mlp", "model.hidden=[2048,512]", "client.epochs=1"]
UP_OPS = (b"gatherv", b"ireduce", b"reduce", b"reduce_scatter", b"igatherv")


def measure(size: int, ranks: int, rounds: int, folder: Path) -> dict[str, float | list[float]]:
    clients = max(1000, size)
    overrides = [*WORKLOAD, f"data.num_clients={clients}", f"clients_per_round={size}", f"rounds={rounds}",
                 f"eval_every={rounds}", "placement=static"]
    res = mpifl_job(CONFIG, ranks, folder / f"c{size}.h5", overrides)
    peaks = res.table("ranks")["peak_rss_bytes"] / 2**20
    physical = res.table("physical")
    train = (physical["round"] >= 1) & np.isin(physical["op"], UP_OPS) & ~np.char.startswith(physical["message"],
                                                                                              b"eval")
    received = [float(physical["bytes"][train & (physical["round"] == r)].sum()) for r in range(1, rounds + 1)]
    seconds = res.table("rounds")["wall_time_s"]
    return {"peaks": peaks.tolist(), "received": received,
            "seconds": float(np.median(seconds[1:] if len(seconds) > 1 else seconds))}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[50, 200, 800, 3200])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    load = Path("/proc/loadavg").read_text().split()[0]
    lines = [heading(f"Cohort scaling on {args.ranks} ranks at {commit.stdout.strip()}"), "",
             f"`python benchmarks/bench_cohort.py --sizes {' '.join(map(str, args.sizes))} --ranks {args.ranks} "
             f"--rounds {args.rounds}` (load average {load} at the start)", "",
             "| clients per round | rank 0 peak RSS MB | workers' peak RSS MB | MB rank 0 received per round | "
             "s/round |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for size in args.sizes:
            m = measure(size, args.ranks, args.rounds, Path(tmp))
            peaks, received = m["peaks"], m["received"]
            workers = "–".join(f"{p:,.0f}" for p in sorted({round(p) for p in peaks[1:]}))
            lines.append(f"| {size:,} | {peaks[0]:,.0f} | {workers} | {np.median(received) / 1e6:,.1f} | "
                         f"{m['seconds']:.2f} |")
            print(lines[-1], file=sys.stderr, flush=True)
    record(lines, args.write)


if __name__ == "__main__":
    main()
