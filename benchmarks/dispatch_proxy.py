"""A GPU's costs counted on the CPU: torch operations dispatched and host reads per W2 training round.

On a GPU each dispatched operation is at least one kernel launch (a few microseconds of host time whatever its
size) and each host read waits for the device, so for a launch-bound round these two counts are what its time
follows. Both are counted here on any machine: every ATen operation that reaches PyTorch's dispatcher (a
``TorchDispatchMode``, below autograd and ``vmap``: the operations a device would run), those of them that
would launch a kernel (not views, which only make new tensor metadata), and every tensor read of
:data:`mpifl.training.syncdebug.READS`. A round's count is (a 3-round job − a 1-round job) / 2, so set-up and
the final evaluation cancel; W2 with 100 clients (50 a round, 5 local steps each), 1 rank, in process, the
kernel's calls as a GPU makes them (``client.vectorize_chunk`` 64, ``auto``'s on a GPU)::

    python benchmarks/dispatch_proxy.py                      # loop and kernel (client.vectorize false, true)
    python benchmarks/dispatch_proxy.py --vectorize true     # one setting

On the CPU the kernel computes each client's reported loss alone (the loop's bits; on a GPU one vmapped call a
step) and keeps deltas on the host (numpy's fold; on a GPU they stay on the device and fold there in one
batch), so the kernel's CPU count is an upper bound of its GPU count: the losses are counted apart.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

W2 = Path(__file__).resolve().parents[1] / "configs" / "w2.yaml"


def counted_run(raw: dict, out: Path) -> tuple[Counter[str], int]:
    """(ATen operations by kind and name, host reads) of one in-process run of ``raw``: kinds ``all``,
    ``launching`` (not a view) and ``cpu losses`` (in the kernel's per-client losses on the CPU)."""
    import torch
    from mpi4py import MPI
    from torch.utils._python_dispatch import TorchDispatchMode

    from mpifl.registry import parse_config
    from mpifl.runtime.engine import Engine
    from mpifl.training.syncdebug import host_reads
    from mpifl.training.vectorized import VectorizedSGD

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: Counter[str] = Counter()
            self.in_losses = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            self.ops["all"] += 1
            self.ops[str(func.overloadpacket)] += 1
            if not func.is_view:
                self.ops["launching"] += 1
            if self.in_losses:
                self.ops["cpu losses"] += 1
            return func(*args, **(kwargs or {}))

    counter = Count()
    losses = getattr(VectorizedSGD, "_losses", None)  # absent before 2026-11-28: run on an older commit too

    def counted_losses(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - instrumentation of one method
        counter.in_losses = True
        try:
            return losses(*args, **kwargs)
        finally:
            counter.in_losses = False

    torch.set_num_threads(1)
    engine = Engine(parse_config(raw), MPI.COMM_SELF, out)
    engine.prepare()
    if losses is not None:
        VectorizedSGD._losses = counted_losses  # type: ignore[method-assign]
    try:
        with counter, host_reads() as reads:
            engine.run(progress=False)
    finally:
        if losses is not None:
            VectorizedSGD._losses = losses  # type: ignore[method-assign]
    return counter.ops, sum(reads.values())


def per_round(vectorize: bool, chunk: int, folder: Path) -> tuple[Counter[str], float]:
    """Operations (by kind and name) and host reads of one W2 round."""
    base = yaml.safe_load(W2.read_text())
    base.update(eval_every=1000, data={**base["data"], "num_clients": 100},
                client={**base["client"], "vectorize": vectorize, "vectorize_chunk": chunk})
    one, one_reads = counted_run({**base, "rounds": 1}, folder / f"{vectorize}_1.h5")
    three, three_reads = counted_run({**base, "rounds": 3}, folder / f"{vectorize}_3.h5")
    three.subtract(one)
    return Counter({name: count / 2 for name, count in three.items()}), (three_reads - one_reads) / 2


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vectorize", choices=["false", "true"], action="append")
    parser.add_argument("--chunk", type=int, default=64, help="client.vectorize_chunk (default 64, a GPU's)")
    args = parser.parse_args()
    kinds = ("all", "launching", "cpu losses")
    with tempfile.TemporaryDirectory() as tmp:
        print("| client.vectorize | ATen operations per round | launching | of which the CPU's per-client losses "
              "| host reads per round | most frequent |")
        print("|---|---:|---:|---:|---:|---|")
        for setting in args.vectorize or ["false", "true"]:
            ops, reads = per_round(setting == "true", args.chunk, Path(tmp))
            names = Counter({name: count for name, count in ops.items() if name not in kinds})
            top = ", ".join(f"{name} {count:.0f}" for name, count in names.most_common(4))
            print(f"| {setting} | {ops['all']:.0f} | {ops['launching']:.0f} | {ops['cpu losses']:.0f} | {reads:.0f} "
                  f"| {top} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
