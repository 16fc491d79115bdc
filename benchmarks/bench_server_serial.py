"""Rank 0's serial time per W2 round: the seconds every worker waits on rank 0 between its upload and the next
broadcast (issue 48, "the host off the round's path").

    mpirun -n 3 --oversubscribe python benchmarks/bench_server_serial.py [--rounds 6] [--write]
    python benchmarks/bench_server_serial.py --parts [--write]

Under ``mpirun`` it runs W2 (``configs/w2.yaml``, no evaluation) in this process on every rank and, on rank 0, notes
when each collective's wait began and ended (``Transport.wait``; ``_timed`` before issue 58). Per round it prints two
gaps, median (minimum) over the rounds after the first: **rank 0 alone**, from the end of the summed delta's last
collective on rank 0 (the reduce before issue 48, the gather of the workers' rounded sums after) to the start of the
next round's model broadcast: the exact sum's rounding where rank 0 does it, the server step, the round's records, the
next cohort; and **from the agreement**, from the end of the delta's window agreement (every worker has folded its
clients) to the same broadcast: also the sum's moves, its export and the workers' rounding where they round. The
script only reads the transport's log, so the same file run from an older checkout measures "before" (copy it there).
Rank 0's CPU seconds in its gap are printed too: on a loaded machine its wall gap also holds the time it waited for a
core.

``--parts`` times, in one process, the pieces of that serial path on W2-sized rows (1,626,442 entries; the exact
sum of 50 float32 deltas of weight 1/50, as three ranks' words add): a worker's export, one rank's rounding of
its own total, ``round_sum`` of the whole wire (rank 0's before), of one worker's share at P = 3, the FedAvg server
step (``GlobalModel.step``, float64 on 1.6 M
entries, with the division by the weights' total). CPU seconds (``time.process_time``: the machine is shared; its
load average is printed), minimum and median of ``--repeats``; from an older checkout too.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from common import REPO, heading, record

W2 = REPO / "configs" / "w2.yaml"
W2_SIZE = 1_626_442


def job(rounds: int) -> dict[str, list[float]] | None:
    """W2 for ``rounds`` rounds on this communicator; on rank 0 each round's two gaps (seconds), else None."""
    import yaml
    from mpi4py import MPI

    from mpifl.comm.transport import Transport, wait_without_spinning
    from mpifl.registry import parse_config
    from mpifl.runtime.engine import Engine

    # (round, message, operation, wait start, wait end, CPU seconds at the start, at the end)
    events: list[tuple[int, str, str, float, float, float, float]] = []

    def timed(self: Transport, round_: int, name: str, op: str, nbytes: int, request) -> None:  # noqa: ANN001
        start, cpu = time.perf_counter(), time.process_time()
        wait_without_spinning(request)
        end = time.perf_counter()
        self.physical.record(round_, name, op, nbytes, end - start)
        if self.is_server:
            events.append((round_, name, op, start, end, cpu, time.process_time()))

    setattr(Transport, "wait" if hasattr(Transport, "wait") else "_timed", timed)  # _timed: an older checkout's
    raw = yaml.safe_load(W2.read_text())
    raw.update(rounds=rounds, eval_every=10**6)
    comm = MPI.COMM_WORLD
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_server_serial_{os.getpid() if comm.rank == 0 else 0}.h5"
    out = Path(comm.bcast(str(out), root=0))
    engine = Engine(parse_config(raw), comm, out, overwrite=True)
    engine.prepare()
    engine.run(progress=False)
    if comm.rank != 0:
        return None
    out.unlink(missing_ok=True)
    gaps: dict[str, list[float]] = {"rank 0 alone": [], "rank 0 alone, its CPU seconds": [],
                                    "from the agreement": []}
    for round_ in range(2, rounds):  # the first round warms up; the last has no next broadcast
        delta = max((e for e in events if e[0] == round_ and e[1] == "delta"), key=lambda e: e[4])
        agreed = max(e[4] for e in events if e[0] == round_ and e[1] == "delta_window")
        broadcast = min((e for e in events if e[0] == round_ + 1 and e[1] == "model"), key=lambda e: e[3])
        gaps["rank 0 alone"].append(broadcast[3] - delta[4])
        gaps["rank 0 alone, its CPU seconds"].append(broadcast[5] - delta[6])
        gaps["from the agreement"].append(broadcast[3] - agreed)
    return gaps


