"""Host reads during a client's local computation: counted anywhere, refused where they must not be; and the
bytes that cross between host and device, counted anywhere.

A GPU runs ahead of the host until the host asks for a value (``.item()``, ``float(t)``, ``if t > c``,
``.cpu()``, ``.numpy()``, ``.tolist()``): then the host waits for every queued kernel, and a small model's
local step, launch-bound on a GPU, loses most of its speed. So local SGD (:func:`~mpifl.training.sgd.local_sgd`)
and the evaluation sums read nothing, and an algorithm reads a client's results once per client, never once
per step (tests/test_syncs.py holds every algorithm to that).

:func:`host_reads` counts those reads on any device (on the CPU they cost nothing, but each would be a wait on a
GPU); :func:`host_traffic` counts them too, and the bytes a GPU rank copies each way (on the CPU, the bytes it
would copy: the rules are in its docstring). :func:`refusing_host_syncs` fails on any read, and on a GPU also
switches on CUDA's own detector (``torch.cuda.set_sync_debug_mode("error")``), which also sees synchronizing
copies. The GPU check runs

    python -m mpifl.training.syncdebug --device cuda

which trains and evaluates every built-in model kind with every option that touches the step (clipping,
momentum, weight decay, crop-and-flip, both batch samplings) under it, one line per case, exit code 1 if any
case synchronized.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
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
SCALAR_READS = ("item", "__bool__", "__float__", "__int__", "__index__")
"""The reads of :data:`READS` that copy one element (the others copy the whole tensor)."""

UPLOADS = ("to", "cuda", "copy_")
"""The ``torch.Tensor`` methods that may copy host memory to a device: from pageable memory (or without
``non_blocking``) the copy waits for the device, as a read does."""
CONSTRUCTORS = ("tensor", "as_tensor")
"""The ``torch`` functions that build a tensor from host data (lists, numpy arrays) on the ``device`` they name:
on a GPU, a copy from pageable memory, which waits for the device."""
UPLOAD = "upload"
"""The count of blocking host→device copies in :func:`host_reads`' counter."""


def _plan_bytes(plan: Any, *_: Any) -> int:  # noqa: ANN401 - a BatchPlan
    return _nbytes(plan.rows) + _nbytes(plan.crops)


DOORS: dict[tuple[str, str], Callable[..., int]] = {
    ("mpifl.training.sgd", "to_device"): lambda tensor, *_: _nbytes(tensor),
    ("mpifl.training.sgd", "BatchPlan.to"): _plan_bytes,
    ("mpifl.models.flat", "FlatModel.load"): lambda _, flat: _nbytes(flat) if isinstance(flat, np.ndarray) else 0,
    ("mpifl.comm.exactsum._backends", "TorchOps.upload"): lambda _, array: _nbytes(array),
}
"""mpifl's host→device doors that make no ``Tensor.to`` call on the CPU (each returns its input there, or copies
it on the host), so that only the door shows the copy it makes on a GPU: (module, name) → the bytes a call copies
(the one pinned upload; a client's batch plan; a host array loaded into a model, where a tensor copies nothing
itself; a host array given to the exact sum's torch backend). A door missing (an older checkout) is skipped."""


@dataclass
class Traffic:
    """What :func:`host_traffic` counted: the reads of :func:`host_reads` and the bytes each way."""

    reads: Counter[str] = field(default_factory=Counter)
    to_device: int = 0  # bytes host→device
    to_host: int = 0  # bytes device→host
    sites: Counter[tuple[str, str]] | None = None  # (direction, "file:line function") → bytes, if asked for
    # (direction, bytes) → how many copies of that size: how many transfers a model's size or more there were
    copies: Counter[tuple[str, int]] = field(default_factory=Counter)

    def add(self, direction: str, nbytes: int) -> None:
        """``nbytes`` more ``direction`` (``to_device`` or ``to_host``), by caller where :attr:`sites` is kept."""
        setattr(self, direction, getattr(self, direction) + nbytes)
        if nbytes:
            self.copies[direction, nbytes] += 1
        if self.sites is not None:
            self.sites[direction, _caller()] += nbytes


@contextlib.contextmanager
def host_reads() -> Iterator[Counter[str]]:
    """Count, by method name, the tensor reads of :data:`READS` made inside the block (a read made by another
    counted method, ``__array__`` calling ``numpy``, counts once), and as :data:`UPLOAD` the blocking host→device
    copies: a CPU tensor that is not pinned, or is copied without ``non_blocking``, moved to a device by ``to``,
    ``cuda`` or ``copy_``, and host data given to ``torch.tensor`` or ``torch.as_tensor`` with a ``device`` (on the
    CPU too: the copy it would make on a GPU, as a read of a CPU tensor counts)."""
    with host_traffic() as traffic:
        yield traffic.reads


