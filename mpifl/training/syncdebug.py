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

from mpifl.comm.exactsum import ExactSum, round_sum
from mpifl.data import FederatedLayout
from mpifl.models import FlatModel, build_model, loss_function
from mpifl.models.config import ModelConfig
from mpifl.training.config import ClientConfig
from mpifl.training.executor import LocalSGD, local_sgd
from mpifl.training.localstep import ClientRun, ClientStart, LocalStep
from mpifl.training.sgd import client_generator, evaluation_sums
from mpifl.training.vectorizing import VECTORIZABLE_MODELS

READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__", "__array__")
"""The ``torch.Tensor`` methods that hand a value to the host (on a GPU: wait for the device, then copy)."""


UPLOADS = ("to", "cuda", "copy_")
"""The ``torch.Tensor`` methods that may copy host memory to a device: from pageable memory (or without
``non_blocking``) the copy waits for the device, as a read does."""
CONSTRUCTORS = ("tensor", "as_tensor")
"""The ``torch`` functions that build a tensor from host data (lists, numpy arrays) on the ``device`` they name:
on a GPU, a copy from pageable memory, which waits for the device."""
UPLOAD = "upload"
"""The count of blocking host→device copies in :func:`host_reads`' counter."""


@contextlib.contextmanager
def host_reads() -> Iterator[Counter[str]]:
    """Count, by method name, the tensor reads of :data:`READS` made inside the block (a read made by another
    counted method, ``__array__`` calling ``numpy``, counts once), and as :data:`UPLOAD` the blocking host→device
    copies: a CPU tensor that is not pinned, or is copied without ``non_blocking``, moved to a device by ``to``,
    ``cuda`` or ``copy_``, and host data given to ``torch.tensor`` or ``torch.as_tensor`` with a ``device`` (on the
    CPU too: the copy it would make on a GPU, as a read of a CPU tensor counts)."""
    counter = _ReadCounter()
    with _patched(counter.patches()):
        yield counter.counts


class _ReadCounter:
    """:func:`host_reads`' counts, and the counting stand-ins for the methods and functions it watches."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.depth = 0  # counted calls under way: a read made inside one is that call's, not counted again

    def patches(self) -> list[tuple[Any, str, Callable[..., Any]]]:
        """(owner, name, stand-in) for every method of :data:`READS` and :data:`UPLOADS` and every function of
        :data:`CONSTRUCTORS`."""
        patches: list[tuple[Any, str, Callable[..., Any]]] = [
            (torch.Tensor, name, self.read(name, getattr(torch.Tensor, name))) for name in READS]
        patches += [(torch.Tensor, name, self.moved(getattr(torch.Tensor, name))) for name in UPLOADS]
        patches += [(torch, name, self.built(getattr(torch, name))) for name in CONSTRUCTORS]
        return patches

    def once(self, name: str, work: Callable[[], Any]) -> Any:
        """``work()``, counted under ``name`` unless a counted call made it."""
        if self.depth == 0 and name:
            self.counts[name] += 1
        self.depth += 1
        try:
            return work()
        finally:
            self.depth -= 1

    def read(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        """``method``, a read of the tensor to the host, counted as ``name``."""

        @functools.wraps(method)
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            return self.once(name, lambda: method(tensor, *args, **kwargs))

        return counted

    def moved(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """``method`` (``to``, ``cuda``, ``copy_``), counted as :data:`UPLOAD` where it copies host memory to a
        device with a wait."""

        @functools.wraps(method)
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            flags = [a for a in args if isinstance(a, bool)]  # the first positional bool is non_blocking
            waits = not kwargs.get("non_blocking", flags[0] if flags else False)
            if method.__name__ == "copy_":
                source, target = args[0] if args else kwargs["src"], tensor
            else:
                source, target = tensor, None
            result = self.once("", lambda: method(tensor, *args, **kwargs))
            target = result if target is None else target
            if _blocking_upload(source, target, waits):
                self.counts[UPLOAD] += self.depth == 0
            return result

        return counted

    def built(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` (``torch.tensor``, ``torch.as_tensor``), counted as :data:`UPLOAD` where it is given host
        data and a ``device``."""

        @functools.wraps(function)
        def counted(data: Any, *args: Any, **kwargs: Any) -> Any:
            host = not isinstance(data, torch.Tensor) and kwargs.get("device") is not None
            return self.once(UPLOAD if host else "", lambda: function(data, *args, **kwargs))

        return counted


