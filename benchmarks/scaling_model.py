"""A strong-scaling model of W2 (50 clients a round, 1.6 M parameters) from measured parts, for 8, 32 and 128
worker ranks, before and after issue 48's cuts of rank 0's serial time; checked against the GPU lease host's
measured 8-worker speed-up (4.550 s a round on 1 rank, 1.017 on 9: 4.47×, shared/gpu/lease-2026-11-28).

    python benchmarks/scaling_model.py [--write]                      # the model, from the defaults below
    mpirun -n 3 --oversubscribe python benchmarks/scaling_model.py --measure-mpi   # its MPI input, here

A round on W workers (P = W + 1 ranks) is modelled as the busiest worker's clients, then what every worker waits
for after its last client (its export, the sum's moves, the rounding where it happens, rank 0's serial work, the
next broadcast):

    T(W) = k(W)·c + e + m(W) + r(W) + s₀        T(1 rank) = 50·c + s₁

* c: one client's seconds (local SGD, its screen and exact fold): (4.550 − s₁)/50 on the lease host's CPU, 1 rank;
* k(W): the most clients on one worker, from mpifl's own sampling and dynamic placement (``sample_clients``,
  ``Placement.for_round``: W2's generated data makes ``placement: auto`` dynamic), median over 50 rounds;
* e: a worker's export of its total (benchmarks/RESULTS.md, the exact fold per client: 42 ms for three words an
  entry; two words at this bound);
* m(W): the model's broadcast (6.5 MB) and the wire's reduction (16 B an entry, 26 MB) as a tree of ⌈log₂ P⌉
  steps at the bandwidths ``--measure-mpi`` measures (one step each: two ranks' shared-memory transfer);
  after issue 48 the reduction is a reduce-scatter among the workers and a gather of 8 B an entry;
* r(W): the rounding where the workers do it (after): the whole wire's ``round_sum`` over W;
* s₀: rank 0's serial seconds between the upload and the next broadcast (benchmarks/bench_server_serial.py,
  "rank 0 alone"), before and after; s₁ the one-rank job's rounding and server step.

The parts other than c were measured on this session's 2-core machine under load (the lease host's would be
smaller), so the model's 8-worker speed-up is checked against the lease's 4.47× as a bound on what the model
leaves out (the lease ran before issue 48: the "before" column).
"""

from __future__ import annotations

import argparse
import math
import sys

import numpy as np
from common import heading, record

CLIENTS, ROUNDS, NUM_CLIENTS = 50, 50, 1000
MODEL_BYTES, WIRE_BYTES, SUMS_BYTES = 1_626_442 * 4, 1_626_442 * 16, 1_626_442 * 8


def busiest(workers: int) -> float:
    """k(W): the most clients on one worker per W2 round (median over ``ROUNDS`` rounds)."""
    from mpifl.comm.placement import Placement
    from mpifl.runtime.sampling import sample_clients

    samples = np.full(NUM_CLIENTS, 50, dtype=np.int64)  # W2: 50 training images a client
    home = Placement.balanced(samples, workers + 1)
    most = []
    for round_ in range(1, ROUNDS + 1):
        clients = sample_clients(0, round_, np.arange(NUM_CLIENTS), CLIENTS)
        owner = home.for_round(clients, samples[clients]).owner[clients]
        most.append(np.bincount(owner, minlength=workers + 1).max())
    return float(np.median(most))


def mpi_seconds(ranks: int, bcast_gbs: float, reduce_gbs: float, after: bool) -> float:
    """m(W): a tree of ⌈log₂ P⌉ steps for the broadcast and the sum (after: the workers' reduce-scatter, about the
    wire once whatever W, and rank 0's gather of the float64 sums)."""
    steps = math.ceil(math.log2(ranks))
    broadcast = steps * MODEL_BYTES / (bcast_gbs * 1e9)
    if after:
        return broadcast + WIRE_BYTES / (reduce_gbs * 1e9) + SUMS_BYTES / (bcast_gbs * 1e9)
    return broadcast + steps * WIRE_BYTES / (reduce_gbs * 1e9)


def round_seconds(workers: int, client: float, args: argparse.Namespace) -> tuple[float, ...]:
    """(k, T before, T after, m before, m after, serial on the path before, after) at ``workers`` workers."""
    k = busiest(workers)
    m_before = mpi_seconds(workers + 1, args.bcast_gbs, args.reduce_gbs, after=False)
    m_after = mpi_seconds(workers + 1, args.bcast_gbs, args.reduce_gbs, after=True)
    serial_before = args.export + args.serial_before
    serial_after = args.export + args.round_sum / workers + args.serial_after
    return (k, k * client + m_before + serial_before, k * client + m_after + serial_after, m_before, m_after,
            serial_before, serial_after)


