"""A W2 round's seconds on a GPU, predicted from what ``benchmarks/dispatch_proxy.py`` counts on the CPU, by a small
model calibrated on the one GPU lease there has been (shared/gpu/lease-2026-11-28: an NVIDIA H200, 16 CPUs).

A W2 round on a GPU is bound by its host (issue 43: the device waits for launches and reads), so the model adds up
the host's work, each part from a count of the proxy's:

    t = s·H + a·L + b·R + (U + D)/β + F/Φ

* H: the round's host CPU seconds outside torch's operations on *this* machine (the proxy's ``host_s``: Python,
  numpy, the exact sum's host folds; its thread's user-mode seconds, less the operations' own and the counting
  mode's: ``dispatch_proxy.user_seconds``), and s the lease host's seconds for one of them (fitted);
* L: the operations that launch a kernel (dispatched, not views), and a the seconds each costs a GPU round beyond
  that (the dispatcher, the caching allocator, the launch, and what of the device's time it does not hide: fitted);
* R: host reads, b = 20 µs each (a synchronization with a nearly idle device and a small copy: fixed);
* U, D: bytes host→device and device→host (``syncdebug.host_traffic``), β = 25 GB/s (PCIe 5.0 ×16 at about half
  its rate: mpifl's copies are partly from pageable memory: fixed);
* F: FLOPs of the products and convolutions, Φ = 67 TFLOP/s (an H100's or H200's float32 peak without TF32:
  fixed): the least time the device needs, added as if nothing overlapped it.

s and a are the solution of the two one-rank lease rounds of 985a042 (the loop 1.087 s, the batch at 16 rows a
call 1.261 s), traced by the proxy in that checkout (W2 with its 1,000 clients, as ``bench_w2.py`` ran it). Ranks
sharing the GPU are then predicted with nothing more fitted, for the lease's six other rounds: P ranks (W = P − 1
workers) take the busiest worker's share of the one-rank round, k(W)/50 of it (``scaling_model.busiest``: mpifl's
own sampling and dynamic placement), plus the MPI tree that several ranks add (``scaling_model.mpi_seconds``: the
model's broadcast and the wire's reduction in ⌈log₂ P⌉ steps at this machine's measured bandwidths, before issue 48
as at 985a042, taken as they are, as ``scaling_model.py`` takes them). The one-rank round's serial parts (rank 0's
step, the rounding) are shared out with the rest, an approximation (RESULTS.md gives the variants). The model
knows nothing of a device saturated by several ranks, nor of kernels far from their peak (vmap's grouped
convolutions): where those bind, it predicts low.

    (cd /tmp/wt-985 && PYTHONPATH=/tmp/wt-985 python benchmarks/dispatch_proxy.py --algorithm fedavg --loop \\
        --clients 1000 --chunk 16 --counter /path/to/this/checkout/mpifl/training/syncdebug.py --json /tmp/985.json)
    python benchmarks/gpu_model.py --fit /tmp/985.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

READ_S, BANDWIDTH, PEAK_FLOPS = 20e-6, 25e9, 67e12
"""b, β and Φ (see the module's docstring)."""
LEASE = {("loop", 1): 1.087, ("batched", 1): 1.261, ("loop", 3): 0.551, ("batched", 3): 0.619,
         ("loop", 5): 0.421, ("batched", 5): 0.496, ("loop", 9): 0.338, ("batched", 9): 0.493}
"""W2 seconds a round on the lease's H200 at 985a042 (median of rounds 2..3; ``client.vectorize`` false, true), by
rank count P (P − 1 workers sharing the GPU): shared/gpu/lease-2026-11-28/{first,rest}/check/report.md."""
ROWS = {"loop": "fedavg (the loop)", "batched": "fedavg"}
"""The proxy's rows (``--json``) of the two settings."""
COHORT = 50
BCAST_GBS, REDUCE_GBS = 1.6, 0.52
"""The MPI tree's bandwidths a step on this machine, for the model's broadcast and the wire's reduction (RESULTS.md,
"A strong-scaling model of W2": ``scaling_model.py --bcast-gbs 1.6 --reduce-gbs 0.52``)."""


@dataclass(frozen=True)
class Counts:
    """One round's counts, as the proxy writes them (``Counted.summary``)."""

    launching: float
    reads: float
    to_device: float
    to_host: float
    flops: float
    host_s: float

    @classmethod
    def of(cls, summary: Mapping[str, float]) -> Counts:
        return cls(**{f.name: float(summary[f.name]) for f in dataclasses.fields(cls) if f.name in summary})


@dataclass(frozen=True)
class Model:
    """t = s·H + a·L + b·R + (U + D)/β + F/Φ (the module's docstring)."""

    host_scale: float  # s
    launch_s: float  # a
    read_s: float = READ_S
    bandwidth: float = BANDWIDTH
    peak_flops: float = PEAK_FLOPS

    def terms(self, c: Counts) -> dict[str, float]:
        """Each term's seconds."""
        return {"host": self.host_scale * c.host_s, "launches": self.launch_s * c.launching,
                "reads": self.read_s * c.reads, "bytes": (c.to_device + c.to_host) / self.bandwidth,
                "flops": c.flops / self.peak_flops}

    def seconds(self, c: Counts) -> float:
        """A round's seconds on one rank."""
        return sum(self.terms(c).values())

    def on_ranks(self, c: Counts, ranks: int) -> float:
        """A round's seconds on ``ranks`` ranks sharing the GPU (``c`` counted on one): the busiest worker's share
        of the one-rank round, then the MPI tree."""
        if ranks == 1:
            return self.seconds(c)
        from scaling_model import busiest, mpi_seconds

        return busiest(ranks - 1) / COHORT * self.seconds(c) + mpi_seconds(ranks, BCAST_GBS, REDUCE_GBS, after=False)


FITTED = Model(host_scale=1.295, launch_s=60.5e-6)
"""s and a from ``python benchmarks/gpu_model.py --fit`` (RESULTS.md, issue 59's section): what the proxy predicts
with."""


def fit(loop: Counts, batched: Counts) -> Model:
    """s and a such that the loop's and the batch's one-rank rounds take :data:`LEASE`'s seconds, b, β and Φ
    fixed."""
    fixed = Model(0.0, 0.0)
    rows = [(loop, LEASE["loop", 1]), (batched, LEASE["batched", 1])]
    matrix = np.array([[c.host_s, c.launching] for c, _ in rows])
    rest = np.array([t - fixed.seconds(c) for c, t in rows])
    scale, launch = np.linalg.solve(matrix, rest)
    return Model(float(scale), float(launch))


def check(model: Model, counts: Mapping[str, Counts]) -> list[str]:
    """The model beside every lease round: a table's lines."""
    lines = ["| 985a042, W2 on the H200 | P | measured s | predicted s | error | fitted on it |",
             "|---|---:|---:|---:|---:|---|"]
    for (setting, ranks), measured in LEASE.items():
        predicted = model.on_ranks(counts[setting], ranks)
        lines.append(f"| {setting} | {ranks} | {measured:.3f} | {predicted:.3f} | {predicted / measured - 1:+.0%} | "
                     f"{'yes' if ranks == 1 else 'no'} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", type=Path, required=True, help="the proxy's --json of 985a042's two rows")
    args = parser.parse_args(argv)
    rows = json.loads(args.fit.read_text())
    counts = {setting: Counts.of(rows[name]) for setting, name in ROWS.items()}
    model = fit(counts["loop"], counts["batched"])
    print(f"s = {model.host_scale:.3f} (the lease host's seconds per host second here), a = "
          f"{model.launch_s * 1e6:.1f} µs a launch; b = {model.read_s * 1e6:.0f} µs a read, β = "
          f"{model.bandwidth / 1e9:.0f} GB/s, Φ = {model.peak_flops / 1e12:.0f} TFLOP/s (fixed)\n")
    for setting, c in counts.items():
        terms = ", ".join(f"{name} {seconds * 1e3:.0f} ms" for name, seconds in model.terms(c).items())
        print(f"{setting}: {terms}")
    print()
    print("\n".join(check(model, counts)))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