@contextlib.contextmanager
def _patched(patches: list[tuple[Any, str, Callable[..., Any]]]) -> Iterator[None]:
    """Each (owner, name, stand-in) of ``patches`` set in the block; after it, each owner as it was (an attribute
    the owner only inherited is deleted again, not set to the inherited one)."""
    saved = [(owner, name, name in vars(owner), getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, patched in patches:
        setattr(owner, name, patched)
    try:
        yield
    finally:
        for owner, name, own, original in saved:
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)


def _blocking_upload(source: object, target: object, waits: bool) -> bool:
    """Whether copying ``source`` to ``target`` (tensors) copies host memory to a device with a wait: from pageable
    memory, or from pinned memory without ``non_blocking``."""
    if not (isinstance(source, torch.Tensor) and isinstance(target, torch.Tensor)):
        return False
    if source.device.type != "cpu" or target.device.type == "cpu":
        return False
    return waits or not source.is_pinned()


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
    kernel = LocalSGD(model, loss_fn, vectorized=True, chunk=2)
    start = model.numpy().copy()
    runs = [ClientRun(ClientStart(start), x[a:b], y[a:b], client_generator(0, 1, k)) for k, (a, b) in
            enumerate([(0, 8), (8, 16), (4, SAMPLES)])]
    return _refused(lambda: kernel.train(runs, LocalStep(delta=True), cfg), x.device)


def host_syncs(work: Callable[[int], object], sizes: Sequence[int] = (2, 6)) -> list[int]:
    """The host syncs (reads and blocking uploads, :func:`host_reads`) of ``work(n)`` for each ``n`` of ``sizes``
    (clients, rows): a batched path's syncs must not grow with the clients in the batch, so they are equal."""
    syncs = []
    for size in sizes:
        with host_reads() as counts:
            work(size)
        syncs.append(sum(counts.values()))
    return syncs


def _fold_failure(device: torch.device) -> str | None:
    """A batch of device rows into an exact total reads once (all their windows) and uploads nothing with a wait,
    whatever the batch's size (some rows weighing 0: they are left out on the device); the total's rounding on the
    device neither reads nor waits, from a wire on the device or one on the host."""
    rows = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0)).to(device)

    def fold(count: int) -> ExactSum:
        total = ExactSum(1000, device=device)
        total.add_rows(rows[:count], [1.0, 0.0] * (count // 2))
        return total

    folds = host_syncs(fold)
    total = fold(6)
    wire = total.export(total.window)
    device_wire = torch.from_numpy(wire).to(device)
    rounding = host_syncs(lambda size: round_sum(device_wire if size else wire, total.window, device=device), (0, 1))
    if folds == [1, 1] and rounding == [0, 0]:
        return None
    return f"host syncs for 2 and 6 rows: {folds}; rounding a host and a device wire: {rounding}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpifl.training.syncdebug", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda[:N] (default: cuda where a GPU is visible)")
    parser.add_argument("--models", type=lambda text: text.split(","), default=list(CASES), metavar="NAMES",
                        help=f"model kinds, comma-separated: {', '.join(CASES)} (default: every one)")
    args = parser.parse_args(argv)
    if unknown := [name for name in args.models if name not in CASES]:
        parser.error(f"--models: no {', '.join(unknown)}")
    device = torch.device(args.device)
    if device.type == "cuda":
        from mpifl.training.device import make_deterministic

        make_deterministic()
    results = check(device, args.models)
    for case, failure in results:
        print(f"{'ok  ' if failure is None else 'SYNC'} {device} {case}" + ("" if failure is None else f": {failure}"))
    return int(any(failure is not None for _, failure in results))


if __name__ == "__main__":
    sys.exit(main())
