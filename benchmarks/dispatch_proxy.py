"""A GPU's costs counted on the CPU: torch operations dispatched and host reads per W2 training round, for the
algorithms that train through the batched kernel, beside the bare batched floor, in one table.

On a GPU each dispatched operation is at least one kernel launch (a few microseconds of host time whatever its
size) and each host read waits for the device, so for a launch-bound round these two counts are what its time
follows. Both are counted here on any machine: every ATen operation that reaches PyTorch's dispatcher (a
``TorchDispatchMode``, below autograd and ``vmap``: the operations a device would run), those of them that
would launch a kernel (not views, which only make new tensor metadata), and every tensor read of
:data:`mpifl.training.syncdebug.READS`. A round's count is (a 3-round job − a 1-round job) / 2, so set-up and
the final evaluation cancel; W2 with 100 clients (50 a round, 5 local steps each), 1 rank, in process, the
kernel's calls as a GPU makes them (``client.vectorize_chunk`` as ``auto`` sets it on a GPU: :func:`gpu_chunk`)::

    python benchmarks/dispatch_proxy.py                                  # the floor, then every algorithm below
    python benchmarks/dispatch_proxy.py --algorithm fedavg --algorithm scaffold
    python benchmarks/dispatch_proxy.py --cpu-path                       # the CPU's own path, not the GPU's

The rows: the bare batched floor (``bare_w2.py --batched``: the round's clients' steps as one vmap each and the
mean of their deltas, nothing else), counted the same way; then FedAvg, FedProx, SCAFFOLD, FedALS, IFCA, FedBuff
and PeFLL on W2 with ``client.vectorize: true`` (each with its config section's defaults). An algorithm whose
clients do not train through the kernel (the results file's ``clients_trained_vectorized`` is 0) or that does not
run on W2 is reported as such, and the table goes on.

The GPU's path, as far as the CPU can take it (the default; ``--cpu-path`` counts the CPU's own): on the CPU the
kernel computes each client's reported loss alone (the loop's bits; on a GPU it comes out of the vmapped call, no
operation more), so those operations are counted apart and left out of the GPU path's columns; and an upload that
is a row of the kernel's result (a host view of it on the CPU: FedAvg's deltas; not a row computed on the host, as
IFCA's and PeFLL's deltas, which a GPU copies out too) leaves the client as a tensor, as it would on a GPU, so the
walker screens those rows with one read and folds them with ``ExactSum.add_rows`` through the exact sum's torch
backend in whole-row passes (as on a GPU; on the CPU it would fold with numpy, which no dispatcher sees). Each
row's "÷ floor" is the GPU path's count over the floor's; the issue's target is ≤ 1.25× and ≤ 2 host reads a
round. Further CPU-only operations stay in: the batch plans' ``randperm`` and ``cat`` are host-side draws on CPU
tensors (no GPU launches), so the GPU path's count is an upper bound. The emulation patches private names of
mpifl (``PlanWalker._leaving``, the exact sum's ``ops_for`` and ``TorchOps``, the kernel's ``_losses``:
:data:`KERNELS`); where one is missing after a change the table's header says which part of the GPU's path was not
emulated, and the counts are the CPU's there.
"""

from __future__ import annotations

import argparse
import contextlib
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

    def per_round(self, one: Counted) -> Counted:
        """(this 3-round job − ``one``, its 1-round twin) / 2: one round's counts."""
        ops = Counter(self.ops)
        ops.subtract(one.ops)
        return Counted(Counter({name: count / 2 for name, count in ops.items()}), (self.reads - one.reads) / 2,
                       self.kernel_clients)


