"""The executor alone, in process: seconds of one ``LocalSGD.train`` of 20 clients, the loop and the vectorized path.

    python benchmarks/bench_localsgd.py [--repeats 6]
    PYTHONPATH=/tmp/base python benchmarks/bench_localsgd.py   # another checkout (git worktree add /tmp/base REV)

The loop on B1's CNN (16-32 channels, 128 hidden, 1×28×28, 64 samples a client, 2 epochs of batch 16: 8 steps),
the vectorized path on an MLP 256-256 (60 features, the same clients and steps), one thread, FedAvg's step (the
delta). Printed: the least seconds of ``--repeats`` trainings of each (the least is what load on a shared machine
disturbs least); run it in two checkouts by turns to compare them. Checkouts from before the executor's own
``ClientStart`` (issue 59) are run with their own names.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from mpifl.data import FederatedLayout
from mpifl.models import FlatModel, build_model
from mpifl.models.config import ModelConfig
from mpifl.training import executor
from mpifl.training.config import ClientConfig
from mpifl.training.sgd import client_generator

CASES = {"loop": (ModelConfig(name="cnn", channels=(16, 32), fc_hidden=128), (1, 28, 28), False),
         "vectorized": (ModelConfig(name="mlp", hidden=(256, 256)), (60,), True)}


def least_seconds(name: str, repeats: int) -> float:
    model_cfg, shape, vectorized = CASES[name]
    layout = FederatedLayout(2, np.ones(2, dtype=np.int64), np.zeros(2, dtype=bool), shape, 10, "classification",
                             "float32", np.zeros((2, 10), dtype=np.int64))
    flat = FlatModel(build_model(model_cfg, layout, seed=0))
    start = flat.numpy().copy()
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(64, *shape, generator=gen) for _ in range(20)]
    ys = [torch.randint(0, 10, (64,), generator=gen) for _ in range(20)]
    try:  # this checkout's names
        from mpifl.training.localstep import ClientRun, ClientStart, LocalStep

        sgd = executor.LocalSGD(flat, torch.nn.CrossEntropyLoss(), vectorized=vectorized, chunk=16)

        def runs(round_: int) -> list:
            return [ClientRun(ClientStart(start), x, y, client_generator(0, round_, c))
                    for c, (x, y) in enumerate(zip(xs, ys))]
    except ImportError:  # before issue 59: a start was the run's own field, the path was "batched"
        ClientRun, LocalStep = executor.ClientRun, executor.LocalStep
        sgd = executor.LocalSGD(flat, torch.nn.CrossEntropyLoss(), batched=vectorized, chunk=16)

        def runs(round_: int) -> list:
            return [ClientRun(start, x, y, client_generator(0, round_, c)) for c, (x, y) in enumerate(zip(xs, ys))]
    cfg = ClientConfig(lr=0.05, epochs=2, batch_size=16)
    best = float("inf")
    for round_ in range(repeats):
        began = time.perf_counter()
        sgd.train(runs(round_), LocalStep(delta=True), cfg)
        best = min(best, time.perf_counter() - began)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in CASES:
        print(f"{name}: {least_seconds(name, args.repeats):.4f} s")


if __name__ == "__main__":
    main()