@contextlib.contextmanager
def host_traffic(sites: bool = False) -> Iterator[Traffic]:
    """:func:`host_reads`' counts, and the bytes that cross between host and device as a GPU rank copies them:
    on a GPU what is copied, on the CPU (where the host is the device and nothing is) what would be. Each copy
    counts once, where it starts (a copy made inside a counted one is that one's):

    * device→host: a read of :data:`READS` copies what it reads, the whole tensor or (``item``, ``float(t)``, ...)
      one element; a read of the tensor that the previous read returned (``t.cpu().numpy()``) copies nothing more;
    * host→device: a call of a door of :data:`DOORS`, the bytes the door names; ``torch.tensor`` and
      ``torch.as_tensor`` of host data with a ``device``, the tensor made; ``Tensor.to``, ``cuda`` and ``copy_``
      from host memory to a device, the tensor copied; and on the CPU a ``Tensor.to`` that names a device (not
      ``"cpu"``, the host's name in mpifl) for a tensor made from host data (``torch.from_numpy``, or
      ``torch.tensor`` and ``torch.as_tensor`` without a device) inside the block.

    Reads of tensors that live on the host on a GPU too are counted, as :func:`host_reads` counts them. ``sites``:
    the bytes by caller as well (:attr:`Traffic.sites`)."""
    traffic = Traffic(sites=Counter() if sites else None)
    counter = _ReadCounter(traffic)
    try:
        with _patched(counter.patches() + counter.doors()):
            yield traffic
    finally:
        counter.active = False
        counter.unbind()


