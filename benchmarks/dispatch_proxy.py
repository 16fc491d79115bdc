"""A GPU's costs counted on the CPU: per W2 training round, torch operations dispatched, host reads, bytes each way
between host and device, FLOPs and the host's own seconds, and from them a predicted GPU round time, for the
algorithms that train through the batched kernel, beside the bare batched floor, in one table.

On a GPU each dispatched operation is at least one kernel launch (host time whatever its size), each host read
waits for the device, and each copy crosses PCIe. All of it is counted here on any machine: every ATen operation
that reaches PyTorch's dispatcher (a ``TorchDispatchMode``, below autograd and ``vmap``: the operations a device
would run), those of them that would launch a kernel (not views, which only make new tensor metadata), the FLOPs of
its products and convolutions (:func:`flops`), every tensor read of :data:`mpifl.training.syncdebug.READS`, the bytes
that would cross (``syncdebug.host_traffic``: what a read copies to the host, what mpifl's upload doors and a
host-made tensor's move to the device copy up), and a training round's host CPU seconds outside the operations (the
median of rounds 2 and 3, user-mode: :func:`timed_rounds`, :func:`user_seconds`). A round's count is (a 3-round job
− a 1-round job) / 2 after a dropped 1-round job (one-time costs), so set-up and the final evaluation cancel; W2
with 100 clients (50 a round, 5 local steps each), 1 rank, in process, the kernel's calls as a GPU makes them
(``client.vectorize_chunk`` as ``auto`` sets it on a GPU: :func:`gpu_chunk`)::

    python benchmarks/dispatch_proxy.py                                  # the floor, then every algorithm below
    python benchmarks/dispatch_proxy.py --algorithm fedavg --algorithm scaffold --sites
    python benchmarks/dispatch_proxy.py --cpu-path                       # the CPU's own path, not the GPU's

The rows: the bare batched floor (``bare_w2.py --batched``: the round's clients' steps as one vmap each and the
mean of their deltas, nothing else), counted the same way; then FedAvg, FedProx, SCAFFOLD, FedALS, IFCA, FedBuff
and PeFLL on W2 with ``client.vectorize: true`` (each with its config section's defaults). An algorithm whose
clients do not train through the kernel (the results file's ``clients_trained_vectorized`` is 0) or that does not
run on W2 is reported as such, and the table goes on. Each row's bytes are also given in W2's models (6.5 MB, both
ways together) and its predicted GPU milliseconds by ``benchmarks/gpu_model.py``'s fitted model; issue 59's targets:
≤ 2 models a round for FedAvg, FedProx, SCAFFOLD, FedALS and IFCA (W2's exact sum comes down as one float64 copy:
one model's values, two models' bytes), ≤ 2 reads for FedBuff and PeFLL; the copies of half a model's bytes or more
are counted too, each way. ``--sites``
lists each row's largest copies by caller; ``--json FILE`` writes the rows' counts (``gpu_model.py --fit`` reads
985a042's).

The GPU's path, as far as the CPU can take it (the default; ``--cpu-path`` counts the CPU's own): on the CPU the
kernel computes each client's reported loss alone (the loop's bits; on a GPU it comes out of the vmapped call, no
operation more), so those operations are counted apart and left out of the GPU path's columns; FedAvg's and IFCA's
deltas are rows of the kernel's result as on a GPU (``ClientToolkit.sent_rows``'s GPU branch, before it
``FedAvgClient.local_end``'s: no host view of them, which on a GPU would be a copy), so the walker screens them with
one read and folds them with ``ExactSum.add_rows`` through the exact sum's torch backend in whole-row passes (as on
a GPU; on the CPU it would fold with numpy, which no dispatcher sees); client state that a GPU keeps on the device
within ``state_device_gb`` (SCAFFOLD's controls) stays there (on the CPU, where the host is the device, it would
come to the host: ``ClientState._device_budget``); and at 985a042 the loop's delta stays on the device
(``FedAvgClient.compute``'s GPU branch there). Each row's "÷ floor" is the GPU path's count over the floor's.
Further CPU-only operations stay in: the batch plans' ``randperm`` and ``cat`` are host-side draws on CPU tensors
(no GPU launches), so the GPU path's count is an upper bound. The emulation patches private names of mpifl
(:data:`KERNELS`, :data:`BACKEND_USERS`, the two branches above); the table's header names those it applied, and
where one is missing after a change the counts are the CPU's there.

An older checkout (985a042, 4e3d78e) is traced with this script copied into it and ``--counter`` naming this
checkout's ``mpifl/training/syncdebug.py``, whose byte counter that checkout's lacks (:func:`counter_module`).
"""


