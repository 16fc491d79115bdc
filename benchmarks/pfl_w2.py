"""Workload W2 in pfl-research (Apple's ``pfl`` package), to time it beside mpifl on one machine.

    python benchmarks/pfl_w2.py [--rounds 1500] [--device cpu|cuda] [--threads 1] [--processes 1]
                                [--config configs/w2.yaml] [--set KEY=VALUE ...] [--check] [--times PATH] [--write]

The workload of configs/w2.yaml (and of benchmarks/bench_w2.py): the same clients, built by mpifl's own data
code from the same config and seed (synthetic class-conditional images, or CIFAR-10 with the same ``--set``
options), the same ``simple_cnn`` module and initial weights, and pfl's FedAvg (``FederatedAveraging``): 50
users per central iteration, 1 local epoch of batch 10 with local SGD at lr 0.1, central SGD at lr 1.0, users
weighted equally (``WeightByUser``), central evaluation every 10 iterations on the pooled test splits of all
clients (batch 10,000). Every user's data is put on the device once, before training, as mpifl's ranks stage
their clients' data.

``--processes N`` (N > 1) runs pfl's own distributed simulation: the script starts itself again under
``torchrun --standalone --nproc_per_node N`` (``python -m torch.distributed.run``, from the same venv), pfl joins
the processes in a gloo process group (``TORCHELASTIC_RUN_ID`` in the environment), and each process trains
every N-th user of the cohort (its share of the 50, ``--threads`` torch threads each), then pfl sums the
processes' deltas with one ``all_reduce`` a round. Every process builds all the clients and the model from the
same config and seed, and numpy's global seed is set to the config's seed before pfl draws its random states
(pfl's workers agree only if it is the same on each), so the cohorts are the same users as in one process
(round r: users 50(r-1) .. 50r-1 of pfl's ``minimize_reuse`` cycle; with 2 processes the even ones on rank 0,
the odd ones on rank 1). Rank 0 times and reports. This is how to set pfl-research beside mpifl on W worker
ranks: mpifl's P = 3 ranks (1 server + 2 workers) against ``--processes 2``.

Every process uses the one device ``--device`` names (``cuda`` is the current GPU, ``cuda:0``), as pfl's
documentation runs several processes per GPU ("Multi-process training"), and the processes' collectives run
over gloo, which sums CUDA tensors as well. pfl 0.6 would do neither under ``torchrun``: it takes
``cuda:LOCAL_RANK`` (absent on a one-GPU machine from the second process on) and picks NCCL whenever CUDA is
available (``PyTorchDistributedContext``: no setting chooses the backend), and NCCL refuses two ranks on one
GPU. So (:func:`shared_device`) the device is ``PFL_PYTORCH_DEVICE`` (pfl's own override), and pfl builds its
process group while ``torch.cuda.is_available`` answers False, which is the CPU's path: the same code runs on
the CPU (a rehearsal of it) and on a GPU, and the backend and device are printed. Nothing of pfl is changed.

``--check`` prints, on every process, the digests of the training data and of the initial weights, the users
the process trained each round, and the final weights' norm and update norm: the same digests and the union of
the users across 1 and N processes, and final norms that agree to rounding (the order of the sum differs), show
the same work. ``--times PATH`` writes rank 0's seconds of every iteration and the median as JSON (for
``benchmarks/compare_w2.py``). ``--config`` runs another FedAvg config of mpifl's (W1: ``configs/b1.yaml``);
``server.weighting: samples`` is pfl's ``WeightByDatapoints``.

pfl-research is optional and no dependency of mpifl. It pins dp-accounting < 0.6 and packaging < 26, so it goes
into a venv of its own, with a CPU torch installed first so that pip does not pull a CUDA build:

    python3 -m venv /tmp/pfl-venv && /tmp/pfl-venv/bin/pip install torch==2.13.0+cpu \\
        && /tmp/pfl-venv/bin/pip install pfl==0.6.0 && /tmp/pfl-venv/bin/pip install -e .
    /tmp/pfl-venv/bin/python benchmarks/pfl_w2.py --rounds 5
    /tmp/pfl-venv/bin/python benchmarks/pfl_w2.py --rounds 5 --processes 2

Reported: the median seconds of a central iteration (2..R, those that evaluate excluded) and the run's seconds
per iteration, everything included.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

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
    parser.add_argument("--processes", type=int, default=1,
                        help="pfl worker processes (torchrun); each trains its share of the cohort")
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "w2.yaml",
                        help="the mpifl FedAvg config to run (W1: configs/b1.yaml)")
    parser.add_argument("--check", action="store_true",
                        help="print every process's data and weight digests and the users it trained")
    parser.add_argument("--times", type=Path, metavar="PATH", help="write rank 0's seconds per iteration as JSON")
    job_options(parser, "config overrides of the config, as mpifl run --set")
    args = parser.parse_args()
    try:
        pfl_version = version("pfl")
    except PackageNotFoundError:
        print(MISSING, file=sys.stderr)
        sys.exit(2)
    if args.processes > 1 and "TORCHELASTIC_RUN_ID" not in os.environ:  # start again under torchrun
        os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  f"--nproc_per_node={args.processes}", __file__, *sys.argv[1:]])
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    if world != args.processes:
        sys.exit(f"pfl_w2: {world} processes started, --processes {args.processes} asked")
    import torch

    device = shared_device(args.device)
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, [f"rounds={args.rounds}", *args.overrides])
    began = time.perf_counter()
    times = run(cfg, torch.device(device), args.check)
    total = time.perf_counter() - began
    if rank:
        return
    training = [t for i, t in enumerate(times) if i > 0 and i % cfg.eval_every]
    median = float(np.median(training or times))
    load = os.getloadavg()[0]
    backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else "none"
    print(f"pfl {pfl_version}, {world} process{'es' if world > 1 else ''} on {device} (backend {backend}): "
          f"{median:.3f} s/iteration (median), {total / args.rounds:.3f} s/iteration for the whole run, "
          f"load average {load:.1f}", flush=True)
    if args.times:
        args.times.write_text(json.dumps({"times": times, "median": median, "run": total / args.rounds}))
    name = "W2" if args.config.name == "w2.yaml" else args.config.name
    record([
        heading(f"{name} in pfl-research {pfl_version}, FederatedAveraging, {cfg.model.name}, device {args.device}, "
                f"{world} process{'es' if world > 1 else ''}"),
        "",
        f"`python benchmarks/pfl_w2.py --rounds {args.rounds} --device {args.device} --threads {args.threads}"
        + (f" --processes {world}" if world > 1 else "")
        + ("" if name == "W2" else f" --config {args.config}")
        + "".join(f" --set {o}" for o in args.overrides) + "`",
        "",
        "| median s/iteration (2..R, no evaluation) | run s/iteration (set-up and evaluation included) | "
        "load average (1 min) at the end |",
        "|---|---|---|",
        f"| {median:.3f} | {total / args.rounds:.3f} | {load:.1f} |",
    ], args.write)


def shared_device(name: str):  # noqa: ANN201 - a torch.device
    """The one device every process of this job uses (``cpu``, or ``cuda`` as ``cuda:0``), with pfl's process
    group built over gloo: pfl reads its device from ``PFL_PYTORCH_DEVICE`` and builds its process group when
    its torch operations are imported, picking NCCL (and ``cuda:LOCAL_RANK``) if CUDA is available, so it is
    imported here with ``torch.cuda.is_available`` answering False (restored right after). On the CPU that is
    what it answers anyway: a CPU run goes through this same path."""
    import torch

    device = torch.device("cuda:0" if name == "cuda" else name)
    os.environ["PFL_PYTORCH_DEVICE"] = str(device)
    available = torch.cuda.is_available
    torch.cuda.is_available = lambda: False  # type: ignore[assignment]
    try:
        import pfl.internal.ops.pytorch_ops  # noqa: F401 - builds pfl's process group (gloo) on import
    finally:
        torch.cuda.is_available = available  # type: ignore[assignment]
    if torch.distributed.is_initialized() and torch.distributed.get_backend() != "gloo":
        sys.exit(f"pfl_w2: pfl's process group uses {torch.distributed.get_backend()}, not gloo")
    return device


def digest(tensors) -> str:  # noqa: ANN001 - torch tensors
    """The first 12 hex digits of the sha256 of ``tensors``' bytes, in order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def run(cfg, device, check: bool = False) -> list[float]:  # noqa: ANN001 - a RunConfig and a torch.device
    """Train ``cfg``'s W2 in pfl; each central iteration's seconds (on this process: all of them wait for the
    round's ``all_reduce``). ``check``: print this process's digests and users."""
    import torch
    import torch.nn.functional as F
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints, WeightByUser
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
            if check:
                print(f"pfl rank {rank}/{world}: iteration {central_iteration + 1} trained users {trained}",
                      flush=True)
                trained.clear()
            return False, Metrics()

    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    data = build_federated_dataset(cfg.data, cfg.seed)
    splits = data.load_clients(range(cfg.data.num_clients))
    users = {c: [torch.from_numpy(s.x_train).to(device), torch.from_numpy(s.y_train).to(device)]
             for c, s in splits.items()}
    central = Dataset(raw_data=[torch.from_numpy(np.concatenate([s.x_test for s in splits.values()])).to(device),
                                torch.from_numpy(np.concatenate([s.y_test for s in splits.values()])).to(device)])
    trained: list[int] = []

    def user_dataset(user_id: int) -> Dataset:  # FederatedDataset.from_slices's, noting the users trained
        trained.append(int(user_id))
        return Dataset(users[user_id], user_id=user_id)

    np.random.seed(cfg.seed)  # pfl's random states (sampler seeds, overshoot) are drawn from numpy's global one
    federated = FederatedDataset(user_dataset, get_user_sampler("minimize_reuse", list(users)))
    module = Classifier(build_model(cfg.model, data.layout, cfg.seed)).to(device)
    initial = [p.detach().clone() for p in module.parameters()]
    if check:
        print(f"pfl rank {rank}/{world}: {torch.get_num_threads()} torch thread(s), device {device}, "
              f"{len(users)} users, data {digest(t for u in users.values() for t in u)}, "
              f"{sum(p.numel() for p in initial):,} parameters, initial weights {digest(initial)}", flush=True)
    model = PyTorchModel(model=module, local_optimizer_create=torch.optim.SGD,
                         central_optimizer=torch.optim.SGD(module.parameters(), cfg.server.lr))
    weighting = WeightByUser() if cfg.server.weighting == "uniform" else WeightByDatapoints()
    backend = SimulatedBackend(training_data=federated, val_data=None, postprocessors=[weighting])
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
    if check:
        final = [p.detach() for p in module.parameters()]
        norm = float(torch.sqrt(sum((p.double() ** 2).sum() for p in final)))
        step = float(torch.sqrt(sum(((p.double() - q.double()) ** 2).sum() for p, q in zip(final, initial))))
        print(f"pfl rank {rank}/{world}: final weights norm {norm:.9g}, update norm {step:.9g}", flush=True)
    return stopwatch.times


if __name__ == "__main__":
    main()
