"""Vectorized local training of small models: one-at-a-time loop vs torch.func.

    python benchmarks/bench_vectorize.py [--rounds 10] [--ranks 1 3] [--write]

FedAvg on tabular class-conditional Gaussians (60 features, 10 classes, 1,000 clients of 64 training
samples, 50 clients per round, 2 epochs of batch 16), with a logistic model, an MLP 64 and an MLP
256-256, each with ``client.vectorize`` false and true. Reported: median seconds per round over
rounds 2..R and the ratio to the loop.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from common import REPO, heading, mpifl_job, record

MODELS = {"logistic": ["model.name=logistic"], "mlp 64": ["model.name=mlp", "model.hidden=[64]"],
          "mlp 256-256": ["model.name=mlp", "model.hidden=[256,256]"]}
WORKLOAD = ["data.num_clients=1000", "data.partition=iid", "data.synthetic.image_shape=[60]",
            "clients_per_round=50", "client.epochs=2", "client.batch_size=16"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            for model, overrides in MODELS.items():
                median = {}
                for mode in ("false", "true"):
                    settings = [*WORKLOAD, *overrides, f"client.vectorize={mode}", f"rounds={args.rounds}",
                                f"eval_every={args.rounds}"]
                    res = mpifl_job(REPO / "configs" / "b1.yaml", ranks, Path(tmp) / "v.h5", settings)
                    median[mode] = float(np.median(res.table("rounds")["wall_time_s"][1:]))
                    if mode == "true":
                        vectorized = int(res.table("ranks")["clients_trained_vectorized"].sum())
                loop = median["false"]
                rows.append(f"| {ranks} | {model} | {loop:.3f} | {median['true']:.3f} ({median['true'] / loop:.2f}×) | "
                            f"{vectorized / (50 * args.rounds):.0%} |")
    record([
        heading("Vectorized local training (torch.func), FedAvg, tabular"),
        "",
        f"`python benchmarks/bench_vectorize.py --rounds {args.rounds} --ranks {' '.join(map(str, args.ranks))}`",
        "",
        "| P | model | loop s/round | vectorized s/round | share of clients vectorized |",
        "|---|---|---|---|---|",
        *rows,
    ], args.write)


if __name__ == "__main__":
    main()
