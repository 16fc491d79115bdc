"""A W2 round's seconds on a GPU, predicted from what ``benchmarks/dispatch_proxy.py`` counts on the CPU, by a small
model calibrated on the one GPU lease there has been (shared/gpu/lease-2026-11-28: an NVIDIA H200, 16 CPUs).

A W2 round on a GPU is bound by its host (issue 43: the device waits for launches and reads), but for one kind of
kernel: so the model adds up the host's work, each part from a count of the proxy's, and the device's time for the
kernels that are far from their peak:

    t = s·H + a·L + b·R + (U + D)/β + (F − G)/Φ + G/Γ

* H: a training round's host CPU seconds outside torch's operations on *this* machine (the proxy's ``host_s``:
  Python, numpy, the exact sum's host folds; the thread's user-mode seconds of rounds 2.., less the operations' own
  and the counting mode's: ``dispatch_proxy.timed_rounds``), and s the lease host's seconds for one of them (fitted);
* L: the operations that launch a kernel (dispatched, not views), a = 15 µs each (what eager PyTorch's dispatcher,
  caching allocator and ``cudaLaunchKernel`` cost a server's CPU for a small kernel: fixed);
* R: host reads, b = 20 µs each (a synchronization with a nearly idle device and a small copy: fixed);
* U, D: bytes host→device and device→host (``syncdebug.host_traffic``), β = 25 GB/s (PCIe 5.0 ×16 at about half
  its rate: mpifl's copies are partly from pageable memory: fixed);
* F: FLOPs of the products and convolutions, Φ = 67 TFLOP/s (an H100's or H200's float32 peak without TF32:
  fixed), the least time the device needs for them;
* G: of F, the grouped convolutions' (vmap runs a convolution over a batch of client rows as one convolution of
  that many groups), Γ their rate on the lease's device, with mpifl's deterministic cuDNN (fitted): the lease's
  batch at 985a042 took longer than its loop with a third of the loop's launches, a fifth of its reads and less host
  time (here), which nothing on the host explains.

s comes from the lease's one-rank loop of 985a042 (1.087 s a round; it has no grouped convolution), Γ from its
one-rank batch at 16 rows a call (1.261 s), traced by the proxy in that checkout (W2 with its 1,000 clients, as
``bench_w2.py`` ran it), H the median of several traces (on a shared machine it varies by ±15% from run to run;
the counts do not). Ranks sharing the GPU are then predicted with nothing more fitted, for the lease's six other
rounds: P ranks (W = P − 1 workers) take the busiest worker's share, k(W)/50 (``scaling_model.busiest``: mpifl's
own sampling and dynamic placement), of the one-rank round but its grouped convolutions, plus the MPI tree that
several ranks add (``scaling_model.mpi_seconds``: the model's broadcast and the wire's reduction in ⌈log₂ P⌉ steps
at this machine's measured bandwidths, before issue 48 as at 985a042, taken as they are, as ``scaling_model.py``
takes them), or, if longer, every worker's grouped convolutions one after another on the one device. The one-rank
round's serial parts (rank 0's step, the rounding) are shared out with the rest, an approximation.

    (cd /tmp/wt-985 && PYTHONPATH=/tmp/wt-985 python benchmarks/dispatch_proxy.py --algorithm fedavg --loop \
        --clients 1000 --chunk 16 --counter /path/to/this/checkout/mpifl/training/syncdebug.py --json /tmp/985-1.json)
    ... (more traces: /tmp/985-2.json, ...)
    python benchmarks/gpu_model.py --fit /tmp/985-*.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

LAUNCH_S, READ_S, BANDWIDTH, PEAK_FLOPS = 15e-6, 20e-6, 25e9, 67e12
"""a, b, β and Φ (see the module's docstring)."""
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
    grouped_flops: float = 0.0

    @classmethod
    def of(cls, summary: Mapping[str, float]) -> Counts:
        return cls(**{f.name: float(summary[f.name]) for f in dataclasses.fields(cls) if f.name in summary})


@dataclass(frozen=True)
class Model:
    """t = s·H + a·L + b·R + (U + D)/β + (F − G)/Φ + G/Γ (the module's docstring)."""

    host_scale: float  # s
    grouped_rate: float = PEAK_FLOPS  # Γ
    launch_s: float = LAUNCH_S  # a
    read_s: float = READ_S
    bandwidth: float = BANDWIDTH
    peak_flops: float = PEAK_FLOPS

    def terms(self, c: Counts) -> dict[str, float]:
        """Each term's seconds."""
        return {"host": self.host_scale * c.host_s, "launches": self.launch_s * c.launching,
                "reads": self.read_s * c.reads, "bytes": (c.to_device + c.to_host) / self.bandwidth,
                "flops": (c.flops - c.grouped_flops) / self.peak_flops, "grouped": c.grouped_flops / self.grouped_rate}

    def seconds(self, c: Counts) -> float:
        """A round's seconds on one rank."""
        return sum(self.terms(c).values())

    def on_ranks(self, c: Counts, ranks: int) -> float:
        """A round's seconds on ``ranks`` ranks sharing the GPU (``c`` counted on one): the busiest worker's share
        of the one-rank round but its grouped convolutions, then the MPI tree; or all workers' grouped convolutions
        on the one device, if longer."""
        if ranks == 1:
            return self.seconds(c)
        from scaling_model import busiest, mpi_seconds

        device = self.terms(c)["grouped"]
        tree = mpi_seconds(ranks, BCAST_GBS, REDUCE_GBS, after=False)
        return max(busiest(ranks - 1) / COHORT * (self.seconds(c) - device) + tree, device)


FITTED = Model(host_scale=1.302, grouped_rate=0.73e12)
"""s and Γ from ``python benchmarks/gpu_model.py --fit`` (RESULTS.md, issue 59's section): what the proxy predicts
with."""


def fit(loop: Counts, batched: Counts, launch_s: float = LAUNCH_S) -> Model:
    """s and Γ such that the loop's and the batch's one-rank rounds take :data:`LEASE`'s seconds, the other
    constants fixed (a = ``launch_s``)."""
    fixed = Model(0.0, grouped_rate=math.inf, launch_s=launch_s)  # the terms not fitted
    rows = [(loop, LEASE["loop", 1]), (batched, LEASE["batched", 1])]
    matrix = np.array([[c.host_s, c.grouped_flops] for c, _ in rows])
    scale, per_flop = np.linalg.solve(matrix, [t - fixed.seconds(c) for c, t in rows])
    return Model(float(scale), float(1 / per_flop), launch_s)


def medians(traces: list[Mapping[str, Mapping[str, float]]], name: str) -> Counts:
    """The row ``name`` of the proxy's ``--json`` traces, its host seconds the median of theirs (its counts are the
    same in every trace)."""
    counts = [Counts.of(trace[name]) for trace in traces]
    return dataclasses.replace(counts[0], host_s=float(np.median([c.host_s for c in counts])))


def check(model: Model, counts: Mapping[str, Counts]) -> list[str]:
    """The model beside every lease round: a table's lines."""
    lines = ["| 985a042, W2 on the H200 | P | measured s | predicted s | error | fitted on it |",
             "|---|---:|---:|---:|---:|---|"]
    for (setting, ranks), measured in LEASE.items():
        predicted = model.on_ranks(counts[setting], ranks)
        fitted = "no" if ranks > 1 else "yes: s" if setting == "loop" else "yes: Γ"
        lines.append(f"| {setting} | {ranks} | {measured:.3f} | {predicted:.3f} | {predicted / measured - 1:+.0%} | "
                     f"{fitted} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", type=Path, nargs="+",
                        help="the proxy's --json traces of 985a042's two rows (their host seconds' medians are used)")
    parser.add_argument("--launch-us", type=float, default=LAUNCH_S * 1e6, help="a, µs a launch (default 15)")
    parser.add_argument("--predict", type=Path, help="a proxy's --json: each row's predicted ms with FITTED")
    args = parser.parse_args(argv)
    if args.predict:
        for name, row in json.loads(args.predict.read_text()).items():
            terms = FITTED.terms(Counts.of(row))
            print(f"{name}: {sum(terms.values()) * 1e3:.0f} ms ("
                  + ", ".join(f"{term} {seconds * 1e3:.0f}" for term, seconds in terms.items()) + ")")
        return 0
    if not args.fit:
        parser.error("give --fit or --predict")
    traces = [json.loads(path.read_text()) for path in args.fit]
    counts = {setting: medians(traces, name) for setting, name in ROWS.items()}
    model = fit(counts["loop"], counts["batched"], args.launch_us * 1e-6)
    spread = {setting: sorted(round(Counts.of(t[name]).host_s, 3) for t in traces) for setting, name in ROWS.items()}
    print(f"s = {model.host_scale:.3f} (the lease host's seconds per host second here; H's medians of {len(traces)} "
          f"traces: {spread}), Γ = {model.grouped_rate / 1e12:.2f} TFLOP/s; a = {model.launch_s * 1e6:.0f} µs a "
          f"launch, b = {model.read_s * 1e6:.0f} µs a read, β = {model.bandwidth / 1e9:.0f} GB/s, Φ = "
          f"{model.peak_flops / 1e12:.0f} TFLOP/s (fixed)\n")
    for setting, c in counts.items():
        terms = ", ".join(f"{name} {seconds * 1e3:.0f} ms" for name, seconds in model.terms(c).items())
        print(f"{setting}: {terms}")
    print()
    print("\n".join(check(model, counts)))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
