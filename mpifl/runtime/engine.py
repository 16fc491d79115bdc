"""The round loop every rank runs: sample, place, walk the algorithm's plans, evaluate, checkpoint, record.

The jobs are split: :mod:`.walker` moves a plan's messages and screens uploads, :mod:`.visits` takes a
visiting client's state along under dynamic placement, :mod:`.recorder` keeps rank 0's tables and writes the
results file, :mod:`.checkpointer` saves and restores every rank's state. The engine decides what happens
when, and reaches the algorithms only through their interface.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from mpifl.algorithms.base import ClientAlgorithm, RunContext, ServerAlgorithm, Stage, StepContext, require
from mpifl.algorithms.state import ClientState
from mpifl.comm import Message, Placement, Step, Transport
from mpifl.comm.availability import Availability
from mpifl.comm.ledger import STAGES
from mpifl.comm.network import NetworkModel
from mpifl.comm.privacy import PrivacyAccountant, check_privacy, poisson_cohort
from mpifl.comm.secagg import UNMASKING_ROUND
from mpifl.comm.wire import WireFormat
from mpifl.config import RunConfig
from mpifl.data import FederatedLayout, build_federated_dataset
from mpifl.registry import get_algorithm
from mpifl.results import check_writable
from mpifl.runtime.asynchronous import AsynchronousRounds
from mpifl.runtime.checkpointer import Checkpointer
from mpifl.runtime.clock import TIME_PARTS, RankClock, peak_rss_bytes
from mpifl.runtime.faults import FaultModel, selection_size
from mpifl.runtime.recorder import Recorder
from mpifl.runtime.sampling import sample_clients
from mpifl.runtime.store import ClientStore
from mpifl.runtime.visits import Visits
from mpifl.runtime.walker import PlanWalker, Walk
from mpifl.schema import ConfigError
from mpifl.training.device import rank_devices
from mpifl.training.sgd import EVAL_FIELDS

TELEMETRY_FIELDS = ("compute_s", "train_loss")


def check_run(cfg: RunConfig, layout: FederatedLayout) -> RunContext:
    """What can only be checked once the data layout is known (shared by ``run`` and ``validate``):
    enough seen clients, and an algorithm whose protocol (message sizes, model) fits the data."""
    seen = int((~layout.unseen).sum())
    if cfg.clients_per_round > seen:
        raise ConfigError(f"clients_per_round: {cfg.clients_per_round} exceeds the {seen} seen clients of the data")
    selected = selection_size(cfg.clients_per_round, cfg.faults)
    if selected > seen:
        raise ConfigError(f"faults.over_selection: selecting {selected} clients per round exceeds the {seen} seen "
                          "clients of the data")
    if cfg.client.augment != "none" and len(layout.input_shape) != 3:
        raise ConfigError(f"client.augment: {cfg.client.augment!r} crops and flips images; the data's samples have "
                          f"shape {layout.input_shape}")
    entry = get_algorithm(cfg.algorithm)
    ctx = RunContext(cfg, layout)
    availability(cfg, layout)  # a trace file is read and checked here
    protocol = entry.server.protocol_type(ctx)
    wire_format(cfg).check(protocol.messages())
    if protocol.asynchronous:
        check_asynchronous(cfg, protocol.concurrency, seen)  # type: ignore[attr-defined]
    if cfg.privacy.mode != "off":
        check_privacy(cfg.privacy, seen, cfg.clients_per_round)
    return ctx


def check_asynchronous(cfg: RunConfig, concurrency: int, seen: int) -> None:
    """What an asynchronous protocol (FedBuff) cannot run with: its events are ordered by the simulated clock,
    which must be reproducible, and the synchronous round's notions (a cohort, a deadline) do not apply."""
    name = cfg.algorithm
    if cfg.network.compute != "model":
        raise ConfigError(f"{name}: the order in which clients arrive comes from the simulated clock, which must "
                          "not depend on this machine's load; set network.compute: model")
    if concurrency > seen:
        raise ConfigError(f"{name}.concurrency: {concurrency} clients training at once exceeds the {seen} seen "
                          "clients of the data")
    refused = {
        "faults.deadline_s": cfg.faults.deadline_s is not None,
        "faults.over_selection": bool(cfg.faults.over_selection),
        "privacy": cfg.privacy.mode != "off",
        "secure_aggregation": cfg.secure_aggregation != "none",
        "network.server_up_mbps": cfg.network.server_up_mbps is not None,
        "network.server_down_mbps": cfg.network.server_down_mbps is not None,
        "network.multicast": cfg.network.multicast,
        "placement: dynamic": cfg.placement == "dynamic",
    }
    for key, given in refused.items():
        if given:
            raise ConfigError(f"{key}: not available with the asynchronous {name}, whose clients arrive one at a "
                              "time on their own links (no round cohort, deadline or shared server link)")