class _ReadCounter:
    """:func:`host_traffic`'s counts, and the counting stand-ins for the methods, functions and doors it watches."""

    def __init__(self, traffic: Traffic) -> None:
        self.traffic, self.counts = traffic, traffic.reads
        self.depth = 0  # counted calls under way: a read made inside one is that call's, not counted again
        self.crossing = 0  # doors under way: a copy made inside one is the door's
        self.last: torch.Tensor | None = None  # what the last counted read returned
        self.from_host: dict[int, weakref.ref[torch.Tensor]] = {}  # tensors made from host data, by id
        self.active = True
        self.bound: list[tuple[str, Callable[..., Any], Callable[..., Any]]] = []  # (name, original, stand-in)

    def patches(self) -> list[tuple[Any, str, Callable[..., Any]]]:
        """(owner, name, stand-in) for every method of :data:`READS` and :data:`UPLOADS`, every function of
        :data:`CONSTRUCTORS` and ``torch.from_numpy``."""
        patches: list[tuple[Any, str, Callable[..., Any]]] = [
            (torch.Tensor, name, self.read(name, getattr(torch.Tensor, name))) for name in READS]
        patches += [(torch.Tensor, name, self.moved(getattr(torch.Tensor, name))) for name in UPLOADS]
        patches += [(torch, name, self.built(getattr(torch, name))) for name in (*CONSTRUCTORS, "from_numpy")]
        return patches

    def doors(self) -> list[tuple[Any, str, Callable[..., Any]]]:
        """(owner, name, stand-in) for every door of :data:`DOORS` there is: a method on its class, a function in
        every module that holds it by name (:meth:`unbind` then undoes a binding made inside the block)."""
        patches: list[tuple[Any, str, Callable[..., Any]]] = []
        for (module_name, path), size in DOORS.items():
            owner: Any = sys.modules.get(module_name)
            if owner is None:
                with contextlib.suppress(ImportError):
                    owner = importlib.import_module(module_name)
            *outer, name = path.split(".")
            for part in outer:
                owner = getattr(owner, part, None)
            original = getattr(owner, name, None)
            if original is None:
                continue
            stand_in = self.door(original, size)
            if outer:
                patches.append((owner, name, stand_in))
                continue
            self.bound.append((name, original, stand_in))
            patches += [(module, name, stand_in) for module in list(sys.modules.values())
                        if getattr(module, "__dict__", {}).get(name) is original]
        return patches

    def unbind(self) -> None:
        """A door's stand-in that a module imported inside the block bound by name: the original again."""
        for name, original, stand_in in self.bound:
            for module in list(sys.modules.values()):
                if getattr(module, "__dict__", {}).get(name) is stand_in:
                    setattr(module, name, original)

    def once(self, name: str, work: Callable[[], Any]) -> Any:
        """``work()``, counted under ``name`` unless a counted call made it."""
        if self.depth == 0 and name:
            self.counts[name] += 1
        self.depth += 1
        try:
            return work()
        finally:
            self.depth -= 1

    def crossed(self, direction: str, nbytes: int) -> None:
        """A copy of ``nbytes`` ``direction``, unless a door under way makes it."""
        if self.crossing == 0 and self.active:
            self.traffic.add(direction, nbytes)

    def read(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        """``method``, a read of the tensor to the host, counted as ``name``."""

        @functools.wraps(method)
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            outer = self.depth == 0
            result = self.once(name, lambda: method(tensor, *args, **kwargs))
            if outer:
                if tensor is not self.last:
                    self.crossed("to_host", tensor.element_size() if name in SCALAR_READS else _nbytes(tensor))
                self.last = result if isinstance(result, torch.Tensor) else None
            return result

        return counted

    def moved(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """``method`` (``to``, ``cuda``, ``copy_``), counted as :data:`UPLOAD` where it copies host memory to a
        device with a wait, and its bytes where it copies host memory to a device (see :func:`host_traffic`)."""

        @functools.wraps(method)
        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            flags = [a for a in args if isinstance(a, bool)]  # the first positional bool is non_blocking
            waits = not kwargs.get("non_blocking", flags[0] if flags else False)
            if method.__name__ == "copy_":
                source, target = args[0] if args else kwargs["src"], tensor
            else:
                source, target = tensor, None
            outer = self.depth == 0
            result = self.once("", lambda: method(tensor, *args, **kwargs))
            target = result if target is None else target
            if _blocking_upload(source, target, waits):
                self.counts[UPLOAD] += outer
            emulated = method.__name__ == "to" and self.made_from_host(tensor) and _names_a_device(args, kwargs)
            if outer and (emulated or _crosses(source, target)):
                self.crossed("to_device", _nbytes(source))
            return result

        return counted

    def built(self, function: Callable[..., Any]) -> Callable[..., Any]:
        """``function`` (``torch.tensor``, ``torch.as_tensor``, ``torch.from_numpy``), counted as :data:`UPLOAD`
        with the bytes of what it makes where it is given host data and a ``device``; a tensor it makes on the
        host is noted as made from host data."""

        @functools.wraps(function)
        def counted(data: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: ANN401 - host data or a tensor
            from_host = not isinstance(data, torch.Tensor)
            device = kwargs.get("device") is not None
            outer = self.depth == 0
            result = self.once(UPLOAD if from_host and device else "", lambda: function(data, *args, **kwargs))
            if from_host and device and outer:
                self.crossed("to_device", _nbytes(result))
            elif from_host and isinstance(result, torch.Tensor):
                self.note_from_host(result)
            return result

        return counted

    def note_from_host(self, tensor: torch.Tensor) -> None:
        """Note ``tensor`` as made from host data, until it is freed."""
        key = id(tensor)

        def freed(ref: weakref.ref[torch.Tensor]) -> None:
            if self.from_host.get(key) is ref:
                del self.from_host[key]

        self.from_host[key] = weakref.ref(tensor, freed)

    def made_from_host(self, tensor: torch.Tensor) -> bool:
        ref = self.from_host.get(id(tensor))
        return ref is not None and ref() is tensor

    def door(self, function: Callable[..., Any], size: Callable[..., int]) -> Callable[..., Any]:
        """``function``, a door of :data:`DOORS`, copying ``size(*args)`` bytes to the device."""

        @functools.wraps(function)
        def counted(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return function(*args, **kwargs)
            self.crossed("to_device", size(*args, **kwargs))
            self.crossing += 1
            try:
                return function(*args, **kwargs)
            finally:
                self.crossing -= 1

        return counted


def _nbytes(value: object) -> int:
    """The bytes of a tensor's or an array's elements (0 for anything else: None, a list)."""
    if isinstance(value, torch.Tensor):
        return value.element_size() * value.numel()
    return value.nbytes if isinstance(value, np.ndarray) else 0


def _names_a_device(args: Sequence[Any], kwargs: dict[str, Any]) -> bool:
    """Whether a ``Tensor.to`` call's arguments name a device other than ``"cpu"`` (a ``torch.device``, even the
    CPU's: the rank's device, as mpifl names it)."""
    named = [a for a in (*args, kwargs.get("device")) if isinstance(a, (torch.device, str))]
    return any(isinstance(a, torch.device) or not a.startswith("cpu") for a in named)


def _caller() -> str:
    """``file:line function`` of the innermost frame outside this module, torch and the standard library."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path != __file__ and "/torch/" not in path and "/contextlib.py" not in path and "/functools" not in path:
            return f"{'/'.join(path.split('/')[-2:])}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return "?"


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


def _crosses(source: object, target: object) -> bool:
    """Whether copying ``source`` to ``target`` (tensors) copies host memory to a device."""
    return (isinstance(source, torch.Tensor) and isinstance(target, torch.Tensor) and source.device.type == "cpu"
            and target.device.type != "cpu")


def _blocking_upload(source: object, target: object, waits: bool) -> bool:
    """Whether copying ``source`` to ``target`` (tensors) copies host memory to a device with a wait: from pageable
    memory, or from pinned memory without ``non_blocking``."""
    return _crosses(source, target) and (waits or not source.is_pinned())  # type: ignore[attr-defined]


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