from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import itertools
import json
import resource
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

W2 = REPO / "configs" / "w2.yaml"
ALGORITHMS = ("fedavg", "fedprox", "scaffold", "fedals", "ifca", "fedbuff", "pefll")
KINDS = ("all", "launching", "cpu losses", "cpu losses launching")
TARGET_RATIO, TARGET_READS = 1.25, 2
TARGET_MODELS, BY_BYTES, BY_READS = 2, ("fedavg", "fedprox", "scaffold", "fedals", "ifca"), ("fedbuff", "pefll")
"""Issue 59's targets on W2: at most 2 models' bytes a round (both ways) for :data:`BY_BYTES`, 2 reads for
:data:`BY_READS`. (W2's exact sum comes down as one float64 copy: one model's values in two models' bytes, so a
round that moves its start up and its total down is 3 models' bytes.)"""
SETTINGS: dict[str, dict[str, Any]] = {
    "fedbuff": {"network": {"compute": "model"}, "fedbuff": {"buffer_size": 50}},
}
"""What an algorithm needs beyond W2's config: FedBuff's events come from the simulated clock (``network.compute:
model``), and with a buffer of the cohort's 50 (and as many training at once) a server step is W2's round."""
KERNELS = (("mpifl.training.vectorized", "VectorizedSGD"), ("mpifl.training.executor", "LocalSGD"))
"""Where the kernel's ``_losses`` (the CPU-only per-client losses) has lived: at a638abb, and after issue 48's
rewrite of the local step."""


@dataclass
class Counted:
    """One job's counts: ATen operations by kind (:data:`KINDS`) and by name, host reads, and the clients its
    ranks trained through the kernel (None where that is not known)."""

    ops: Counter[str]
    reads: float
    kernel_clients: int | None = None
    to_device: float = 0.0  # bytes host→device (syncdebug.host_traffic)
    to_host: float = 0.0  # bytes device→host
    flops: float = 0.0  # floating-point operations of the dispatched products and convolutions (:func:`flops`)
    sites: Counter | None = None  # (direction, caller) → bytes, with --sites
    host_s: float = 0.0  # seconds outside the dispatched operations (this machine's host work)
    round_host_s: float | None = None  # of which a training round's, its median over rounds 2.. (mpifl's jobs)
    grouped_flops: float = 0.0  # of :attr:`flops`, the grouped convolutions' (vmap's rows)
    copies: Counter | None = None  # (direction, bytes) → copies of that size (syncdebug.Traffic.copies)

    def model_copies(self) -> tuple[float, float]:
        """(host→device, device→host) copies of at least half a W2 model's bytes: how many large copies carry the
        bytes (one copy of a whole cohort's stacked starts counts once)."""
        from scaling_model import MODEL_BYTES

        big = Counter({d: n for (d, size), n in (self.copies or {}).items() if size >= MODEL_BYTES / 2})
        return big["to_device"], big["to_host"]

    def gpu_ops(self, gpu_path: bool = True) -> tuple[float, float]:
        """(operations, launching) on the GPU's path: without the CPU-only per-client losses (``gpu_path``)."""
        ops = self.ops
        if not gpu_path:
            return ops["all"], ops["launching"]
        return ops["all"] - ops["cpu losses"], ops["launching"] - ops["cpu losses launching"]

    def summary(self, gpu_path: bool = True) -> dict[str, float]:
        """The numbers the time model reads (benchmarks/gpu_model.py's ``Counts``), as JSON writes them."""
        ops, launching = self.gpu_ops(gpu_path)
        return {"operations": ops, "launching": launching, "reads": self.reads, "to_device": self.to_device,
                "to_host": self.to_host, "flops": self.flops, "grouped_flops": self.grouped_flops,
                "host_s": self.host_s}

    def per_round(self, one: Counted) -> Counted:
        """(this 3-round job − ``one``, its 1-round twin) / 2: one round's counts; its host seconds this job's median
        training round's, where its rounds were timed (:func:`timed_rounds`)."""
        ops = Counter(self.ops)
        ops.subtract(one.ops)
        sites, copies = _halved_difference(self.sites, one.sites), _halved_difference(self.copies, one.copies)
        return Counted(Counter({name: count / 2 for name, count in ops.items()}), (self.reads - one.reads) / 2,
                       self.kernel_clients, (self.to_device - one.to_device) / 2, (self.to_host - one.to_host) / 2,
                       (self.flops - one.flops) / 2, sites,
                       (self.host_s - one.host_s) / 2 if self.round_host_s is None else self.round_host_s,
                       grouped_flops=(self.grouped_flops - one.grouped_flops) / 2, copies=copies)