def measure_mpi() -> None:
    """The bandwidths of one broadcast of the model and one reduction of the wire on this communicator (rank 0
    prints GB/s, the median of 5)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    model, wire = np.zeros(MODEL_BYTES // 4, np.float32), np.ones(WIRE_BYTES // 8, np.int64)
    summed = np.empty_like(wire)
    times: dict[str, list[float]] = {"bcast": [], "reduce": []}
    for _ in range(6):
        for name, call in (("bcast", lambda: comm.Bcast(model, root=0)),
                           ("reduce", lambda: comm.Reduce(wire, summed, op=MPI.SUM, root=0))):
            comm.Barrier()
            start = MPI.Wtime()
            call()
            comm.Barrier()
            times[name].append(MPI.Wtime() - start)
    if comm.rank == 0:
        print(f"P = {comm.size}: bcast {MODEL_BYTES / np.median(times['bcast'][1:]) / 1e9:.2f} GB/s, "
              f"reduce {WIRE_BYTES / np.median(times['reduce'][1:]) / 1e9:.2f} GB/s (medians of 5)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure-mpi", action="store_true", help="under mpirun: measure m(W)'s bandwidths")
    parser.add_argument("--one-rank", type=float, default=4.550, help="W2 s/round, 1 rank, the lease host's CPU")
    parser.add_argument("--eight-workers", type=float, default=1.017, help="W2 s/round, 9 ranks, the lease host")
    parser.add_argument("--serial-one-rank", type=float, default=0.070, help="s₁: rounded() + the step, 1 rank")
    parser.add_argument("--export", type=float, default=0.030, help="e: a worker's export (s)")
    parser.add_argument("--serial-before", type=float, default=0.085, help="s₀ before issue 48 (s)")
    parser.add_argument("--serial-after", type=float, default=0.012, help="s₀ after issue 48 (s)")
    parser.add_argument("--round-sum", type=float, default=0.014, help="the whole wire's round_sum (s)")
    parser.add_argument("--bcast-gbs", type=float, default=2.0, help="broadcast bandwidth per tree step (GB/s)")
    parser.add_argument("--reduce-gbs", type=float, default=1.0, help="reduction bandwidth per tree step (GB/s)")
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    if args.measure_mpi:
        measure_mpi()
        return
    client = (args.one_rank - args.serial_one_rank) / CLIENTS
    lines = [heading("A strong-scaling model of W2"), "",
             f"`python {' '.join(sys.argv)}`: c = {client * 1e3:.1f} ms a client, s₀ {args.serial_before * 1e3:.0f} "
             f"→ {args.serial_after * 1e3:.0f} ms, e {args.export * 1e3:.0f} ms, round_sum "
             f"{args.round_sum * 1e3:.0f} ms, broadcast {args.bcast_gbs} GB/s and reduction {args.reduce_gbs} GB/s a "
             "tree step", "",
             "| workers | k (busiest) | compute s | MPI s, before / after | serial on the path s, before / after "
             "| s/round, before / after | speed-up over 1 rank, before / after (with the residual) "
             "| efficiency, after |",
             "|---|---|---|---|---|---|---|---|"]
    rows = {workers: round_seconds(workers, client, args) for workers in (8, 32, 128)}
    residual = args.eight_workers - rows[8][1]  # what the model leaves out, from the lease's 8 workers
    for workers, (k, before, after, m_before, m_after, serial_before, serial_after) in rows.items():
        lines.append(f"| {workers} | {k:.0f} | {k * client:.3f} | {m_before:.3f} / {m_after:.3f} | "
                     f"{serial_before:.3f} / {serial_after:.3f} | {before:.3f} / {after:.3f} | "
                     f"{args.one_rank / before:.2f}× / {args.one_rank / after:.2f}× "
                     f"({args.one_rank / (before + residual):.2f}× / {args.one_rank / (after + residual):.2f}×) | "
                     f"{args.one_rank / after / workers:.0%} ({args.one_rank / (after + residual) / workers:.0%}) |")
    lines += ["", f"Measured on the lease host, 8 workers (before issue 48): {args.eight_workers:.3f} s/round, "
              f"{args.one_rank / args.eight_workers:.2f}× over 1 rank; the model's {rows[8][1]:.3f} s leaves out "
              f"{residual:.3f} s a round, taken as the same at every W in brackets."]
    record(lines, args.write)


if __name__ == "__main__":
    main()
