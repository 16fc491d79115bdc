"""Vectorized local training: one-at-a-time loop vs torch.func.

    python benchmarks/bench_vectorize.py [--rounds 10] [--ranks 1 3] [--workloads tabular b1] [--chunk N]
                                         [--device cpu|cuda] [--repeats 1] [--set KEY=VALUE ...] [--write]

FedAvg, each model with ``client.vectorize`` false and true, run back to back. ``tabular``: class-conditional
Gaussians (60 features, 10 classes, 1,000 clients of 64 training samples, 50 clients per round, 2 epochs of
batch 16) with a logistic model, an MLP 64 and an MLP 256-256. ``b1``: configs/b1.yaml as it is (the CNN
16-32 with 128 hidden units on 1×28×28 images, 20 clients per round), whose kernel calls are padded to
``client.vectorize_chunk`` clients (``--chunk``; 20 or 10 with 1 or 3 ranks pads nothing). Reported: median
seconds per round over rounds 2..R (median over ``--repeats`` alternating pairs), the median of the pairs'
ratios, and the load average while they ran (the machine is shared). ``--device cuda``: the same on a GPU
(scripts/gpu_check.sh); ``--set``: further config overrides, as mpifl run --set, after the workload's own.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np
from common import REPO, heading, job_options, mpifl_job, record

TABULAR = ["data.num_clients=1000", "data.partition=iid", "data.synthetic.image_shape=[60]",
           "clients_per_round=50", "client.epochs=2", "client.batch_size=16"]
MODELS = {"logistic": [*TABULAR, "model.name=logistic"], "mlp 64": [*TABULAR, "model.name=mlp", "model.hidden=[64]"],
          "mlp 256-256": [*TABULAR, "model.name=mlp", "model.hidden=[256,256]"], "b1 cnn": []}
WORKLOADS = {"tabular": ["logistic", "mlp 64", "mlp 256-256"], "b1": ["b1 cnn"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--chunk", type=int, help="client.vectorize_chunk (default: the config's)")
    parser.add_argument("--repeats", type=int, default=1, help="alternating loop/kernel pairs; medians over them")
    job_options(parser)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in args.ranks:
            for model in [m for w in args.workloads for m in WORKLOADS[w]]:
                median: dict[str, list[float]] = {"false": [], "true": []}
                load = os.getloadavg()[0]
                for _ in range(args.repeats):
                    for mode in ("false", "true"):
                        settings = [*MODELS[model], f"client.vectorize={mode}", f"rounds={args.rounds}",
                                    f"eval_every={args.rounds}", f"device={args.device}"]
                        settings += [f"client.vectorize_chunk={args.chunk}"] if args.chunk else []
                        settings += args.overrides
                        res = mpifl_job(REPO / "configs" / "b1.yaml", ranks, Path(tmp) / "v.h5", settings)
                        median[mode].append(float(np.median(res.table("rounds")["wall_time_s"][1:])))
                        print(f"P={ranks} {model} vectorize={mode}: {median[mode][-1]:.3f} s/round (median)",
                              flush=True)
                        if mode == "true":
                            vectorized = int(res.table("ranks")["clients_trained_vectorized"].sum())
                            trained = int(res.table("rounds")["participants"].sum())
                loop, kernel = np.median(median["false"]), np.median(median["true"])
                ratio = np.median(np.array(median["true"]) / np.array(median["false"]))
                rows.append(f"| {ranks} | {model} | {loop:.3f} | {kernel:.3f} ({ratio:.2f}×) | "
                            f"{vectorized / trained:.0%} | {load:.1f} → {os.getloadavg()[0]:.1f} |")
    record([
        heading(f"Vectorized local training (torch.func), FedAvg, {' and '.join(args.workloads)}, "
                f"device {args.device}"),
        "",
        f"`python benchmarks/bench_vectorize.py --rounds {args.rounds} --ranks {' '.join(map(str, args.ranks))} "
        f"--workloads {' '.join(args.workloads)} --repeats {args.repeats}"
        + (f" --chunk {args.chunk}" if args.chunk else "")
        + (f" --device {args.device}" if args.device != "cpu" else "")
        + "".join(f" --set {o}" for o in args.overrides) + "`",
        "",
        "| P | model | loop s/round | vectorized s/round | share of clients vectorized | load average (1 min) |",
        "|---|---|---|---|---|---|",
        *rows,
    ], args.write)


if __name__ == "__main__":
    main()
