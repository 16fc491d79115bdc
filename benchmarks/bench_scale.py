"""Scale: start-up, per-rank memory and seconds per round as the total number of clients grows.

    python benchmarks/bench_scale.py [--ranks 3] [--rounds 6] [--write]

Two workloads, each at two sizes, with FedAvg on P ranks: B1's images (configs/b1.yaml: 1×28×28,
CNN, 20 clients per round) with 1,000 and 10,000 clients, and a tabular Gaussian dataset (60
features, 10 classes, MLP 64, 100 clients per round) with 10,000 and 100,000 clients. Reported per
run: the slowest rank's set-up (layout, placement, its own clients' data: file-backed data is read
here, generated clients on first use), the time from launch to the first round (mpirun, imports,
MPI start, set-up; the job's wall time less the round loop and the final write), each rank's peak
resident memory and home clients, the median seconds per round over rounds 2..R, and the final
evaluation of every client. Per-round time should not grow with the total number of clients, and
a rank's memory only with its own clients.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from common import REPO, heading, mpifl_job, record

WORKLOADS = {
    "B1 images": (REPO / "configs" / "b1.yaml", (1_000, 10_000), ["clients_per_round=20"]),
    "tabular": (REPO / "configs" / "b1.yaml", (10_000, 100_000), [
        "clients_per_round=100", "data.partition=iid", "data.synthetic.image_shape=[60]",
        "model.name=mlp", "model.hidden=[64]", "client.epochs=1",
    ]),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--sizes", type=int, nargs="+", help="client counts instead of each workload's two")
    parser.add_argument("--eval-chunk", type=int, default=0, help="clients per evaluation pass (0: all at once)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.workloads:
            config, sizes, overrides = WORKLOADS[name]
            for clients in args.sizes or sizes:
                out = Path(tmp) / f"{name.replace(' ', '_')}_{clients}.h5"
                start = time.perf_counter()
                res = mpifl_job(config, args.ranks, out, [*overrides, f"data.num_clients={clients}",
                                                          f"rounds={args.rounds}", f"eval_every={args.rounds}",
                                                          f"eval_chunk={args.eval_chunk}", *args.set])
                job = time.perf_counter() - start
                ranks, rounds = res.table("ranks"), res.table("rounds")
                mem = " / ".join(f"{b / 2**20:.0f}" for b in ranks["peak_rss_bytes"])
                homes = " / ".join(str(c) for c in ranks["clients"])
                to_first_round = job - ranks["loop_wall_seconds"].max() - ranks["io_seconds"].max()
                rows.append(f"| {name} | {clients:,} | {ranks['setup_wall_seconds'].max():.1f} | "
                            f"{to_first_round:.1f} | {homes} | {mem} | "
                            f"{np.median(rounds['wall_time_s'][1:]):.3f} | {ranks['eval_seconds'].max():.1f} | "
                            f"{job:.0f} |")
    record([
        heading(f"Scale, FedAvg, P={args.ranks}"),
        "",
        f"`python benchmarks/bench_scale.py --ranks {args.ranks} --rounds {args.rounds} "
        f"--workloads {' '.join(repr(w) for w in args.workloads)}"
        + (f" --sizes {' '.join(map(str, args.sizes))}" if args.sizes else "")
        + f" --eval-chunk {args.eval_chunk}" + "".join(f" --set {item}" for item in args.set) + "`",
        "",
        "| workload | clients | set-up s (slowest rank) | launch to first round s (≈, incl. imports) | "
        "home clients per rank | peak RSS MiB per rank | median s/round | final eval s | job s |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ], args.write)


if __name__ == "__main__":
    main()