class Count:
    """ATen operations by kind and name while active (a ``TorchDispatchMode``, made on first use: torch is
    imported late so that ``--help`` is quick); ``in_losses`` marks the CPU-only per-client losses."""

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
                counter.add(func)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.ops: Counter[str] = Counter()
        self.in_losses = False

    def add(self, func: Any) -> None:  # noqa: ANN401 - an OpOverload
        launching = not func.is_view
        self.ops["all"] += 1
        self.ops[str(func.overloadpacket)] += 1
        self.ops["launching"] += launching
        if self.in_losses:
            self.ops["cpu losses"] += 1
            self.ops["cpu losses launching"] += launching


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
    """The CPU-only losses marked in ``counter``; with ``gpu_path`` the deltas kept as tensors and folded by the
    exact sum's torch backend in whole-row passes, as on a GPU (see the module's docstring)."""
    import importlib

    import numpy as np
    import torch

    from mpifl.comm.exactsum import _accumulator, _backends, _wire
    from mpifl.runtime.walker import PlanWalker

    def marking(losses: Callable) -> Callable:
        def counted_losses(*args: Any, **kwargs: Any) -> Any:  # noqa: ANN401
            counter.in_losses = True
            try:
                return losses(*args, **kwargs)
            finally:
                counter.in_losses = False

        return counted_losses

    def as_tensors(leaving: Callable) -> Callable:
        def kept_on_device(walker: Any, msg: Any, round_: int, client: int, sent: Any) -> Any:  # noqa: ANN401
            if isinstance(sent, np.ndarray) and sent.ndim == 1 and getattr(sent.base, "ndim", 0) == 2:
                sent = torch.from_numpy(sent)  # a row of the kernel's result: on a GPU, a row of a device tensor
            return leaving(walker, msg, round_, client, sent)

        return kept_on_device

    def whole_rows(ops_for: Callable) -> Callable:
        torch_ops = getattr(_backends, "TorchOps", None)
        if torch_ops is None:
            return ops_for

        class DeviceOps(torch_ops):  # type: ignore[misc, valid-type]
            def span(self, size: int) -> int:
                return max(size, 1)  # one pass over a whole row, as on a GPU (the CPU's chunks keep its cache)

            def round_span(self, size: int) -> int:
                return max(size, 1)  # the total rounded in one pass, as on a GPU (the CPU's spans keep its cache)

        def device_ops(device: Any, row: object) -> Any:  # noqa: ANN401
            if device is None and isinstance(row, torch.Tensor):
                return DeviceOps(row.device)
            return ops_for(device, row)

        return device_ops

    with contextlib.ExitStack() as stack:
        for module, name in KERNELS:
            with contextlib.suppress(ImportError):
                stack.enter_context(patched(getattr(importlib.import_module(module), name, None), "_losses", marking,
                                            applied))
        if gpu_path:
            stack.enter_context(patched(PlanWalker, "_leaving", as_tensors, applied))
            for user in (_accumulator, _wire):  # the modules that pick a backend: a total's fold, round_sum
                stack.enter_context(patched(user, "ops_for", whole_rows, applied))
        with counter.mode:
            yield


def mpifl_job(raw: dict, out: Path, gpu_path: bool, applied: list[str]) -> Counted:
    """The counts of one in-process run of ``raw``."""
    import h5py
    import numpy as np
    import torch
    from mpi4py import MPI

    from mpifl.registry import parse_config
    from mpifl.runtime.engine import Engine
    from mpifl.training.syncdebug import host_reads

    torch.set_num_threads(1)
    engine = Engine(parse_config(raw), MPI.COMM_SELF, out)
    engine.prepare()
    counter = Count()
    with counting(counter, gpu_path, applied), host_reads() as reads:
        engine.run(progress=False)
    with h5py.File(out) as f:
        ranks = f["ranks"]
        kernel = (int(np.sum(ranks["clients_trained_vectorized"][()])) if "clients_trained_vectorized" in ranks
                  else None)
    return Counted(counter.ops, sum(reads.values()), kernel)


def floor_job(raw: dict) -> Counted:
    """The counts of the bare batched floor (``bare_w2.batched_rounds``) on ``raw``'s rounds and clients."""
    import torch
    from bare_w2 import CONFIG, batched_rounds

    from mpifl.registry import load_config
    from mpifl.training.syncdebug import host_reads

    cfg = load_config(CONFIG, [f"rounds={raw['rounds']}", f"data.num_clients={raw['data']['num_clients']}",
                               f"clients_per_round={raw['clients_per_round']}"])
    counter = Count()
    with counter.mode, host_reads() as reads:
        batched_rounds(cfg, torch.device("cpu"))
    return Counted(counter.ops, sum(reads.values()))


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
    """One round's counts of ``job``: its 3-round run less its 1-round run, halved."""
    return job({**raw, "rounds": 3}).per_round(job({**raw, "rounds": 1}))


