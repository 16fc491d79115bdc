"""Workload W2 in pfl-research (Apple's ``pfl`` package), to time it beside mpifl on one machine.

    python benchmarks/pfl_w2.py [--rounds 1500] [--device cpu|cuda] [--threads 1] [--set KEY=VALUE ...] [--write]

The workload of configs/w2.yaml (and of benchmarks/bench_w2.py): the same clients, built by mpifl's own data
code from the same config and seed (synthetic class-conditional images, or CIFAR-10 with the same ``--set``
options), the same ``simple_cnn`` module and initial weights, and pfl's FedAvg (``FederatedAveraging``): 50
users per central iteration, 1 local epoch of batch 10 with local SGD at lr 0.1, central SGD at lr 1.0, users
weighted equally (``WeightByUser``), central evaluation every 10 iterations on the pooled test splits of all
clients (batch 10,000). Every user's data is put on the device once, before training, as mpifl's ranks stage
their clients' data. One process: pfl's multi-worker mode (torchrun) is not used.

pfl-research is optional and no dependency of mpifl. It pins dp-accounting < 0.6 and packaging < 26, so it goes
into a venv of its own, with a CPU torch installed first so that pip does not pull a CUDA build:

    python3 -m venv /tmp/pfl-venv && /tmp/pfl-venv/bin/pip install torch==2.13.0+cpu \\
        && /tmp/pfl-venv/bin/pip install pfl==0.6.0 && /tmp/pfl-venv/bin/pip install -e .
    /tmp/pfl-venv/bin/python benchmarks/pfl_w2.py --rounds 5

Reported: the median seconds of a central iteration (2..R, those that evaluate excluded) and the run's seconds
per iteration, everything included.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from importlib.metadata import PackageNotFoundError, version

import numpy as np
from common import REPO, heading, job_options, record

from mpifl.data import build_federated_dataset
from mpifl.models import build_model
from mpifl.registry import load_config

MISSING = ("pfl_w2: pfl-research is not installed (pip install pfl==0.6.0, in a venv of its own with a CPU torch "
           "installed first: see this script's docstring)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1500)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (mpifl's threads_per_rank)")
    job_options(parser, "config overrides of configs/w2.yaml, as mpifl run --set")
    args = parser.parse_args()
    try:
        pfl_version = version("pfl")
    except PackageNotFoundError:
        print(MISSING, file=sys.stderr)
        sys.exit(2)
    os.environ["PFL_PYTORCH_DEVICE"] = args.device  # read by pfl when it picks its device
    import torch

    torch.set_num_threads(args.threads)
    cfg = load_config(REPO / "configs" / "w2.yaml", [f"rounds={args.rounds}", *args.overrides])
    began = time.perf_counter()
    times = run(cfg, torch.device(args.device))
    total = time.perf_counter() - began
    training = [t for i, t in enumerate(times) if i > 0 and i % cfg.eval_every]
    median = float(np.median(training or times))
    load = os.getloadavg()[0]
    print(f"pfl {pfl_version}: {median:.3f} s/iteration (median), {total / args.rounds:.3f} s/iteration for the "
          f"whole run, load average {load:.1f}", flush=True)
    record([
        heading(f"W2 in pfl-research {pfl_version}, FederatedAveraging, simple_cnn, device {args.device}"),
        "",
        f"`python benchmarks/pfl_w2.py --rounds {args.rounds} --device {args.device} --threads {args.threads}`"
        + "".join(f" --set {o}" for o in args.overrides),
        "",
        "| median s/iteration (2..R, no evaluation) | run s/iteration (set-up and evaluation included) | "
        "load average (1 min) at the end |",
        "|---|---|---|",
        f"| {median:.3f} | {total / args.rounds:.3f} | {load:.1f} |",
    ], args.write)


def run(cfg, device) -> list[float]:  # noqa: ANN001 - a RunConfig and a torch.device
    """Train ``cfg``'s W2 in pfl; each central iteration's seconds."""
    import torch
    import torch.nn.functional as F
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByUser
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.callback.central_evaluation import CentralEvaluationCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics, Weighted
    from pfl.model.pytorch import PyTorchModel

    class Classifier(torch.nn.Module):
        """mpifl's module with the loss and metrics pfl's PyTorchModel calls."""

        def __init__(self, module: torch.nn.Module):
            super().__init__()
            self.module = module

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.module(x)

        def loss(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> torch.Tensor:  # noqa: A002
            self.train(not eval)
            return F.cross_entropy(self(x), y)

        @torch.no_grad()
        def metrics(self, x: torch.Tensor, y: torch.Tensor, eval: bool = True) -> dict:  # noqa: A002
            self.train(not eval)
            out = self(x)
            return {"loss": Weighted(float(F.cross_entropy(out, y, reduction="sum")), len(y)),
                    "accuracy": Weighted(float((out.argmax(1) == y).sum()), len(y))}

    class Stopwatch(TrainingProcessCallback):
        def __init__(self) -> None:
            self.times: list[float] = []
            self.last = time.perf_counter()

        def on_train_begin(self, *, model) -> Metrics:  # noqa: ANN001
            self.last = time.perf_counter()
            return Metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):  # noqa: ANN001, ANN201
            now = time.perf_counter()
            self.times.append(now - self.last)
            self.last = now
            return False, Metrics()

    data = build_federated_dataset(cfg.data, cfg.seed)
    splits = data.load_clients(range(cfg.data.num_clients))
    users = {c: [torch.from_numpy(s.x_train).to(device), torch.from_numpy(s.y_train).to(device)]
             for c, s in splits.items()}
    central = Dataset(raw_data=[torch.from_numpy(np.concatenate([s.x_test for s in splits.values()])).to(device),
                                torch.from_numpy(np.concatenate([s.y_test for s in splits.values()])).to(device)])
    federated = FederatedDataset.from_slices(users, get_user_sampler("minimize_reuse", list(users)))
    module = Classifier(build_model(cfg.model, data.layout, cfg.seed)).to(device)
    model = PyTorchModel(model=module, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(module.parameters(), cfg.server.lr))
    backend = SimulatedBackend(training_data=federated, val_data=None, postprocessors=[WeightByUser()])
    stopwatch = Stopwatch()
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(central_num_iterations=cfg.rounds, evaluation_frequency=cfg.eval_every,
                                           train_cohort_size=cfg.clients_per_round, val_cohort_size=0),
        backend=backend, model=model,
        model_train_params=NNTrainHyperParams(local_learning_rate=cfg.client.lr, local_num_epochs=cfg.client.epochs,
                                              local_batch_size=cfg.client.batch_size),
        model_eval_params=NNEvalHyperParams(local_batch_size=10_000),
        callbacks=[CentralEvaluationCallback(central, model_eval_params=NNEvalHyperParams(local_batch_size=10_000),
                                             frequency=cfg.eval_every), stopwatch])
    return stopwatch.times


if __name__ == "__main__":
    main()