def _halved_difference(three: Counter | None, one: Counter | None) -> Counter | None:
    """(``three`` − ``one``) / 2 by key, without the keys that cancel (None if either is)."""
    if three is None or one is None:
        return None
    difference = Counter(three)
    difference.subtract(one)
    return Counter({k: v / 2 for k, v in difference.items() if v})


class Count:
    """ATen operations by kind and name while active (a ``TorchDispatchMode``, made on first use: torch is
    imported late so that ``--help`` is quick); ``in_losses`` marks the CPU-only per-client losses."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
                began = user_seconds()
                out = func(*args, **(kwargs or {}))
                counter.inside += user_seconds() - began
                counter.add(func, args, out)
                return out

        self.mode = Mode()
        self.ops: Counter[str] = Counter()
        self.in_losses = False
        self.flops = self.grouped_flops = 0.0
        self.inside = 0.0  # seconds inside the dispatched operations

    def add(self, func: Any, args: tuple = (), out: Any = None) -> None:  # noqa: ANN401 - an OpOverload, its output
        launching = not func.is_view
        self.ops["all"] += 1
        self.ops[str(func.overloadpacket)] += 1
        self.ops["launching"] += launching
        done, grouped = flops(str(func.overloadpacket), args, out)
        self.flops += done
        self.grouped_flops += done * grouped
        if self.in_losses:
            self.ops["cpu losses"] += 1
            self.ops["cpu losses launching"] += launching


def flops(name: str, args: tuple, out: Any) -> tuple[float, bool]:  # noqa: ANN401 - an operation's output
    """The floating-point operations of a product or a convolution (2 per multiply-add; 0 for any other operation),
    and whether it is a grouped convolution (vmap's batch of rows: ``groups`` > 1), counted per group, which
    ``torch.utils.flop_counter`` (torch 2.13) does not do for the backward pass (it counted 3× a 5-row step of W2's
    model)."""
    import math

    if name in ("aten.mm", "aten.bmm", "aten.addmm", "aten.baddbmm"):
        a, b = args[-2:] if name in ("aten.addmm", "aten.baddbmm") else args[:2]
        return 2.0 * math.prod(a.shape) * b.shape[-1], False
    if name == "aten.convolution":  # (input, weight, ..., groups); out [N, C_out, *spatial]; weight [C_out, C_in/g, *k]
        return 2.0 * out.numel() * math.prod(args[1].shape[1:]), args[8] > 1
    if name == "aten.convolution_backward":  # (grad_output, input, weight, ..., groups, output_mask)
        return 2.0 * args[0].numel() * math.prod(args[2].shape[1:]) * sum(args[10][:2]), args[9] > 1
    return 0.0, False


@contextlib.contextmanager
def patched(owner: object, name: str, make: Callable[[Any], Any], applied: list[str]) -> Iterator[None]:
    """``owner.name`` replaced by ``make(original)`` inside the block, if it exists (noted in ``applied``)."""
    original = None if owner is None else vars(owner).get(name) if isinstance(owner, type) else getattr(owner, name,
                                                                                                          None)
    if original is None:
        yield
        return
    setattr(owner, name, make(original))
    applied.append(f"{getattr(owner, '__name__', owner)}.{name}")
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def counting(counter: Count, gpu_path: bool, applied: list[str]) -> Iterator[None]:
    """The CPU-only losses marked in ``counter``; with ``gpu_path`` the GPU's path emulated (see the module's
    docstring): FedAvg's and IFCA's deltas left as rows of the kernel's tensor (and, at 985a042, the loop's delta on
    the device), folded by the exact sum's torch backend in whole-row passes, and client state kept on the device."""
    import importlib
    import math

    from mpifl.algorithms.fedavg import FedAvgClient

    def marking(losses: Callable) -> Callable:
        def counted_losses(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
            counter.in_losses = True
            try:
                return losses(*args, **kwargs)
            finally:
                counter.in_losses = False

        return counted_losses

    def device_rows(local_end: Callable) -> Callable:
        def kept_on_device(client: Any, step: Any, clients: list[int], trained: Any) -> None:  # noqa: ANN401
            client.deltas.update((c, trained.params[k]) for k, c in enumerate(clients))  # the GPU's branch

        return kept_on_device

    with contextlib.ExitStack() as stack:
        for module, name in KERNELS:
            with contextlib.suppress(ImportError):
                stack.enter_context(patched(getattr(importlib.import_module(module), name, None), "_losses", marking,
                                            applied))
        if gpu_path:
            rows_sent = len(applied)
            with contextlib.suppress(ImportError):
                from mpifl.algorithms.toolkit import ClientToolkit

                stack.enter_context(patched(ClientToolkit, "sent_rows", lambda _: lambda _client, trained:
                                            trained.params, applied))
            if len(applied) == rows_sent:  # before the toolkit's sent_rows: FedAvg's own branch
                stack.enter_context(patched(FedAvgClient, "local_end", device_rows, applied))
            stack.enter_context(patched(FedAvgClient, "compute", loop_delta_on_device, applied))
            for module, name in BACKEND_USERS:
                with contextlib.suppress(ImportError):
                    stack.enter_context(patched(importlib.import_module(module), name, whole_rows, applied))
            with contextlib.suppress(ImportError):
                from mpifl.algorithms.state import ClientState

                stack.enter_context(patched(ClientState, "_device_budget", lambda _: lambda *_: math.inf, applied))
        yield


BACKEND_USERS = (("mpifl.comm.exactsum._accumulator", "ops_for"), ("mpifl.comm.exactsum._wire", "ops_for"),
                 ("mpifl.comm.exactsum", "_ops_for"))
"""The exact sum's modules that pick a backend for a row (a total's fold, ``round_sum``): after issue 58's split
into a package, and at 985a042."""


def whole_rows(ops_for: Callable) -> Callable:
    """``ops_for`` that gives a tensor row (a device row, on a GPU) the torch backend, in whole-row passes as on a
    GPU (on the CPU its chunks and spans keep the cache)."""
    import importlib

    import torch

    torch_ops = None
    for module, name in (("mpifl.comm.exactsum._backends", "TorchOps"), ("mpifl.comm.exactsum", "_TorchOps")):
        with contextlib.suppress(ImportError):
            torch_ops = torch_ops or getattr(importlib.import_module(module), name, None)
    if torch_ops is None:
        return ops_for

    class DeviceOps(torch_ops):  # type: ignore[misc, valid-type]
        def span(self, size: int) -> int:
            return max(size, 1)

        def round_span(self, size: int) -> int:
            return max(size, 1)

    def device_ops(device: Any, row: object) -> Any:  # noqa: ANN401
        if device is None and isinstance(row, torch.Tensor):
            return DeviceOps(row.device)
        return ops_for(device, row)

    return device_ops


def loop_delta_on_device(compute: Callable) -> Callable:
    """985a042's ``FedAvgClient.compute`` (the loop) with its GPU branch: the delta kept on the device. Later
    checkouts train the loop through ``local_step`` (``compute`` is the toolkit's): left as it is."""
    if "origin" not in compute.__code__.co_varnames:
        return compute

    def on_device(client: Any, step: Any, c: int) -> None:  # noqa: ANN401
        start = client.start.pop(c)
        client.workspace.load(start)
        origin = client.workspace.params.clone()
        client.train_workspace(step, c, client.grad_hook(c, start))
        client.deltas[c] = client.workspace.params - origin
        client.after_training(c)

    return on_device


COUNTER: Path | None = None
"""``--counter``: a syncdebug.py to count host↔device traffic with, for a checkout whose own has no
``host_traffic`` (:func:`host_traffic`)."""


def host_traffic() -> Any:  # noqa: ANN401 - a context manager yielding syncdebug.Traffic
    """``mpifl.training.syncdebug.host_traffic(sites=SITES)``: this checkout's, or (``--counter``) that of
    :data:`COUNTER` (:func:`counter_module`)."""
    from mpifl.training import syncdebug

    return (syncdebug if COUNTER is None else counter_module(COUNTER)).host_traffic(sites=SITES)


@functools.cache
def counter_module(path: Path) -> Any:  # noqa: ANN401 - a module
    """The syncdebug.py at ``path``, loaded on its own beside this checkout's mpifl: its counter needs only torch,
    and while it loads, a name it imports from :data:`STAND_INS` that this checkout lacks (an older one has no
    ``ClientStart``, or no ``mpifl.training.executor`` at all) is None (the rest of that module is not used here)."""
    import importlib.util
    import types

    saved = {}
    for name in STAND_INS:
        real = importlib.import_module(name) if importlib.util.find_spec(name) is not None else None
        stand_in = types.ModuleType(name)
        stand_in.__getattr__ = lambda attr, real=real: getattr(real, attr, None)  # type: ignore[attr-defined, method-assign, misc]
        saved[name], sys.modules[name] = real, stand_in
    spec = importlib.util.spec_from_file_location("counter_syncdebug", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # type: ignore[arg-type, union-attr]
    try:
        spec.loader.exec_module(module)  # type: ignore[union-attr]
    finally:
        for name, real in saved.items():
            if real is None:
                del sys.modules[name]
            else:
                sys.modules[name] = real
    return module


STAND_INS = ("mpifl.training.executor", "mpifl.training.localstep", "mpifl.training.vectorizing")
"""The modules whose names syncdebug.py imports for its checks, not for its counter (an older checkout lacks some)."""


SITES = False
"""``--sites``: keep the bytes by caller, and print the largest."""


@contextlib.contextmanager
def traced(counter: Count) -> Iterator[Callable[[int | None], Counted]]:
    """``counter``'s mode and the host traffic while active; yields what makes the block's :class:`Counted` (given
    the kernel's clients) once it is over, with its host seconds outside the dispatched operations
    (:func:`mode_cost` taken off for each), in :func:`user_seconds`."""
    with host_traffic() as traffic:
        began = user_seconds()
        with counter.mode:
            yield lambda kernel: Counted(counter.ops, sum(traffic.reads.values()), kernel, traffic.to_device,
                                         traffic.to_host, counter.flops, traffic.sites, host_s,
                                         grouped_flops=counter.grouped_flops,
                                         copies=Counter(getattr(traffic, "copies", {})))
        host_s = user_seconds() - began - counter.inside - counter.ops["all"] * mode_cost()


def user_seconds() -> float:
    """This thread's CPU seconds in user mode: another job's load on the machine adds little, mpifl's results writer
    (a thread of its own) nothing, and neither do the kernel's page faults and unmappings of large tensors, which
    varied 3-fold from run to run here (W2's FedAvg round: 1.5 to 4.0 s of system time, 0.8 to 2.3 million minor
    faults, its user seconds within 1%) and which a GPU's caching allocator does not have."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_utime


@functools.cache
def mode_cost(n: int = 20000) -> float:
    """The user seconds :class:`Count`'s mode adds to one dispatched operation (the best of 5 passes of ``n`` small
    additions with and without it), which :func:`traced` takes off the host's seconds."""
    import torch

    a, b = torch.ones(4), torch.ones(4)

    def best(mode: Any) -> float:  # noqa: ANN401 - a mode or a null context
        times = []
        for _ in range(5):
            began = user_seconds()
            with mode:
                for _ in range(n):
                    torch.add(a, b)
            times.append(user_seconds() - began)
        return min(times)

    return max(best(Count().mode) - best(contextlib.nullcontext()), 0.0) / n


def mpifl_job(raw: dict, out: Path, gpu_path: bool, applied: list[str]) -> Counted:
    """The counts of one in-process run of ``raw``."""
    import h5py
    import numpy as np
    import torch
    from mpi4py import MPI

    from mpifl.registry import parse_config
    from mpifl.runtime.engine import Engine

    torch.set_num_threads(1)
    engine = Engine(parse_config(raw), MPI.COMM_SELF, out)
    engine.prepare()
    counter = Count()
    rounds = timed_rounds(engine.rounds, counter)
    with counting(counter, gpu_path, applied), traced(counter) as made:
        engine.run(progress=False)
    with h5py.File(out) as f:
        ranks = f["ranks"]
        kernel = (int(np.sum(ranks["clients_trained_vectorized"][()])) if "clients_trained_vectorized" in ranks
                  else None)
    del engine
    gc.collect()  # the engine's reference cycles hold its data and models: 25 jobs grew past 13 GB, out of memory
    return dataclasses.replace(made(kernel), round_host_s=float(np.median(rounds[1:])) if len(rounds) > 1 else None)


def timed_rounds(rounds: Any, counter: Count) -> list[float]:  # noqa: ANN401 - the engine's round driver
    """Each training round's host seconds, as :func:`traced` takes them (filled in as the rounds run): the rounds'
    ``train_round`` timed alone, without the set-up, the evaluation or the results writes around them, which would
    vary from job to job by more than a round's host seconds (W2's final evaluation of its 1,000 clients)."""
    seconds: list[float] = []
    train_round = rounds.train_round

    def timed(round_: int) -> None:
        began, inside, ops = user_seconds(), counter.inside, counter.ops["all"]
        train_round(round_)
        ran = user_seconds() - began - (counter.inside - inside)
        seconds.append(ran - (counter.ops["all"] - ops) * mode_cost())

    rounds.train_round = timed
    return seconds


def floor_job(raw: dict) -> Counted:
    """The counts of the bare batched floor (``bare_w2.batched_rounds``) on ``raw``'s rounds and clients."""
    import torch
    from bare_w2 import CONFIG, batched_rounds

    from mpifl.registry import load_config

    cfg = load_config(CONFIG, [f"rounds={raw['rounds']}", f"data.num_clients={raw['data']['num_clients']}",
                               f"clients_per_round={raw['clients_per_round']}"])
    counter = Count()
    with traced(counter) as made:
        batched_rounds(cfg, torch.device("cpu"))
    return made(None)


def gpu_chunk(cohort: int) -> int:
    """``client.vectorize_chunk: auto`` on a GPU for ``cohort`` clients a round: ``executor.auto_chunk``'s answer
    (from the config alone, after issue 48's rewrite), else 64 (auto's on a GPU at a638abb)."""
    import torch

    try:
        from mpifl.training.vectorizing import auto_chunk  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return 64
    return int(auto_chunk(cohort, torch.device("cuda")))  # only the device's type is read: no GPU needed


def w2(algorithm: str, clients: int, chunk: int, vectorize: bool) -> dict:
    """W2's config for ``algorithm`` through the kernel (or not), without evaluation before the end."""
    base = yaml.safe_load(W2.read_text())
    base.update(algorithm=algorithm, eval_every=1000, data={**base["data"], "num_clients": clients},
                client={**base["client"], "vectorize": vectorize, "vectorize_chunk": chunk})
    return {**base, **SETTINGS.get(algorithm, {})}


def per_round(job: Callable[[dict], Counted], raw: dict) -> Counted:
    """One round's counts of ``job``: its 3-round run less its 1-round run, halved, after a 1-round run that pays
    what a process does once (imports on first use) and is dropped."""
    job({**raw, "rounds": 1})
    return job({**raw, "rounds": 3}).per_round(job({**raw, "rounds": 1}))


def row(name: str, counted: Counted, floor: Counted | None, gpu_path: bool) -> str:
    """A table row: the counts as made, the GPU path's (without the CPU-only losses), the reads, the bytes each way
    and in models, the FLOPs, the host seconds here, the predicted GPU milliseconds, the ratios and the targets."""
    from gpu_model import FITTED, Counts
    from scaling_model import MODEL_BYTES

    ops = counted.ops
    mine = counted.gpu_ops(gpu_path)
    ratios, met = "", ""
    if floor is not None:
        ratio = (mine[0] / floor.ops["all"], mine[1] / floor.ops["launching"])
        ratios = f"{ratio[0]:.2f}× / {ratio[1]:.2f}×"
        met = "yes" if max(ratio) <= TARGET_RATIO and counted.reads <= TARGET_READS else "no"
    models = (counted.to_device + counted.to_host) / MODEL_BYTES
    up, down = counted.model_copies()
    algorithm = name.split()[0]
    target = ""
    if algorithm in BY_BYTES:
        target = f"≤ {TARGET_MODELS} models: {'yes' if models <= TARGET_MODELS else 'no'}"
    elif algorithm in BY_READS:
        target = f"≤ {TARGET_READS} reads: {'yes' if counted.reads <= TARGET_READS else 'no'}"
    predicted = FITTED.seconds(Counts.of(counted.summary(gpu_path))) * 1e3
    names = Counter({k: v for k, v in ops.items() if k not in KINDS})
    top = ", ".join(f"{k} {v:.0f}" for k, v in names.most_common(3))
    line = (f"| {name} | {ops['all']:,.0f} / {ops['launching']:,.0f} | {ops['cpu losses']:,.0f} | "
            f"{mine[0]:,.0f} / {mine[1]:,.0f} | {counted.reads:.0f} | {counted.to_device / 1e6:,.1f} / "
            f"{counted.to_host / 1e6:,.1f} | {models:.1f} | {up:.0f} / {down:.0f} | {counted.flops / 1e9:,.0f} "
            f"({counted.grouped_flops / 1e9:,.0f}) | {counted.host_s:.3f} | "
            f"{predicted:,.0f} | {ratios} | {met} | {target} | {top} |")
    if counted.sites:
        line += "".join(f"\n    {direction} {size / 1e6:,.2f} MB {where}"
                        for (direction, where), size in counted.sites.most_common(8))
    return line


HEADER = ("| setting | ATen operations / launching, as counted | of which the CPU-only per-client losses | "
          "{path}: operations / launching | host reads | MB host→device / device→host | ÷ the model's bytes | "
          "copies of ≥ ½ model, up / down | GFLOP (grouped) | "
          "host CPU s here | predicted GPU ms (gpu_model.py) | ÷ floor (operations / launching) | "
          f"≤ {TARGET_RATIO}× and ≤ {TARGET_READS} reads | issue 59's target | most frequent |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", action="append", choices=ALGORITHMS,
                        help="an algorithm to count (repeatable; default all of them)")
    parser.add_argument("--clients", type=int, default=100, help="data.num_clients (default 100; 50 a round)")
    parser.add_argument("--chunk", type=int,
                        help="client.vectorize_chunk (default: what auto gives on a GPU, see gpu_chunk)")
    parser.add_argument("--loop", action="store_true", help="also FedAvg through the loop (client.vectorize false)")
    parser.add_argument("--cpu-path", action="store_true",
                        help="count the CPU's own path (losses per client, deltas folded by numpy)")
    parser.add_argument("--counter", type=Path,
                        help="a syncdebug.py with host_traffic, for a checkout whose own has none (an old one)")
    parser.add_argument("--sites", action="store_true", help="also the largest copies by caller")
    parser.add_argument("--json", type=Path, help="also write each row's counts to this file (gpu_model.py --fit)")
    args = parser.parse_args()
    global COUNTER, SITES
    COUNTER, SITES = args.counter, args.sites
    args.chunk = args.chunk or gpu_chunk(yaml.safe_load(W2.read_text())["clients_per_round"])
    gpu_path = not args.cpu_path
    applied: list[str] = []
    serial = itertools.count()
    summaries: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        fedavg = w2("fedavg", args.clients, args.chunk, True)
        try:
            floor: Counted | None = per_round(floor_job, fedavg)
            rows = [row("bare batched floor (`bare_w2.py --batched`)", floor, None, gpu_path)]
            summaries["bare batched floor"] = floor.summary(False)
        except ImportError:  # an old checkout: bare_w2.py without the batched floor
            floor, rows = None, ["| bare batched floor: not in this checkout's bare_w2.py |" + " |" * 13]
        settings = [(a, True) for a in args.algorithm or ALGORITHMS] + ([("fedavg", False)] if args.loop else [])
        for algorithm, vectorize in settings:
            name = f"{algorithm}" + ("" if vectorize else " (the loop)")
            raw = w2(algorithm, args.clients, args.chunk, vectorize)

            def job(config: dict, name: str = name) -> Counted:
                return mpifl_job(config, folder / f"{name}_{config['rounds']}_{next(serial)}.h5", gpu_path, applied)

            try:
                counted = per_round(job, raw)
            except Exception as exc:  # noqa: BLE001 - an algorithm that does not run on W2 is a row, not the end
                rows.append(f"| {name} | does not run on W2: {type(exc).__name__}: {str(exc)[:100]} |" + " |" * 12)
                continue
            if vectorize and counted.kernel_clients == 0:
                name += " — does not take the kernel (clients_trained_vectorized 0): the loop's counts"
            rows.append(row(name, counted, floor, gpu_path))
            summaries[name] = counted.summary(gpu_path)
    emulated = sorted({"the kernel's _losses" if name.endswith("._losses") else name for name in applied})
    print(f"W2 round, 1 rank, {args.clients} clients, client.vectorize_chunk {args.chunk}; "
          + (f"the GPU's path as far as the CPU can take it (emulated: {', '.join(emulated) or 'nothing'})"
             if gpu_path else "the CPU's own path") + "\n")
    print(HEADER.format(path="GPU path" if gpu_path else "counted"))
    for line in rows:
        print(line, flush=True)
    if args.json:
        args.json.write_text(json.dumps(summaries, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
