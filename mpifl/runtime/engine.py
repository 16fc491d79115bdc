"""The round loop every rank runs: prepare the run, then round after round train, evaluate, checkpoint, record.

A training round is five phases, each a part of its own: choose the cohort (:mod:`.cohort`), place it
(:mod:`.visits`), walk the algorithm's plan among it (:mod:`.walker`), account its simulated time
(:mod:`.simtime`), record it (:mod:`.roundlog`). An asynchronous protocol's round is event-driven instead
(:mod:`.asynchronous`). Evaluation (:mod:`.evaluation`), checkpoints (:mod:`.checkpointer`) and the results file
(:mod:`.recorder`) are parts too. The engine decides what happens when; it reaches the algorithms only through
their interface, and every rank calls the same collectives in the same order.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from mpifl.algorithms.base import (
    AsynchronousProtocol,
    ClientAlgorithm,
    EvalLayout,
    EventDrivenServer,
    RunContext,
    ServerAlgorithm,
    check_handlers,
    require,
)
from mpifl.comm import Placement, Step, Transport
from mpifl.comm.ledger import STAGES, Ledger
from mpifl.comm.network import NetworkModel
from mpifl.comm.privacy import PrivacyAccountant
from mpifl.comm.wire import WireFormat
from mpifl.config import RunConfig
from mpifl.data import build_federated_dataset
from mpifl.registry import get_algorithm
from mpifl.results import check_writable, shard_dir
from mpifl.results.guard import OutputLock, claim_results
from mpifl.runtime.assembly import availability, check_run, client_state, wire_format
from mpifl.runtime.asynchronous import AsynchronousRounds
from mpifl.runtime.checkpointer import Checkpointer
from mpifl.runtime.cohort import Cohort, CohortSelection
from mpifl.runtime.evaluation import Evaluation
from mpifl.runtime.faults import FaultModel
from mpifl.runtime.progress import Heartbeat
from mpifl.runtime.recorder import Recorder
from mpifl.runtime.roundlog import RoundLog
from mpifl.runtime.simtime import SimulatedTime
from mpifl.runtime.stopping import StopRequest
from mpifl.runtime.store import ClientStore
from mpifl.runtime.timing import Profile, RankTimes, rank_summary
from mpifl.runtime.visits import Visits
from mpifl.runtime.walker import PlanWalker, Walk
from mpifl.schema import ConfigError
from mpifl.training.device import rank_devices


class Engine:
    """One rank's part of a run: rank 0 holds the server's algorithm and the results; every other rank hosts a
    share of the clients (rank 0 all of them when it is alone)."""

    def __init__(self, cfg: RunConfig, comm, output: str | Path, resume: bool = False,  # noqa: ANN001 - a Comm
                 profile: bool = False, overwrite: bool = False):
        self.cfg, self.comm, self.output, self.resume, self.overwrite = cfg, comm, Path(output), resume, overwrite
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.times = RankTimes()
        self.profile = Profile(self.rank) if profile else None
        self.start_round = 1
        self.output_lock: OutputLock | None = None  # rank 0's, on the results file, from prepare() to the end
        self.replaces_run = False  # the output holds another run's results (--overwrite): its shards go at the start

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
            check_writable(self.output)  # first: the claim creates the lock file beside it
            self.output_lock, previous = claim_results(self.output, self.resume, self.overwrite)
            self.replaces_run = previous.kind == "results" and not self.resume
        dataset = build_federated_dataset(cfg.data, cfg.seed)
        self.layout = layout = dataset.layout
        ctx = dataclasses.replace(check_run(cfg, layout), device=device, server_device=devices.server)
        self.seen = np.flatnonzero(~layout.unseen)
        self.placement = Placement.balanced(layout.train_sizes, self.size)
        wire = wire_format(cfg)
        self.transport, self.ledger = Transport(self.comm, self.placement), Ledger()
        entry = get_algorithm(cfg.algorithm)
        self.server: ServerAlgorithm | None = entry.server(ctx) if self.rank == 0 else None
        self.client: ClientAlgorithm | None = None
        self.store: ClientStore | None = None
        if self.size == 1 or self.rank > 0:
            self.store = ClientStore(dataset, self.placement.clients_of(self.rank), device, cfg.data_memory_gb * 2**30)
            self.client = entry.client(ctx, self.store, client_state(cfg))
        check_handlers(self.server, self.client)
        self.protocol = self.server.protocol if self.server is not None else require(self.client, "a side").protocol
        self._assemble(ctx, wire, dataset.cheap_clients)
        if self.resume:
            self._resume()
        self.times.setup = time.perf_counter() - started

    def _assemble(self, ctx: RunContext, wire: WireFormat, cheap_clients: bool) -> None:
        """The parts that move, time, record and save the rounds."""
        cfg, protocol, layout = self.cfg, self.protocol, ctx.layout
        samples = protocol.samples_per_round()
        faults = FaultModel(cfg.faults, cfg.seed)
        self.simtime = SimulatedTime(NetworkModel.from_config(cfg.network, layout.num_clients, cfg.seed), wire,
                                     samples, protocol.turns)
        self.cohorts = CohortSelection(cfg, self.seen, availability(cfg, layout), faults, self.simtime, self.transport)
        self.walker = PlanWalker(self.transport, self.ledger, self.server, self.client, self.store, faults, self.times, wire,
                                 ctx.sum_weights)
        asynchronous = isinstance(protocol, AsynchronousProtocol)
        dynamic = cfg.placement == "dynamic" or cfg.placement == "auto" and cheap_clients
        state = self.client.state if self.client is not None else None
        self.visits = Visits(self.transport, self.placement, self.store, state, self.times,
                             dynamic and self.size > 2 and not asynchronous, samples)
        self.checkpointer = Checkpointer(self.transport, self.times, self.output, cfg.checkpoint_keep)
        # every model kind on the test split, and on the validation split where the data has one (model selection)
        splits = ("test", "val") if cfg.data.val_fraction > 0 or layout.has_val else ("test",)
        eval_layout = EvalLayout(protocol.eval_kinds, splits)
        self.recorder = Recorder(cfg, layout, eval_layout, self.output, self.size, self.placement.owner)
        self.log = RoundLog(self.transport, self.ledger, self.server, self.client, self.recorder, samples)
        self.evaluation = Evaluation(layout, eval_layout, cfg.eval_chunk, protocol, self.walker,
                                     (self.server, self.client), self.recorder, self.times, self._release_data)
        self.accountant = None
        if cfg.privacy.mode != "off" and self.server is not None:
            self.accountant = PrivacyAccountant(cfg.privacy, len(self.seen), cfg.clients_per_round, layout.num_clients)
        self.asynchronous = None
        if isinstance(protocol, AsynchronousProtocol):
            if self.server is not None and not isinstance(self.server, EventDrivenServer):
                raise ConfigError(f"algorithm {cfg.algorithm}: an asynchronous protocol needs an EventDrivenServer")
            self.asynchronous = AsynchronousRounds(protocol, self.server, self.walker, self.cohorts, faults,
                                                   self.simtime, self.log, self.placement, self.times,
                                                   self._end_round)

    def _resume(self) -> None:
        """Continue from the checkpoint in the results file: server state on rank 0, the states of the
        clients this rank hosts (wherever they lived before), rank 0's tables, ledger and clocks up to it."""
        state = self.client.state if self.client is not None else None
        round_, saved = self.checkpointer.load(self.output, self.cfg, self.server, state,
                                               self.placement.clients_of(self.rank))
        self.start_round = round_ + 1
        if self.server is None:  # the tables and the ledger are the server's alone
            return
        self.recorder.continue_from(saved, round_)
        rounds = saved.table("rounds")
        for seconds in rounds["sim_time_s"][rounds["round"] <= round_]:  # the clock as the run summed it
            self.simtime.now_s += float(seconds)
        attrs = saved.table_attrs["ledger_totals"]  # per-round totals: the per-client rows stay in the file
        ledger = self.ledger
        ledger.load(saved.table("ledger_totals"), attrs["message_names"], attrs["directions"], self.output, round_)
        if self.accountant is not None:  # ε so far: every round again, with the clients that uploaded in it
            train_uploads = ledger.participants(STAGES.index("train"), "up")
            for past in range(1, round_ + 1):
                self.accountant.step(train_uploads.get(past, np.zeros(0, np.int64)))

    # ----------------------------------------------------------------- running
    def run(self, progress: bool = True, heartbeat_s: float = 0.0, stop: StopRequest | None = None) -> int | None:
        """Every round from the first not yet done; evaluations, checkpoints and results writes as configured.
        Returns ``None`` when the run completed, or the round after which it stopped because ``stop`` was asked
        on some rank (a checkpoint is taken there and the file marked "interrupted")."""
        if self.replaces_run:
            self._remove_replaced_shards()
        if self.start_round == 1:
            self._walk_setup_plan()
        wall, cpu, self.parts_at_start = time.perf_counter(), time.process_time(), self._time_parts()
        every, last = self.cfg.checkpoint_every, self.cfg.rounds
        heartbeat = Heartbeat(heartbeat_s if progress else 0.0, self.start_round, last)
        for round_ in range(self.start_round, last + 1):
            round_start, parts_before = time.perf_counter(), self._time_parts()
            self._fault_injection(round_)
            (self.asynchronous.train_round if self.asynchronous else self.train_round)(round_)
            halt = stop is not None and round_ < last and self._anyone_asked(stop)
            evaluation = round_ % self.cfg.eval_every == 0 or round_ == last
            checkpoint = bool(every) and round_ % every == 0 or halt
            if evaluation:
                self.evaluation.run(round_)
            if checkpoint:
                self.checkpointer.take(round_, self.server, self.client.state if self.client else None)
            if self.server is not None:
                self._report(round_, evaluation and progress, heartbeat)
                if evaluation or checkpoint:
                    self._write("interrupted" if halt else "running", wait=halt)
            if self.profile is not None:
                self.profile.add(round_, time.perf_counter() - round_start, self._time_parts() - parts_before)
            if halt:  # no rank leaves before rank 0 has the checkpoint on disk: a launcher ends the job at the first
                self._release()
                if self.size > 1:
                    self.comm.Barrier()
                return round_
        self.times.loop_wall = time.perf_counter() - wall
        self.times.loop_cpu = time.process_time() - cpu
        self._finish()
        self._release()
        return None

    def _anyone_asked(self, stop: StopRequest) -> bool:
        """Whether any rank was asked to stop (one small all-reduce: every rank stops after the same round)."""
        return self.comm.allreduce(int(stop.requested)) > 0 if self.size > 1 else stop.requested

    def _report(self, round_: int, evaluated: bool, heartbeat: Heartbeat) -> None:
        """Rank 0's progress line after an evaluation, or a heartbeat when one is due."""
        line = self.recorder.progress_line(round_) if evaluated else heartbeat.line(round_)
        if line is not None:
            print(line, flush=True)
            heartbeat.printed()

    def _remove_replaced_shards(self) -> None:
        """Rank 0, before the first round (so before any worker writes one): the checkpoint shards of the run
        this one replaces (``--overwrite``), which nothing refers to any more."""
        for file in shard_dir(self.output).glob("*round*-*.h5*"):
            file.unlink(missing_ok=True)

    def _release(self) -> None:
        """The end of this rank's part: client state closed, the output's lock given up."""
        if self.client is not None:
            self.client.state.close()
        self.release_output()

    def release_output(self) -> None:
        """Give up the lock on the results file (also after a failed set-up)."""
        if self.output_lock is not None:
            self.output_lock.release()

    def train_round(self, round_: int) -> None:
        """One synchronous round, phase by phase."""
        started, server_before = time.perf_counter(), self.times.server
        plan = self.protocol.train_plan(round_)
        cohort = self.cohorts.choose(round_, plan)
        with self.visits.placed(round_, cohort.participants) as placement:
            walk = self._walk_training(round_, plan, cohort)
            self._end_round()
            telemetry = self.log.telemetry(round_, walk)
        if self.server is None or telemetry is None:
            return
        clients = walk.clients
        if self.walker.wire.masks:
            self.walker.record_secure_aggregation(round_, plan, cohort.participants, clients)
        server_s = self.times.server - server_before
        clients_s = self.simtime.round_seconds(clients, self.simtime.traffic(plan, clients, len(cohort.participants)),
                                               telemetry[:, 0])
        sim_time_s = self.simtime.advance(cohort.start_s, server_s, clients_s)
        privacy = {"epsilon": self.accountant.step(clients)} if self.accountant is not None else {}
        online = {} if self.cohorts.availability.always else {"sim_clock_s": cohort.start_s,
                                                              "available_clients": len(cohort.online)}
        self.log.record(round_, started, server_s, sim_time_s, telemetry, clients, placement, walk.rejected,
                        **privacy, **online)

    def _walk_training(self, round_: int, plan: Sequence[Step], cohort: Cohort) -> Walk:
        """The round's training plan among its participants: all together, or one after another (``turns``)."""
        clients = cohort.participants
        if self.protocol.turns:  # each client sees the server state the previous one left
            walks = [self.walker.walk(round_, "train", plan, clients[i : i + 1]) for i in range(len(clients))]
            if not walks:
                return Walk(clients, np.zeros(0), clients)
            local, seconds, survivors = (np.concatenate([getattr(w, f) for w in walks])
                                         for f in ("local", "seconds", "clients"))
            return Walk(local, seconds, survivors, sum(w.rejected for w in walks))
        everyone = any(step.everyone for step in plan)  # every seen client that is online and up this round
        audience = np.setdiff1d(cohort.online, np.setdiff1d(cohort.sampled, clients)) if everyone else None
        return self.walker.walk(round_, "train", plan, clients, audience)

    def _walk_setup_plan(self) -> None:
        """The protocol's one-time set-up plan, as round 0 with every seen client (ledger stage "setup")."""
        plan = self.protocol.setup_plan()
        if plan:
            everyone = np.arange(self.layout.num_clients) if self.protocol.setup_includes_unseen else self.seen
            self.walker.walk(0, "setup", plan, everyone)
            self._end_round()

    def _end_round(self) -> None:
        if self.client is not None:
            self.client.end_round()
        self._release_data()

    def _release_data(self) -> None:
        """Between uses of client data: keep only what fits ``data_memory_gb``."""
        if self.store is not None:
            self.store.release()

    def _fault_injection(self, round_: int) -> None:
        """Resilience drills: ``MPIFL_INJECT_FAULT=RANK:ROUND`` makes that rank raise at that round."""
        spec = os.environ.get("MPIFL_INJECT_FAULT")
        if spec and spec == f"{self.rank}:{round_}":
            raise RuntimeError(f"fault injected by MPIFL_INJECT_FAULT={spec}")

    # ---------------------------------------------------------------- results
    def _time_parts(self) -> np.ndarray:
        """This rank's cumulative seconds in each of :data:`~.timing.TIME_PARTS`."""
        t, transport = self.times, self.transport
        return np.array([t.compute, t.data, t.server, t.evaluation, transport.physical.total_seconds,
                         t.serialization + transport.pack_seconds, t.io])

    def _write(self, status: str, final: dict[str, dict[str, np.ndarray]] | None = None, wait: bool = False) -> None:
        start = time.perf_counter()
        self.recorder.write(status, self.ledger, self.transport.physical, self.checkpointer.latest,
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
        mine = rank_summary(self.rank, self.placement, self.transport, self.visits, self.client, self.store,
                            self.times, self._time_parts() - self.parts_at_start)
        rows = self.profile.rows() if self.profile is not None else np.zeros((0, len(Profile.COLUMNS)))
        per_rank = self.comm.gather((mine, rows), root=0) if self.size > 1 else [(mine, rows)]
        if self.server is None:
            return
        counters = dict.fromkeys(name for r in per_rank for name in r[0])  # the server has no client counters
        final = {"ranks": {name: np.array([r[0].get(name, 0) for r in per_rank]) for name in counters},
                 "model": self.server.final_state()}
        if self.profile is not None:
            final["profile"] = Profile.table([r[1] for r in per_rank])
        self._write("completed", final, wait=True)
