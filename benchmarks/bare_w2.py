"""Workload W2's floor: the same FedAvg rounds in plain PyTorch, one process, one thread, no mpifl runtime.

    python benchmarks/bare_w2.py [--rounds 1500] [--device cpu|cuda] [--set KEY=VALUE ...] [--write]

What a round of W2 cannot do without (configs/w2.yaml, as benchmarks/bench_w2.py and benchmarks/pfl_w2.py run
it): the same clients, built by mpifl's data code from the same config and seed and put on the device once
before training (as mpifl's ranks stage their clients' data), the same ``simple_cnn`` module and initial
weights, and each round the 50 clients that mpifl samples (``mpifl.runtime.sampling.sample_clients``). For each
client: the global weights copied into the one model, a fresh ``torch.optim.SGD`` (lr 0.1), 1 epoch over a
fresh permutation in batches of 10 (5 steps of ``zero_grad(set_to_none=True)``, forward, cross-entropy,
backward, step), the client's delta (local - global) added to the round's weighted mean (uniform weights for
W2's ``server.weighting: uniform``, sample counts otherwise); then the server's step, global += server lr × mean
delta (FedAvg's server SGD at lr 1). ``torch.set_num_threads(1)``, as mpifl's ``threads_per_rank: 1`` and
pfl_w2.py's one thread a process. Nothing else: no evaluation, no metrics, no results file, no messages.

Reported, as bench_w2.py: the median seconds of a round over rounds 2..R, and the run's seconds per round with
the set-up (building the clients' data) included. ``benchmarks/compare_w2.py`` runs it between mpifl and
pfl-research.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from common import REPO, heading, job_options, record

from mpifl.data import build_federated_dataset
from mpifl.models import build_model
from mpifl.registry import load_config
from mpifl.runtime.sampling import sample_clients

CONFIG = REPO / "configs" / "w2.yaml"


def bare_rounds(cfg, device: torch.device) -> list[float]:  # noqa: ANN001 - a RunConfig
    """Train ``cfg``'s FedAvg rounds in a plain loop on one thread; each round's seconds."""
    c = cfg.client
    if c.steps is not None or c.clip_norm is not None or c.augment != "none" or c.batch_sampling != "epochs":
        raise SystemExit("bare_w2: the floor runs plain local SGD in epochs only (W2's client section)")
    torch.set_num_threads(1)
    data = build_federated_dataset(cfg.data, cfg.seed)
    splits = data.load_clients(range(data.layout.num_clients))
    xs = {i: torch.from_numpy(s.x_train).to(device) for i, s in splits.items()}
    ys = {i: torch.from_numpy(s.y_train).to(device) for i, s in splits.items()}
    model = build_model(cfg.model, data.layout, cfg.seed).to(device).train()
    params = list(model.parameters())
    if any(True for _ in model.buffers()):
        raise SystemExit("bare_w2: the floor averages parameters only, and this model has buffers")
    global_ = [p.detach().clone() for p in params]
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    everyone = np.arange(data.layout.num_clients)
    times = []
    for round_ in range(1, cfg.rounds + 1):
        start = time.perf_counter()
        sampled = sample_clients(cfg.seed, round_, everyone, cfg.clients_per_round)
        sizes = data.layout.train_sizes[sampled].astype(float)
        weights = np.full(len(sampled), 1 / len(sampled)) if cfg.server.weighting == "uniform" else sizes / sizes.sum()
        mean_delta = [torch.zeros_like(g) for g in global_]
        for client, w in zip(sampled, weights):
            with torch.no_grad():
                for p, g in zip(params, global_):
                    p.copy_(g)
            opt = torch.optim.SGD(params, lr=c.lr, momentum=c.momentum, weight_decay=c.weight_decay)
            x, y = xs[client], ys[client]
            for _ in range(c.epochs):
                order = torch.randperm(len(x), generator=gen, device=device)
                for i in range(0, len(x) - (c.batch_size - 1 if c.drop_last else 0), c.batch_size):
                    idx = order[i : i + c.batch_size]
                    opt.zero_grad(set_to_none=True)
                    F.cross_entropy(model(x[idx]), y[idx]).backward()
                    opt.step()
            with torch.no_grad():
                for m, p, g in zip(mean_delta, params, global_):
                    m.add_(p - g, alpha=float(w))
        with torch.no_grad():
            for g, m in zip(global_, mean_delta):
                g.add_(m, alpha=cfg.server.lr)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1500)
    job_options(parser, "config overrides of configs/w2.yaml, as mpifl run --set")
    args = parser.parse_args()
    cfg = load_config(CONFIG, [f"rounds={args.rounds}", *args.overrides])
    began = time.perf_counter()
    times = bare_rounds(cfg, torch.device(args.device))
    run = (time.perf_counter() - began) / args.rounds
    median = float(np.median(times[1:] if len(times) > 1 else times))
    load = os.getloadavg()[0]
    print(f"bare loop: {median:.3f} s/round (median), {run:.3f} s/round for the whole run, load average {load:.1f}",
          flush=True)
    record([
        heading(f"W2 floor: bare PyTorch FedAvg loop, 1 process, 1 thread, {cfg.model.name}, device {args.device}"),
        "",
        f"`python benchmarks/bare_w2.py --rounds {args.rounds} --device {args.device}"
        + "".join(f" --set {o}" for o in args.overrides) + "`",
        "",
        "| median s/round (rounds 2..R) | run s/round (set-up included) | load average (1 min) at the end |",
        "|---|---|---|",
        f"| {median:.3f} | {run:.3f} | {load:.1f} |",
    ], args.write)


if __name__ == "__main__":
    main()
