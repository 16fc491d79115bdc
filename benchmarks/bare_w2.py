"""Workload W2's floor: the same FedAvg rounds in plain PyTorch, one process, one thread, no mpifl runtime.

    python benchmarks/bare_w2.py [--rounds 1500] [--device cpu|cuda] [--batched] [--set KEY=VALUE ...] [--write]

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

``--batched``: the batched floor, what a GPU-first round cannot do without: the round's clients as rows of one
parameter matrix (the global model expanded on the device), their data stacked on the device once, and each
local step one ``torch.func.vmap`` of the gradient over all of them (each client's batch from its own
permutation, drawn on the device), then ``rows -= lr × gradients``; the weighted mean of the rows' deltas and the
server step. No fixed call shape, no padding, no exact sum, no loss kept: the arithmetic floor of a batched round.

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


def batched_rounds(cfg, device: torch.device) -> list[float]:  # noqa: ANN001 - a RunConfig
    """Train ``cfg``'s FedAvg rounds with each round's clients as one batched computation; each round's seconds."""
    from torch.func import functional_call, grad, vmap

    c = cfg.client
    if (c.steps is not None or c.clip_norm is not None or c.augment != "none" or c.batch_sampling != "epochs"
            or c.momentum or c.weight_decay):
        raise SystemExit("bare_w2 --batched: plain local SGD in epochs only (W2's client section)")
    torch.set_num_threads(1)
    data = build_federated_dataset(cfg.data, cfg.seed)
    sizes = data.layout.train_sizes
    if len(set(sizes.tolist())) != 1:
        raise SystemExit("bare_w2 --batched: clients of equal sizes only (W2's 50 images each)")
    splits = data.load_clients(range(data.layout.num_clients))
    xs = torch.stack([torch.from_numpy(splits[i].x_train) for i in range(len(sizes))]).to(device)
    ys = torch.stack([torch.from_numpy(splits[i].y_train) for i in range(len(sizes))]).to(device)
    model = build_model(cfg.model, data.layout, cfg.seed).to(device).train()
    names = [name for name, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    numels = [p.numel() for p in model.parameters()]
    global_ = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def loss(flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        params = {n: part.view(shape) for n, part, shape in zip(names, flat.split(numels), shapes)}
        return F.cross_entropy(functional_call(model, params, (x,)), y)

    gradients = vmap(grad(loss))
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    n, everyone, times = int(sizes[0]), np.arange(len(sizes)), []
    for round_ in range(1, cfg.rounds + 1):
        start = time.perf_counter()
        sampled = sample_clients(cfg.seed, round_, everyone, cfg.clients_per_round)
        picked = torch.from_numpy(sampled).to(device)
        rows = global_.expand(len(sampled), -1).clone()
        x, y = xs[picked], ys[picked]
        which = torch.arange(len(sampled), device=device)[:, None]
        for _ in range(c.epochs):
            order = torch.stack([torch.randperm(n, generator=gen, device=device) for _ in sampled])
            for i in range(0, n - (c.batch_size - 1 if c.drop_last else 0), c.batch_size):
                idx = order[:, i : i + c.batch_size]
                rows.sub_(gradients(rows, x[which, idx], y[which, idx]), alpha=c.lr)
        weights = (np.full(len(sampled), 1 / len(sampled)) if cfg.server.weighting == "uniform"
                   else sizes[sampled] / sizes[sampled].sum())
        w = torch.as_tensor(weights, dtype=rows.dtype, device=device)
        global_ = global_ + cfg.server.lr * ((rows - global_) * w[:, None]).sum(0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1500)
    parser.add_argument("--batched", action="store_true", help="the batched floor (all clients as one vmap)")
    job_options(parser, "config overrides of configs/w2.yaml, as mpifl run --set")
    args = parser.parse_args()
    cfg = load_config(CONFIG, [f"rounds={args.rounds}", *args.overrides])
    began = time.perf_counter()
    times = (batched_rounds if args.batched else bare_rounds)(cfg, torch.device(args.device))
    run = (time.perf_counter() - began) / args.rounds
    median = float(np.median(times[1:] if len(times) > 1 else times))
    load = os.getloadavg()[0]
    print(f"bare {'batched' if args.batched else 'loop'}: {median:.3f} s/round (median), {run:.3f} s/round for the "
          f"whole run, load average {load:.1f}", flush=True)
    record([
        heading(f"W2 floor: bare PyTorch FedAvg {'batched round' if args.batched else 'loop'}, 1 process, 1 thread, "
                f"{cfg.model.name}, device {args.device}"),
        "",
        f"`python benchmarks/bare_w2.py --rounds {args.rounds} --device {args.device}"
        + (" --batched" if args.batched else "")
        + "".join(f" --set {o}" for o in args.overrides) + "`",
        "",
        "| median s/round (rounds 2..R) | run s/round (set-up included) | load average (1 min) at the end |",
        "|---|---|---|",
        f"| {median:.3f} | {run:.3f} | {load:.1f} |",
    ], args.write)


if __name__ == "__main__":
    main()
