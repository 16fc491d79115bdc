"""The round loop every rank runs: prepare the run, then round after round train, evaluate, checkpoint, record.

A training round is one part's job, picked at assembly: :class:`~.synchronous.SynchronousRounds` (the cohort walks
the plan together) or :class:`~.asynchronous.AsynchronousRounds` (clients dispatched and arriving one event at a
time). Evaluation (:mod:`.evaluation`), checkpoints (:mod:`.checkpointer`) and the results file (:mod:`.recorder`)
are parts too, and every part works with the same :class:`~.rank.RankContext`. The engine decides what happens
when; it reaches the algorithms only through their interface, and every rank calls the same collectives in the
same order.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

from mpifl.comm import Ledger, Placement, Transport
from mpifl.comm.messages import require
from mpifl.comm.transport import arrive_together, wait_without_spinning
from mpifl.config import RunConfig
from mpifl.data import build_federated_dataset
from mpifl.results.guard import ResultsClaim, claim_results
from mpifl.results.writing import prune_checkpoints
from mpifl.runtime.assembly import algorithm_sides, assemble, check_run, wire_format
from mpifl.runtime.faults import inject_fault
from mpifl.runtime.footprint import check_room
from mpifl.runtime.progress import Heartbeat
from mpifl.runtime.rank import RankContext
from mpifl.runtime.rankreport import rank_summary
from mpifl.runtime.stopping import StopRequest
from mpifl.runtime.timing import Profile, RankTimes
from mpifl.training.device import rank_devices


class Engine:
    """One rank's part of a run: rank 0 holds the server's algorithm and the results; every other rank hosts a
    share of the clients (rank 0 all of them when it is alone)."""

    def __init__(self, cfg: RunConfig, comm, output: str | Path, resume: bool = False,  # noqa: ANN001 - a Comm
                 profile: bool = False, overwrite: bool = False, force_start: bool = False):
        self.cfg, self.comm, self.output, self.resume, self.overwrite = cfg, comm, Path(output), resume, overwrite
        self.force_start = force_start  # start even where what the run writes will not fit (check_room)
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.times = RankTimes()
        self.profile = Profile(self.rank) if profile else None
        self.start_round = 1
        self.claim: ResultsClaim | None = None  # rank 0's, on the results file, from prepare() to the end

    # ----------------------------------------------------------------- preparing
    def prepare(self) -> None:
        """Build every part. Everything that can fail on bad input happens here, before the first collective of
        training."""
        started = time.perf_counter()
        cfg = self.cfg
        # the same on every rank, whatever the rank count: a client's arithmetic must not depend on where it runs
        torch.set_num_threads(cfg.threads_per_rank)
        # first: a collective (unless both are cpu), then may raise
        devices = rank_devices(cfg.device, cfg.server.device, self.comm, cfg.allow_tf32, cfg.data_memory_gb * 2**30)
        device = devices.clients
        if self.rank == 0:  # now, not at the first evaluation after training up to it
            self.claim = claim_results(self.output, self.resume, self.overwrite)
        dataset = build_federated_dataset(cfg.data, cfg.seed)
        self.layout = layout = dataset.layout
        ctx = dataclasses.replace(check_run(cfg, layout), device=device, server_device=devices.server)
        self.seen = np.flatnonzero(~layout.unseen)
        self.placement = Placement.balanced(layout.train_sizes, self.size)
        self.server, self.client, store = algorithm_sides(cfg, ctx, dataset, self.placement, self.rank, self.size)
        self.protocol = self.server.protocol if self.server is not None else require(self.client, "a side").protocol
        self.parts = RankContext(Transport(self.comm, self.placement), Ledger(), wire_format(cfg), self.server,
                                 self.client, store, self.times)
        self.walker, self.visits, self.checkpointer, self.recorder, self.evaluation, self.rounds = assemble(
            cfg, ctx, self.parts, self.protocol, self.placement, self.output, dataset.cheap_clients)
        if self.resume:
            self._resume()
        if self.rank == 0 and not self.force_start:  # before round 1: what the run will write must fit
            check_room(self)
        self.times.setup = time.perf_counter() - started

    def _resume(self) -> None:
        """Continue from the checkpoint in the results file: server state on rank 0, the states of the
        clients this rank hosts (wherever they lived before); then on rank 0 each part from the file's rows up to
        it (the tables, the ledger, the rounds' clocks and privacy accountant)."""
        state = self.client.state if self.client is not None else None
        round_, saved = self.checkpointer.load(self.output, self.cfg, self.server, state,
                                               self.placement.clients_of(self.rank), self.rounds.checkpointed)
        self.start_round = round_ + 1
        if self.server is None:  # the tables and the ledger are the server's alone
            return
        self.recorder.continue_from(saved, round_)
        self.parts.ledger.resume(saved, self.output, round_)
        self.rounds.resume(saved, round_)

    # ----------------------------------------------------------------- running
    def run(self, progress: bool = True, heartbeat_s: float = 0.0, stop: StopRequest | None = None) -> int | None:
        """Every round from the first not yet done; evaluations, checkpoints and results writes as configured.
        Returns ``None`` when the run completed, or the round after which it stopped because ``stop`` was asked
        on some rank (a checkpoint is taken there and the file marked "interrupted")."""
        if self.claim is not None:
            self.claim.remove_replaced_checkpoints()
        if self.start_round == 1 and (plan := self.protocol.setup_plan()):  # once, as round 0 (ledger: "setup")
            everyone = np.arange(self.layout.num_clients) if self.protocol.setup_includes_unseen else self.seen
            self.walker.walk(0, "setup", plan, everyone)
            self.parts.end_round()
        wall, cpu, self.parts_at_start = time.perf_counter(), time.process_time(), self.parts.time_parts()
        every, last = self.cfg.checkpoint_every, self.cfg.rounds
        heartbeat = Heartbeat(heartbeat_s if progress else 0.0, self.start_round, last)
        last_checkpoint = time.monotonic()
        for round_ in range(self.start_round, last + 1):
            round_start, parts_before = time.perf_counter(), self.parts.time_parts()
            inject_fault(self.rank, round_)
            self.rounds.train_round(round_)
            due = self.server is not None and self.cfg.checkpoint_minutes > 0 and (
                time.monotonic() - last_checkpoint >= 60 * self.cfg.checkpoint_minutes)
            halt, due = self._agree(stop is not None and stop.requested, due) if round_ < last else (False, False)
            evaluation = round_ % self.cfg.eval_every == 0 or round_ == last
            checkpoint = bool(every) and round_ % every == 0 or halt or due
            if checkpoint:
                last_checkpoint = time.monotonic()
            if evaluation:
                self.evaluation.run(round_)
            if checkpoint:
                state = self.client.state if self.client else None
                self.checkpointer.take(round_, self.server, state, self.rounds.checkpointed)
            if self.server is not None:
                heartbeat.report(round_, self.recorder.progress_line(round_) if evaluation and progress else None)
                if evaluation or checkpoint:
                    self._write("interrupted" if halt else "running", wait=halt)
            if self.profile is not None:
                self.profile.add(round_, time.perf_counter() - round_start, self.parts.time_parts() - parts_before)
            if halt:  # no rank leaves before rank 0 has the checkpoint on disk: a launcher ends the job at the first
                self._release()
                if self.size > 1:
                    arrive_together(self.comm)
                return round_
        self.times.loop_wall = time.perf_counter() - wall
        self.times.loop_cpu = time.process_time() - cpu
        self._finish()
        self._release()
        return None

    def _agree(self, stop: bool, due: bool) -> tuple[bool, bool]:
        """Whether any rank was asked to stop, and whether rank 0's clock says a checkpoint is due: one small
        all-reduce on every rank, so all of them stop, or checkpoint, after the same round."""
        flags = np.array([int(stop) | int(due) << 1])
        if self.size > 1:  # the workers wait here while the server steps: asleep, not polling a core
            from mpi4py import MPI

            mine, flags = flags, np.zeros_like(flags)
            wait_without_spinning(self.comm.Iallreduce(mine, flags, op=MPI.BOR))
        return bool(flags[0] & 1), bool(flags[0] & 2)

    def _release(self) -> None:
        """The end of this rank's part: client state closed, the output's lock given up."""
        if self.client is not None:
            self.client.state.close()
        self.release_output()

    def release_output(self) -> None:
        """Give up the lock on the results file (also after a failed set-up)."""
        if self.claim is not None:
            self.claim.release()

    # ---------------------------------------------------------------- results
    def _write(self, status: str, final: dict[str, dict[str, np.ndarray]] | None = None, wait: bool = False) -> None:
        start = time.perf_counter()
        self.recorder.write(status, self.parts.ledger, self.parts.transport.physical, self.checkpointer.latest,
                            final, wait)
        self.times.io += time.perf_counter() - start

    def settle(self) -> None:
        """After a failure on this rank: let the results write in flight finish (best effort), so the
        file keeps every completed evaluation."""
        if self.server is not None:
            self.recorder.settle()

    def _finish(self) -> None:
        """Collect every rank's time breakdown and MPI totals, and with ``--profile`` its per-round rows
        (once, at the end: small pickled objects are fine); rank 0 writes the file's last tables."""
        mine = rank_summary(self.rank, self.placement, self.parts.transport, self.visits, self.client, self.parts.store,
                            self.times, self.parts.time_parts() - self.parts_at_start)
        rows = self.profile.rows() if self.profile is not None else np.zeros((0, len(Profile.COLUMNS)))
        if self.size > 1:
            arrive_together(self.comm)
        per_rank = self.comm.gather((mine, rows), root=0) if self.size > 1 else [(mine, rows)]
        if self.server is None:
            return
        counters = dict.fromkeys(name for r in per_rank for name in r[0])  # the server has no client counters
        final = {"ranks": {name: np.array([r[0].get(name, 0) for r in per_rank]) for name in counters},
                 "model": self.server.final_state()}
        if self.profile is not None:
            final["profile"] = Profile.table([r[1] for r in per_rank])
        self._write("completed", final, wait=True)
        latest = self.checkpointer.latest  # the checkpoint the file commits: only its files (and the kept) stay
        prune_checkpoints(self.output, latest["blobs"] if latest is not None else None)
