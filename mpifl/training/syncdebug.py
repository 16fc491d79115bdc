"""Host reads during a client's local computation: counted anywhere, refused where they must not be.

A GPU runs ahead of the host until the host asks for a value (``.item()``, ``float(t)``, ``if t > c``,
``.cpu()``, ``.numpy()``, ``.tolist()``): then the host waits for every queued kernel, and a small model's
local step, launch-bound on a GPU, loses most of its speed. So local SGD (:func:`~mpifl.training.sgd.local_sgd`)
and the evaluation sums read nothing, and an algorithm reads a client's results once per client, never once
per step (tests/test_syncs.py holds every algorithm to that).

:func:`host_reads` counts those reads on any device (on the CPU they cost nothing, but each would be a wait on a
GPU). :func:`refusing_host_syncs` fails on any, and on a GPU also switches on CUDA's own detector
(``torch.cuda.set_sync_debug_mode("error")``), which also sees synchronizing copies. The GPU check runs

    python -m mpifl.training.syncdebug --device cuda

which trains and evaluates every built-in model kind with every option that touches the step (clipping,
momentum, weight decay, crop-and-flip, both batch samplings) under it, one line per case, exit code 1 if any
case synchronized.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from mpifl.comm.exactsum import ExactSum
from mpifl.data import FederatedLayout
from mpifl.models import FlatModel, build_model, loss_function
from mpifl.models.config import ModelConfig
from mpifl.training.config import ClientConfig
from mpifl.training.executor import VECTORIZABLE_MODELS, ClientRun, LocalSGD, LocalStep, local_sgd
from mpifl.training.sgd import client_generator, evaluation_sums

READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__", "__array__")
"""The ``torch.Tensor`` methods that hand a value to the host (on a GPU: wait for the device, then copy)."""


@contextlib.contextmanager
def host_reads() -> Iterator[Counter[str]]:
    """Count, by method name, the tensor reads of :data:`READS` made inside the block (a read made by another
    counted method, ``__array__`` calling ``numpy``, counts once)."""
    counts: Counter[str] = Counter()
    depth = [0]
    own = {name: name in vars(torch.Tensor) for name in READS}
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                counts[name] += 1
            depth[0] += 1
            try:
                return method(self, *args, **kwargs)
            finally:
                depth[0] -= 1

        return read

    for name, method in originals.items():
        setattr(torch.Tensor, name, counted(name, method))
    try:
        yield counts
    finally:
        for name, method in originals.items():
            if own[name]:
                setattr(torch.Tensor, name, method)
            else:
                delattr(torch.Tensor, name)


class HostSyncError(RuntimeError):
    """Code that must not wait for the device did."""


@contextlib.contextmanager
def refusing_host_syncs(device: torch.device | str) -> Iterator[Counter[str]]:
    """Raise :class:`HostSyncError` if the block reads a tensor on the host; on a CUDA ``device`` also under
    CUDA's sync debug mode ``error``, which stops at the first synchronizing operation of any kind."""
    cuda = torch.device(device).type == "cuda"
    previous = torch.cuda.get_sync_debug_mode() if cuda else 0
    with host_reads() as counts:
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
        try:
            yield counts
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(previous)
    if counts:
        raise HostSyncError(f"host reads: {dict(counts)}")


CASES: dict[str, tuple[dict[str, Any], tuple[int, ...], str]] = {
    # model name: (model config, one sample's shape, input dtype)
    "mlp": ({"name": "mlp", "hidden": [32]}, (20,), "float32"),
    "logistic": ({"name": "logistic"}, (20,), "float32"),
    "linear": ({"name": "linear"}, (20,), "float32"),
    "cnn": ({"name": "cnn", "channels": [8], "fc_hidden": 32}, (3, 16, 16), "float32"),
    "lenet": ({"name": "lenet"}, (3, 32, 32), "float32"),
    "convnet": ({"name": "convnet", "channels": [8, 16], "hidden": [32], "kernel_size": 3}, (1, 16, 16), "float32"),
    "resnet20": ({"name": "resnet20", "batch_norm": True}, (3, 16, 16), "float32"),
    "simple_cnn": ({"name": "simple_cnn"}, (3, 16, 16), "float32"),
    "char_lstm": ({"name": "char_lstm", "embed_dim": 8, "lstm_hidden": 32}, (20,), "int64"),
}
CLASSES, SAMPLES = 5, 20


