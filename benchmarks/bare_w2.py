"""Workload W2's floor: the same FedAvg rounds in plain PyTorch, one process, one thread, no mpifl runtime.

    python benchmarks/bare_w2.py [--rounds 1500] [--device cpu|cuda] [--batched [--graph]] [--torch-defaults]
                                 [--set KEY=VALUE ...] [--write]

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

``--batched --graph``: the same round with one local step captured as a CUDA graph (``torch.cuda.graph``) and
replayed for every step: the step reads its batch from fixed buffers (the round's clients' data copied in once a
round, each step's sample indices copied in before its replay), so a step is one graph launch instead of the
hundred-odd kernels of a vmapped forward and backward. An experiment of the floor's, to measure what a captured
step would save mpifl's kernel. On the CPU there is nothing to capture: the same fixed-buffer step runs eagerly
(the same bits as ``--batched``, printed as the final weights' digest) and the line says why it was not captured.

Precision, by default mpifl's own, so that the floor is like for like with the mpifl rounds it is the floor of:
the config's ``allow_tf32`` (``false`` in W2: float32 products, ``torch.backends.cuda.matmul.allow_tf32`` and
``torch.backends.cudnn.allow_tf32`` off, ``float32_matmul_precision("highest")``) set as mpifl's ranks set it
(``mpifl.training.device.set_tf32``), and on a GPU mpifl's deterministic kernels
(``mpifl.training.device.make_deterministic``: cuDNN deterministic, no cuDNN benchmark, deterministic algorithms,
cuBLAS's workspace). ``--set allow_tf32=true`` is the TF32 floor, as mpifl with ``allow_tf32: true`` (still
deterministic): the second row, what a user who accepts TF32 (about 1e-3 relative error a product, other bits)
would be compared with. ``--torch-defaults`` leaves PyTorch's own settings (cuDNN TF32 on, nondeterministic
algorithms allowed): the floor as it was measured before issue 59. On the CPU none of these change a bit (the
final weights' digest is the same).

Reported, as bench_w2.py: the median seconds of a round over rounds 2..R, and the run's seconds per round with
the set-up (building the clients' data) included. ``benchmarks/compare_w2.py`` runs it between mpifl and
pfl-research.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from common import REPO, heading, job_options, record

from mpifl.data import build_federated_dataset
from mpifl.models import build_model
from mpifl.registry import load_config
from mpifl.runtime.sampling import sample_clients
from mpifl.training.device import make_deterministic, set_tf32

CONFIG = REPO / "configs" / "w2.yaml"


def bare_rounds(cfg, device: torch.device) -> tuple[list[float], torch.Tensor]:  # noqa: ANN001 - a RunConfig
    """Train ``cfg``'s FedAvg rounds in a plain loop on one thread; each round's seconds and the final global
    weights (flat)."""
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
    return times, torch.cat([g.reshape(-1) for g in global_])


def captured(step: Callable[[], None], device: torch.device) -> tuple[Callable[[], None], str]:
    """``step`` (which reads and writes only fixed tensors) as a replay of its CUDA graph, and how it ran. As
    torch.cuda.graphs asks, ``step`` runs once on a side stream before the capture (vmap's and autograd's first
    call, the allocator's blocks): that call changes the buffers, which the caller fills anew before each round.
    Captured, the step is recorded, not run. On the CPU: ``step`` itself, eagerly."""
    if device.type != "cuda":
        return step, "not captured: CUDA graphs need a CUDA device; the fixed-buffer step ran eagerly"
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay, "captured: one CUDA graph a local step, replayed"


def batched_rounds(cfg, device: torch.device, graph: bool = False) -> tuple[list[float], torch.Tensor, str]:  # noqa: ANN001 - a RunConfig
    """Train ``cfg``'s FedAvg rounds with each round's clients as one batched computation: each round's seconds,
    the final global weights, and (``graph``) how the captured step ran."""
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
    cohort = cfg.clients_per_round
    which = torch.arange(cohort, device=device)[:, None]
    # the captured step's fixed buffers: the round's rows and data, and the step's sample indices
    rows = torch.empty(cohort, len(global_), device=device)
    x, y = torch.empty((cohort, *xs.shape[1:]), device=device), torch.empty(cohort, n, dtype=ys.dtype, device=device)
    idx = torch.zeros(cohort, c.batch_size, dtype=torch.long, device=device)

    def step() -> None:
        rows.sub_(gradients(rows, x[which, idx], y[which, idx]), alpha=c.lr)

    how = ""
    if graph:
        if c.drop_last is False and n % c.batch_size:
            raise SystemExit("bare_w2 --graph: every batch of one size (W2's 50 images in batches of 10)")
        step, how = captured(step, device)
    for round_ in range(1, cfg.rounds + 1):
        start = time.perf_counter()
        sampled = sample_clients(cfg.seed, round_, everyone, cohort)
        picked = torch.from_numpy(sampled).to(device)
        rows.copy_(global_.expand(len(sampled), -1))
        x.copy_(xs[picked])
        y.copy_(ys[picked])
        for _ in range(c.epochs):
            order = torch.stack([torch.randperm(n, generator=gen, device=device) for _ in sampled])
            for i in range(0, n - (c.batch_size - 1 if c.drop_last else 0), c.batch_size):
                idx.copy_(order[:, i : i + c.batch_size])
                step()
        weights = (np.full(len(sampled), 1 / len(sampled)) if cfg.server.weighting == "uniform"
                   else sizes[sampled] / sizes[sampled].sum())
        w = torch.as_tensor(weights, dtype=rows.dtype, device=device)
        global_ = global_ + cfg.server.lr * ((rows - global_) * w[:, None]).sum(0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times, global_, how


def precision(cfg, device: torch.device, torch_defaults: bool = False) -> str:  # noqa: ANN001 - a RunConfig
    """Set the floor's numeric settings as mpifl's ranks set them for ``cfg`` on ``device`` (or, with
    ``torch_defaults``, leave PyTorch's); what they are, in words."""
    if torch_defaults:
        return "PyTorch's defaults (cuDNN TF32, nondeterministic algorithms allowed)"
    set_tf32(cfg.allow_tf32)
    if device.type == "cuda":
        make_deterministic()
    return f"mpifl's: {'TF32 allowed' if cfg.allow_tf32 else 'float32 (TF32 off)'}" + (
        ", deterministic kernels" if device.type == "cuda" else "")


def digest(tensor: torch.Tensor) -> str:
    """The first 12 hex digits of the sha256 of ``tensor``'s bytes: the same weights, the same digest."""
    return hashlib.sha256(tensor.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:12]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1500)
    parser.add_argument("--batched", action="store_true", help="the batched floor (all clients as one vmap)")
    parser.add_argument("--graph", action="store_true",
                        help="with --batched: one local step captured as a CUDA graph and replayed (eager on the CPU)")
    parser.add_argument("--torch-defaults", action="store_true",
                        help="PyTorch's own precision settings (cuDNN TF32, nondeterministic), not mpifl's")
    job_options(parser, "config overrides of configs/w2.yaml, as mpifl run --set (allow_tf32=true: the TF32 floor)")
    args = parser.parse_args()
    if args.graph and not args.batched:
        parser.error("--graph captures the batched step: give --batched too")
    cfg = load_config(CONFIG, [f"rounds={args.rounds}", *args.overrides])
    device = torch.device(args.device)
    numerics = precision(cfg, device, args.torch_defaults)
    began = time.perf_counter()
    if args.batched:
        times, final, how = batched_rounds(cfg, device, args.graph)
    else:
        (times, final), how = bare_rounds(cfg, device), ""
    run = (time.perf_counter() - began) / args.rounds
    median = float(np.median(times[1:] if len(times) > 1 else times))
    load = os.getloadavg()[0]
    name = "loop" if not args.batched else "batched, graph" if args.graph else "batched"
    print(f"bare {name}: {median:.3f} s/round (median), {run:.3f} s/round for the whole run, load average "
          f"{load:.1f}, final weights {digest(final)}; precision {numerics}" + (f"; graph {how}" if how else ""),
          flush=True)
    record([
        heading(f"W2 floor: bare PyTorch FedAvg {'batched round' if args.batched else 'loop'}"
                + (" (a CUDA graph a step)" if args.graph else "") + f", 1 process, 1 thread, {cfg.model.name}, "
                f"device {args.device}"),
        "",
        f"`python benchmarks/bare_w2.py --rounds {args.rounds} --device {args.device}"
        + (" --batched" if args.batched else "") + (" --graph" if args.graph else "")
        + (" --torch-defaults" if args.torch_defaults else "") + "".join(f" --set {o}" for o in args.overrides)
        + f"`; precision {numerics}",
        "",
        "| median s/round (rounds 2..R) | run s/round (set-up included) | load average (1 min) at the end |",
        "|---|---|---|",
        f"| {median:.3f} | {run:.3f} | {load:.1f} |",
    ], args.write)


if __name__ == "__main__":
    main()