def cpu_ms(call, repeats: int) -> tuple[float, float]:  # noqa: ANN001
    """Minimum and median CPU milliseconds of ``call()`` over ``repeats`` calls, after one more."""
    call()
    seconds = []
    for _ in range(repeats):
        start = time.process_time()
        call()
        seconds.append(time.process_time() - start)
    return min(seconds) * 1e3, float(np.median(seconds)) * 1e3


def parts(repeats: int) -> dict[str, tuple[float, float]]:
    """CPU ms of the serial path's pieces on W2-sized rows."""
    import torch
    from bench_exactsum import trained_deltas

    from mpifl.algorithms.fedavg import GlobalModel
    from mpifl.comm import exactsum

    torch.set_num_threads(1)
    total = exactsum.ExactSum(W2_SIZE)
    for i, row in enumerate(trained_deltas(W2_SIZE, 4) * 13):
        if i < 50:
            total.add(row, 1 / 50)
    terms = 3 * 50  # the agreed bound at three ranks
    wire = total.export(total.window, terms) * 3  # three ranks' words, as the reduction adds them
    per = exactsum.words(total.window, terms)
    share = -(-(W2_SIZE // 2) // exactsum.CHUNK) * exactsum.CHUNK  # the first of two workers' whole chunks
    server = SimpleNamespace(optimizer="sgd", momentum=0.0, lr=1.0)
    model = GlobalModel(SimpleNamespace(cfg=SimpleNamespace(server=server)),
                        np.random.default_rng(0).standard_normal(W2_SIZE).astype(np.float32))
    summed = exactsum.round_sum(wire, total.window, terms)
    fused = "divisor" in inspect.signature(GlobalModel.step).parameters  # the step divides span by span (after)
    return {"a worker's export (two words an entry)": cpu_ms(lambda: total.export(total.window, terms), repeats),
            "one rank's rounding (ExactSum.rounded)": cpu_ms(total.rounded, repeats),
            "round_sum, the whole wire": cpu_ms(lambda: exactsum.round_sum(wire, total.window, terms), repeats),
            "round_sum, one worker's share at P = 3": cpu_ms(
                lambda: exactsum.round_sum(wire[: share * per], total.window, terms), repeats),
            "server step (GlobalModel.step, FedAvg)": cpu_ms(
                lambda: model.step(summed, divisor=50) if fused else model.step(summed / 50), repeats)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--parts", action="store_true", help="time the serial path's pieces in one process")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    if args.parts:
        rows = parts(args.repeats)
        lines = [heading("Rank 0's serial pieces per W2 round, one core"), "",
                 f"`python benchmarks/bench_server_serial.py --parts --repeats {args.repeats}`; load average "
                 f"{load:.1f} before, {os.getloadavg()[0]:.1f} after: CPU ms, minimum (median)", "",
                 "| piece | CPU ms |", "|---|---|"]
        lines += [f"| {name} | {low:.1f} ({med:.1f}) |" for name, (low, med) in rows.items()]
        record(lines, args.write)
        return
    gaps = job(args.rounds)
    if gaps is None:
        return
    from mpi4py import MPI

    size = MPI.COMM_WORLD.Get_size()
    lines = [heading(f"Rank 0's serial time per W2 round, P = {size}"), "",
             f"`mpirun -n {size} --oversubscribe python benchmarks/bench_server_serial.py --rounds {args.rounds}`; "
             f"load average {load:.1f} before, {os.getloadavg()[0]:.1f} after: ms, median (minimum) over rounds "
             f"2..{args.rounds - 1}", "", "| gap to the next broadcast | ms |", "|---|---|"]
    lines += [f"| {name} | {np.median(values) * 1e3:.1f} ({min(values) * 1e3:.1f}) |" for name, values in gaps.items()]
    record(lines, args.write)


if __name__ == "__main__":
    sys.exit(main())