def example(name: str, device: torch.device) -> tuple[FlatModel, torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A model of kind ``name`` and random data for it on ``device``: (model, loss, x, y)."""
    model_cfg, shape, dtype = CASES[name]
    regression = name == "linear"
    gen = torch.Generator().manual_seed(0)
    layout = FederatedLayout(1, np.array([SAMPLES]), np.array([False]), shape, 0 if regression else CLASSES,
                             "regression" if regression else "classification", dtype,
                             np.zeros((1, 0 if regression else CLASSES), dtype=np.int64))
    x = (torch.randint(0, CLASSES + 1, (SAMPLES, *shape), generator=gen) if dtype == "int64"
         else torch.randn(SAMPLES, *shape, generator=gen))
    y = torch.randn(SAMPLES, generator=gen) if regression else torch.randint(0, CLASSES, (SAMPLES,), generator=gen)
    model = FlatModel(build_model(ModelConfig(**model_cfg), layout, 0).to(device))
    return model, loss_function(layout), x.to(device), y.to(device)


def step_configs(images: bool) -> dict[str, ClientConfig]:
    """Every option of :class:`ClientConfig` that changes what a step computes."""
    base = ClientConfig(lr=0.01, momentum=0.9, weight_decay=1e-4, clip_norm=0.5, epochs=2, batch_size=8)
    configs = {"epochs": base, "fresh": ClientConfig(lr=0.01, steps=3, batch_size=8, batch_sampling="fresh")}
    if images:
        configs["crop_flip"] = ClientConfig(lr=0.01, clip_norm=0.5, epochs=1, batch_size=8, augment="crop_flip")
    return configs


def check(device: torch.device | str, names: Sequence[str] = tuple(CASES)) -> list[tuple[str, str | None]]:
    """Local SGD and the evaluation sums of the model kinds ``names`` on ``device`` with each of their
    :func:`step_configs`, and the batched kernel for those it trains, under :func:`refusing_host_syncs`; and the
    exact fold of a batch of device rows, which reads once: ``(case, None)`` for each case that read nothing (more
    than it must), ``(case, what it read)`` for each that did."""
    device = torch.device(device)
    results: list[tuple[str, str | None]] = []
    for name in names:
        model, loss_fn, x, y = example(name, device)
        for label, cfg in step_configs(x.dim() == 4).items():
            results.append((f"{name} {label}", _refused(functools.partial(_loop, model, loss_fn, x, y, cfg), device)))
            if name in VECTORIZABLE_MODELS:
                results.append((f"{name} {label} kernel", _kernel_failure(model, loss_fn, x, y, cfg)))
    results.append(("exact fold of a batch of rows", _fold_failure(device)))
    return results


def _loop(model: FlatModel, loss_fn: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, cfg: ClientConfig) -> None:
    """One client's local SGD, then its evaluation sums."""
    local_sgd(model, x, y, loss_fn, cfg, client_generator(0, 1, 0))
    evaluation_sums(model.module, x, y, loss_fn, batch=7)


def _refused(work: Callable[[], object], device: torch.device) -> str | None:
    """``work()`` under :func:`refusing_host_syncs`: ``None``, or what it read."""
    try:
        with refusing_host_syncs(device):
            work()
    except RuntimeError as exc:  # a host read, or CUDA's "called a synchronizing CUDA operation"
        if not isinstance(exc, HostSyncError) and "synchroniz" not in str(exc):
            raise
        return str(exc).strip().splitlines()[0]
    return None


def _kernel_failure(model: FlatModel, loss_fn: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                    cfg: ClientConfig) -> str | None:
    """Three clients (two of one size, one of another: two groups) through the batched kernel, deltas kept on
    the device: nothing may be read."""
    kernel = LocalSGD(model, loss_fn, batched=True, chunk=2)
    start = model.numpy().copy()
    runs = [ClientRun(start, x[a:b], y[a:b], client_generator(0, 1, k)) for k, (a, b) in
            enumerate([(0, 8), (8, 16), (4, SAMPLES)])]
    return _refused(lambda: kernel.train(runs, LocalStep(delta=True), cfg), x.device)


def _fold_failure(device: torch.device) -> str | None:
    """A batch of device rows into an exact total reads once (all their windows), whatever the batch's size."""
    rows = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0)).to(device)
    reads = []
    for count in (2, 6):
        total = ExactSum(1000, device=device)
        with host_reads() as counts:
            total.add_rows(rows[:count], [1.0] * count)
        reads.append(sum(counts.values()))
    return None if reads == [1, 1] else f"host reads for 2 and 6 rows: {reads}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpifl.training.syncdebug", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda[:N] (default: cuda where a GPU is visible)")
    device = torch.device(parser.parse_args(argv).device)
    if device.type == "cuda":
        from mpifl.training.device import make_deterministic

        make_deterministic()
    results = check(device)
    for case, failure in results:
        print(f"{'ok  ' if failure is None else 'SYNC'} {device} {case}" + ("" if failure is None else f": {failure}"))
    return int(any(failure is not None for _, failure in results))


if __name__ == "__main__":
    sys.exit(main())