def client_state(cfg: RunConfig) -> ClientState:
    """A worker's client-state store, spilling beyond ``state_memory_gb`` to ``state_spill_dir``."""
    if cfg.state_memory_gb is None:
        return ClientState()
    try:
        return ClientState(cfg.state_memory_gb * 2**30, cfg.state_spill_dir)
    except OSError as exc:
        raise ConfigError(f"state_spill_dir: cannot make a spill folder in {cfg.state_spill_dir} ({exc.strerror})"
                          ) from None


def availability(cfg: RunConfig, layout: FederatedLayout) -> Availability:
    """Who is online when, on the simulated clock (``network.availability``)."""
    return Availability(cfg.network.availability, layout.num_clients, cfg.seed)


def wire_format(cfg: RunConfig) -> WireFormat:
    """How this run's messages travel: codecs, differential privacy, secure aggregation."""
    return WireFormat(cfg.compression, cfg.privacy, cfg.secure_aggregation, cfg.secagg, cfg.seed)


class Engine:
    def __init__(self, cfg: RunConfig, comm, output: str | Path, resume: bool = False,  # noqa: ANN001 - a Comm
                 profile: bool = False):
        self.cfg = cfg
        self.profile = profile
        self.profile_rows: list[np.ndarray] = []  # per round: round, wall seconds, then TIME_PARTS
        self.comm = comm
        self.output = Path(output)
        self.resume = resume
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.clock = RankClock()
        self.start_round = 1

    # ----------------------------------------------------------------- set-up
    def setup(self) -> None:
        """Everything that can fail on bad input happens here, before the first collective of training."""
        setup_start = time.perf_counter()
        cfg = self.cfg
        # the same on every rank, whatever the rank count: a client's arithmetic must not depend on where it runs
        torch.set_num_threads(cfg.threads_per_rank)
        # first: a collective (unless both are cpu), then may raise
        devices = rank_devices(cfg.device, cfg.server.device, self.comm, cfg.allow_tf32, cfg.data_memory_gb * 2**30)
        device = devices.clients
        if self.rank == 0:
            check_writable(self.output)  # now, not at the first evaluation after training up to it
        dataset = build_federated_dataset(cfg.data, cfg.seed)
        self.layout = layout = dataset.layout
        ctx = dataclasses.replace(check_run(cfg, layout), device=device, server_device=devices.server)
        self.seen = np.flatnonzero(~layout.unseen)
        self.placement = Placement.balanced(layout.train_sizes, self.size)
        self.transport = Transport(self.comm, self.placement)
        entry = get_algorithm(cfg.algorithm)
        wanted = cfg.placement == "dynamic" or cfg.placement == "auto" and dataset.cheap_clients
        self.dynamic = self.size > 2 and wanted and not entry.server.protocol_type.asynchronous
        self.server: ServerAlgorithm | None = entry.server(ctx) if self.rank == 0 else None
        self.client: ClientAlgorithm | None = None
        self.store = store = None
        if self.size == 1 or self.rank > 0:
            self.store = store = ClientStore(dataset, self.placement.clients_of(self.rank), device,
                                             cfg.data_memory_gb * 2**30)
            self.client = entry.client(ctx, store, client_state(cfg))
        state = self.client.state if self.client is not None else None
        self.protocol = self.server.protocol if self.server is not None else require(self.client, "a side").protocol
        self.network = NetworkModel.from_config(cfg.network, layout.num_clients, cfg.seed)
        self.faults = FaultModel(cfg.faults, self.network, cfg.seed)
        self.availability = availability(cfg, layout)
        self.sim_clock = 0.0  # rank 0: simulated seconds at the end of the last round; every rank: at its start
        self.clock_msg = Message("sim_clock", "down", 1, "float64", broadcast=True, logical=False)
        self.samples_per_round = self.protocol.samples_per_round()
        self.wire = wire_format(cfg)
        self.transport.logical_nbytes = self.wire.nominal_nbytes
        self.walker = PlanWalker(self.transport, self.server, self.client, store, self.faults, self.clock, self.wire)
        self.accountant = None
        if cfg.privacy.mode != "off" and self.server is not None:
            self.accountant = PrivacyAccountant(cfg.privacy, len(self.seen), cfg.clients_per_round, layout.num_clients)
        self.visits = Visits(self.transport, self.placement, store, state, self.clock)
        self.checkpointer = Checkpointer(self.transport, self.clock, self.output)
        self.telemetry_msg = Message("telemetry", "up", len(TELEMETRY_FIELDS), "float64", logical=False)
        # every model kind on the test split, and on the validation split where the data has one (model selection)
        self.eval_splits = ("test", "val") if cfg.data.val_fraction > 0 or layout.has_val else ("test",)
        fields = len(self.protocol.eval_kinds) * len(self.eval_splits) * len(EVAL_FIELDS)
        self.eval_msg = Message("eval_metrics", "up", fields, "float64", logical=False)
        self.recorder = Recorder(cfg, layout, self.protocol.eval_kinds, self.eval_splits, self.output, self.size)
        self.recorder.owner = self.placement.owner
        self.asynchronous = AsynchronousRounds(self) if self.protocol.asynchronous else None
        if self.resume:
            self._restore()
        self.clock.setup = time.perf_counter() - setup_start

    def _restore(self) -> None:
        """Continue from the checkpoint in the results file: server state on rank 0, the states of the
        clients this rank hosts (wherever they lived before), rank 0's tables and ledger up to that round."""
        state = self.client.state if self.client is not None else None
        round_, saved = self.checkpointer.restore(self.output, self.cfg, self.server, state,
                                                  self.placement.clients_of(self.rank))
        self.start_round = round_ + 1
        if self.server is None:  # the tables and the ledger are the server's alone
            return
        self.recorder.restore(saved, round_)
        rounds = saved.table("rounds")
        for seconds in rounds["sim_time_s"][rounds["round"] <= round_]:  # the clock as the run summed it
            self.sim_clock += float(seconds)
        attrs = saved.table_attrs["ledger_totals"]  # per-round totals: the per-client rows stay in the file
        self.transport.ledger.load(saved.table("ledger_totals"), attrs["message_names"], attrs["directions"],
                                   self.output, round_)
        if self.accountant is not None:  # ε so far: every round again, with the clients that uploaded in it
            train_uploads = self.transport.ledger.participants(STAGES.index("train"), "up")
            for past in range(1, round_ + 1):
                self.accountant.step(train_uploads.get(past, np.zeros(0, np.int64)))

    def _fault_injection(self, round_: int) -> None:
        """Resilience drills: ``MPIFL_INJECT_FAULT=RANK:ROUND`` makes that rank raise at that round."""
        spec = os.environ.get("MPIFL_INJECT_FAULT")
        if spec and spec == f"{self.rank}:{round_}":
            raise RuntimeError(f"fault injected by MPIFL_INJECT_FAULT={spec}")

    # ----------------------------------------------------------------- rounds
    def run(self, progress: bool = True) -> None:
        if self.start_round == 1:
            self.run_setup()
        wall, cpu, self.parts_at_start = time.perf_counter(), time.process_time(), self._time_parts()
        every = self.cfg.checkpoint_every
        for round_ in range(self.start_round, self.cfg.rounds + 1):
            if self.profile:
                round_start, parts_before = time.perf_counter(), self._time_parts()
            self._fault_injection(round_)
            (self.asynchronous.train_round if self.asynchronous else self.train_round)(round_)
            evaluation = round_ % self.cfg.eval_every == 0 or round_ == self.cfg.rounds
            checkpoint = bool(every) and round_ % every == 0
            if evaluation:
                self.evaluate(round_)
            if checkpoint:
                self.checkpointer.take(round_, self.server, self.client.state if self.client else None)
            if self.server is not None and (evaluation or checkpoint):
                if evaluation and progress:
                    print(self.recorder.progress_line(round_), flush=True)
                self._write("running")
            if self.profile:
                spent = self._time_parts() - parts_before
                self.profile_rows.append(np.concatenate(([round_, time.perf_counter() - round_start], spent)))
        self.clock.loop_wall = time.perf_counter() - wall
        self.clock.loop_cpu = time.process_time() - cpu
        self._finish()
        if self.client is not None:
            self.client.state.close()

    def _time_parts(self) -> np.ndarray:
        """This rank's cumulative seconds in each of :data:`TIME_PARTS`."""
        c, t = self.clock, self.transport
        return np.array([c.compute, c.data, c.server, c.evaluation, t.physical.total_seconds,
                         c.serialization + t.pack_seconds, c.io])

    def run_setup(self) -> None:
        """The protocol's one-time set-up plan, as round 0 with every seen client (ledger stage "setup")."""
        plan = self.protocol.setup_plan()
        if plan:
            everyone = np.arange(self.layout.num_clients) if self.protocol.setup_includes_unseen else self.seen
            self.walker.walk(0, "setup", plan, everyone)
            self._end_round()

    def train_round(self, round_: int) -> None:
        start = time.perf_counter()
        server_before = self.clock.server
        plan = self.protocol.train_plan(round_)
        logical = [m for m in plan if isinstance(m, Message) and m.logical]
        down_bytes = sum(self.wire.nominal_nbytes(m) for m in logical if m.direction == "down")
        up_bytes = sum(self.wire.nominal_nbytes(m) for m in logical if m.direction == "up")
        wanted = self.cfg.clients_per_round
        online, sampled_at = self._online(round_)
        if self.cfg.privacy.sampling == "poisson":  # each seen client independently, as the accountant assumes
            sampled = poisson_cohort(self.cfg.seed, round_, self.seen, wanted / len(self.seen))
        else:
            count = min(self.faults.selection_size(wanted), len(online))
            sampled = sample_clients(self.cfg.seed, round_, online, count)
        messages = (sum(m.direction == "down" for m in logical), sum(m.direction == "up" for m in logical))
        broadcast = sum(self.wire.nominal_nbytes(m) for m in logical if m.direction == "down" and m.broadcast)
        clients = self.faults.participants(round_, sampled, wanted, down_bytes, up_bytes, messages,
                                           self.samples_per_round, broadcast)
        participants = clients
        self.walker.rejected = 0
        placement = self.placement
        if self.dynamic:
            placement = placement.for_round(clients, self.samples_per_round[clients])
        with self.transport.placed(placement):
            self.visits.arrive(round_, placement, clients)
            walk = self._walk_training(round_, plan, online, sampled, clients)
            self._end_round()
            self.visits.depart(round_, placement)
            rows = np.empty((len(walk.local), len(TELEMETRY_FIELDS)))
            rows[:, 0] = walk.seconds
            rows[:, 1] = [self.client.take_train_loss(int(c)) for c in walk.local] if self.client else []
            telemetry = self.transport.up(round_, "train", self.telemetry_msg, rows, walk.clients)
        if self.server is None or telemetry is None:
            return
        clients = walk.clients
        server_s = self.clock.server - server_before
        ledger = self.transport.ledger
        if self.wire.masks:
            self._record_secure_aggregation(round_, plan, participants, clients)
        moved = ledger.client_round_bytes(round_, clients)  # encoded sizes: each client's own
        compute_s = self.network.compute_seconds(clients, self.samples_per_round[clients], telemetry[:, 0])
        clients_s = self.network.cohort_seconds(clients, moved, compute_s, broadcast, self.protocol.turns)
        totals = ledger.round_totals(round_)
        # a modeled round leaves out the server's measured compute too: nothing in it depends on the machine
        sim_time_s = (sampled_at - self.sim_clock) + (0.0 if self.network.modeled_compute else server_s) + clients_s
        self.sim_clock = self.sim_clock + sim_time_s
        self.recorder.record_round({
            "round": round_,
            "sim_time_s": sim_time_s,
            "wall_time_s": time.perf_counter() - start,
            "server_time_s": server_s,
            "client_compute_time_s": float(telemetry[:, 0].sum()),  # ÷ workers: the round's ideal time
            "train_loss": float(np.nanmean(telemetry[:, 1])) if np.isfinite(telemetry[:, 1]).any() else np.nan,
            "logical_up_bytes": totals["up"],
            "logical_down_bytes": totals["down"],
            "participants": len(clients),
            "load_imbalance": self._load_imbalance(placement, clients),
            "rejected_updates": self.walker.rejected,
            **({"epsilon": self.accountant.step(clients)} if self.accountant is not None else {}),
            **({} if self.availability.always else {"sim_clock_s": sampled_at, "available_clients": len(online)}),
        }, self.server.round_metrics())

    def _online(self, round_: int) -> tuple[np.ndarray, float]:
        """The seen clients online at the round's simulated start, and that start: the clock (the same on every
        rank, sent by the server), moved on to the next time a client comes online while nobody is."""
        if self.availability.always:
            return self.seen, self.sim_clock
        payload = np.array([self.sim_clock]) if self.server is not None else None
        t = self.sim_clock = float(self.transport.broadcast(round_, self.clock_msg, payload)[0])
        online = self.seen[self.availability.available(t)[self.seen]]
        while not len(online):  # the server waits (a float's last bit may need a step past a trace's start)
            t = max(self.availability.next_online(t), float(np.nextafter(t, np.inf)))
            online = self.seen[self.availability.available(t)[self.seen]]
        return online, t

    def _record_secure_aggregation(self, round_: int, plan: Sequence[Step], participants: np.ndarray,
                                   survivors: np.ndarray) -> None:
        """The secure-aggregation protocol's own messages of this round in the ledger: key advertisement and
        shares for every participant, the unmasking for those whose masked input arrived. The masked inputs
        themselves are the update messages, already counted at their masked size."""
        numel = sum(m.numel for m in plan if isinstance(m, Message) and m.update)
        for sent in self.wire.secagg_round(len(participants), len(survivors), numel):
            who = survivors if sent.name in UNMASKING_ROUND else participants
            self.transport.ledger.record(round_, "train", Message(sent.name, sent.direction, sent.nbytes, "uint8"),
                                         who)

    def _walk_training(self, round_: int, plan: Sequence[Step], online: np.ndarray, sampled: np.ndarray,
                       clients: np.ndarray) -> Walk:
        """The round's training plan among its participants: all together, or one after another (``turns``)."""
        if self.protocol.turns:  # each client sees the server state the previous one left
            walks = [self.walker.walk(round_, "train", plan, clients[i : i + 1]) for i in range(len(clients))]
            if not walks:
                return Walk(clients, np.zeros(0), clients)
            return Walk(*(np.concatenate([getattr(w, f) for w in walks]) for f in ("local", "seconds", "clients")))
        everyone = any(step.everyone for step in plan)  # every seen client that is online and up this round
        audience = np.setdiff1d(online, np.setdiff1d(sampled, clients)) if everyone else None
        return self.walker.walk(round_, "train", plan, clients, audience)

    def _end_round(self) -> None:
        if self.client is not None:
            self.client.end_round()
        self._release_data()

    def _release_data(self) -> None:
        """Between uses of client data: keep only what fits ``data_memory_gb``."""
        if self.store is not None:
            self.store.release()

    def _load_imbalance(self, placement: Placement, clients: np.ndarray) -> float:
        """The busiest worker's planned samples over the mean worker's (1 = perfectly balanced round)."""
        work = np.bincount(placement.owner[clients], self.samples_per_round[clients], minlength=self.size)
        work = work[1:] if self.size > 1 else work
        return float(work.max() / work.mean()) if work.sum() else 1.0

    # ------------------------------------------------------------- evaluation
    def evaluate(self, round_: int) -> None:
        """Evaluate every client, ``eval_chunk`` clients at a time (0: all at once), so the server's
        per-client evaluation state (e.g. one personal model per client) stays bounded."""
        self._walk_chunks(round_, "newcomer", self.protocol.newcomer_plan(), np.flatnonzero(self.layout.unseen))
        self._walk_chunks(round_, "eval_prelude", self.protocol.eval_prelude(), self.seen)
        blocks = [self._evaluate_clients(round_, chunk) for chunk in self._chunks(np.arange(self.layout.num_clients))]
        self._end_round()
        if self.server is None:
            return
        rows = np.concatenate([require(block, "the gathered evaluation") for block in blocks])
        self.recorder.record_evaluation(round_, rows, self.transport.ledger.train_bytes,
                                        self.server.eval_metrics())
        self.server.end_evaluation()

    def _walk_chunks(self, round_: int, stage: Stage, plan: Sequence[Step], clients: np.ndarray) -> None:
        for chunk in self._chunks(clients) if plan else ():
            self.walker.walk(round_, stage, plan, chunk)
            self._release_data()

    def _chunks(self, clients: np.ndarray) -> list[np.ndarray]:
        size = self.cfg.eval_chunk or max(len(clients), 1)
        return [clients[i : i + size] for i in range(0, len(clients), size)]

    def _evaluate_clients(self, round_: int, clients: np.ndarray) -> np.ndarray | None:
        """Walk the eval plan among ``clients``, evaluate the local ones, gather their metric rows."""
        local = self.walker.walk(round_, "eval", self.protocol.eval_plan(), clients).local  # nobody drops out
        start = time.perf_counter()
        rows = np.zeros((len(local), self.eval_msg.numel))
        if self.client is not None:
            step = StepContext(round_, "eval", clients)
            for i, client in enumerate(local):
                rows[i] = self.client.evaluate(step, int(client), self.eval_splits)
        self.clock.evaluation += time.perf_counter() - start
        self._release_data()
        return self.transport.up(round_, "eval", self.eval_msg, rows, clients)

    # ---------------------------------------------------------------- results
    def _write(self, status: str, final: dict[str, dict[str, np.ndarray]] | None = None, wait: bool = False) -> None:
        start = time.perf_counter()
        self.recorder.write(status, self.transport.ledger, self.transport.physical, self.checkpointer.latest,
                            final, wait)
        self.clock.io += time.perf_counter() - start

    def settle(self) -> None:
        """After a failure on this rank: let the results write in flight finish (best effort), so the
        file keeps every completed evaluation."""
        if self.server is not None:
            self.recorder.settle()

    def _finish(self) -> None:
        """Collect every rank's time breakdown and MPI totals, and with ``--profile`` its per-round rows
        (once, at the end: small pickled objects are fine)."""
        c = self.clock
        visits = self.visits.traffic()
        mine = {"rank": self.rank, "clients": len(self.placement.clients_of(self.rank)),
                **(self.client.rank_stats() if self.client is not None else {}),
                **({"client_data_loads": self.store.loads} if self.store is not None else {}),
                **({"states_spilled": self.client.state.spills, "states_reloaded": self.client.state.reloads}
                   if self.client is not None else {}),
                "mpi_bytes": self.transport.physical.total_bytes,
                "visitor_states_moved": self.visits.moved_states,
                "visitor_state_bytes": visits[0], "visitor_state_wait": visits[1],  # (wait: seconds, part of mpi)
                **{f"{part}_seconds": t for part, t in zip(TIME_PARTS, self._time_parts() - self.parts_at_start)},
                "loop_wall_seconds": c.loop_wall, "loop_cpu_seconds": c.loop_cpu, "setup_wall_seconds": c.setup,
                "peak_rss_bytes": peak_rss_bytes()}
        rows = np.array(self.profile_rows).reshape(-1, 2 + len(TIME_PARTS))
        rows = np.hstack((rows, np.full((len(rows), 1), self.rank)))
        per_rank = self.comm.gather((mine, rows), root=0) if self.size > 1 else [(mine, rows)]
        if self.server is None:
            return
        counters = dict.fromkeys(name for r in per_rank for name in r[0])  # the server has no client counters
        final = {"ranks": {name: np.array([r[0].get(name, 0) for r in per_rank]) for name in counters},
                 "model": self.server.final_state()}
        if self.profile:
            rows = np.concatenate([r[1] for r in per_rank])
            columns = ("round", "wall_seconds", *(f"{part}_seconds" for part in TIME_PARTS), "rank")
            profile = {name: rows[:, j] for j, name in enumerate(columns)}
            for name in ("round", "rank"):
                profile[name] = profile[name].astype(np.int64)
            final["profile"] = profile
        self._write("completed", final, wait=True)