def row(name: str, counted: Counted, floor: Counted | None, gpu_path: bool) -> str:
    """A table row: the counts as made, the GPU path's (without the CPU-only losses), the reads, the ratios."""
    ops = counted.ops
    mine = (ops["all"] - ops["cpu losses"], ops["launching"] - ops["cpu losses launching"]) if gpu_path else (
        ops["all"], ops["launching"])
    ratios, met = "", ""
    if floor is not None:
        ratio = (mine[0] / floor.ops["all"], mine[1] / floor.ops["launching"])
        ratios = f"{ratio[0]:.2f}× / {ratio[1]:.2f}×"
        met = "yes" if max(ratio) <= TARGET_RATIO and counted.reads <= TARGET_READS else "no"
    names = Counter({k: v for k, v in ops.items() if k not in KINDS})
    top = ", ".join(f"{k} {v:.0f}" for k, v in names.most_common(3))
    return (f"| {name} | {ops['all']:,.0f} / {ops['launching']:,.0f} | {ops['cpu losses']:,.0f} | "
            f"{mine[0]:,.0f} / {mine[1]:,.0f} | {counted.reads:.0f} | {ratios} | {met} | {top} |")


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
    args = parser.parse_args()
    args.chunk = args.chunk or gpu_chunk(yaml.safe_load(W2.read_text())["clients_per_round"])
    gpu_path = not args.cpu_path
    applied: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        fedavg = w2("fedavg", args.clients, args.chunk, True)
        floor = per_round(floor_job, fedavg)
        rows = [row("bare batched floor (`bare_w2.py --batched`)", floor, None, gpu_path)]
        settings = [(a, True) for a in args.algorithm or ALGORITHMS] + ([("fedavg", False)] if args.loop else [])
        for algorithm, vectorize in settings:
            name = f"{algorithm}" + ("" if vectorize else " (the loop)")
            raw = w2(algorithm, args.clients, args.chunk, vectorize)

            def job(config: dict, name: str = name) -> Counted:
                return mpifl_job(config, folder / f"{name}_{config['rounds']}.h5", gpu_path, applied)

            try:
                counted = per_round(job, raw)
            except Exception as exc:  # noqa: BLE001 - an algorithm that does not run on W2 is a row, not the end
                rows.append(f"| {name} | does not run on W2: {type(exc).__name__}: {str(exc)[:100]} | | | | | | |")
                continue
            if vectorize and counted.kernel_clients == 0:
                name += " — does not take the kernel (clients_trained_vectorized 0): the loop's counts"
            rows.append(row(name, counted, floor, gpu_path))
    backends = ["mpifl.comm.exactsum._accumulator.ops_for", "mpifl.comm.exactsum._wire.ops_for"]
    wanted = ["the kernel's _losses"] + (["PlanWalker._leaving", *backends] if gpu_path else [])
    found = ["the kernel's _losses" if name.endswith("._losses") else name for name in applied]
    missing = [w for w in wanted if w not in found]
    print(f"W2 round, 1 rank, {args.clients} clients, client.vectorize_chunk {args.chunk}; "
          + ("the GPU's path as far as the CPU can take it" if gpu_path else "the CPU's own path")
          + (f" (not emulated, missing after a change: {', '.join(missing)})" if missing else "") + "\n")
    print("| setting | ATen operations / launching, as counted | of which the CPU-only per-client losses | "
          f"{'GPU path' if gpu_path else 'counted'}: operations / launching | host reads | ÷ floor (operations / "
          f"launching) | ≤ {TARGET_RATIO}× and ≤ {TARGET_READS} reads | most frequent |")
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for line in rows:
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
