"""What a run's parts are built from, and every check that needs the data layout (``mpifl validate`` runs the
same checks): before the first collective of training, so bad input fails with one line on every rank."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mpifl.algorithms.base import (
    AsynchronousProtocol,
    ClientAlgorithm,
    EvalLayout,
    Protocol,
    RunContext,
    ServerAlgorithm,
    check_handlers,
)
from mpifl.algorithms.state import ClientState
from mpifl.comm import Placement
from mpifl.comm.availability import Availability
from mpifl.comm.network import NetworkModel
from mpifl.comm.privacy import PrivacyAccountant, check_privacy
from mpifl.comm.wire import WireFormat
from mpifl.config import RunConfig
from mpifl.data import FederatedDataset, FederatedLayout
from mpifl.registry import get_algorithm
from mpifl.runtime.asynchronous import AsynchronousRounds
from mpifl.runtime.checkpointer import Checkpointer
from mpifl.runtime.cohort import CohortSelection
from mpifl.runtime.evaluation import Evaluation
from mpifl.runtime.faults import FaultModel, selection_size
from mpifl.runtime.rank import RankContext
from mpifl.runtime.recorder import Recorder
from mpifl.runtime.roundlog import RoundLog
from mpifl.runtime.simtime import SimulatedTime
from mpifl.runtime.store import ClientStore
from mpifl.runtime.synchronous import SynchronousRounds
from mpifl.runtime.visits import Visits
from mpifl.runtime.walker import PlanWalker
from mpifl.schema import ConfigError


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
    ctx = RunContext(cfg, layout)
    availability(cfg, layout)  # a trace file is read and checked here
    NetworkModel.from_config(cfg.network, layout.num_clients, cfg.seed)  # and a speed file
    protocol = get_algorithm(cfg.algorithm).server.protocol_type(ctx)
    protocol.samples_per_round()  # local work whose count a 64-bit integer cannot hold is refused here
    wire_format(cfg).check(protocol.messages())
    if isinstance(protocol, AsynchronousProtocol):
        check_asynchronous(cfg, protocol.concurrency, seen)
    if cfg.privacy.mode != "off":
        check_privacy(cfg.privacy, seen, cfg.clients_per_round)
    return ctx


def check_asynchronous(cfg: RunConfig, concurrency: int, seen: int) -> None:
    """What an asynchronous protocol (FedBuff, FedAsync) cannot run with: its events are ordered by the simulated
    clock, which must be reproducible, and the synchronous round's notions (a cohort, a deadline) do not apply."""
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
    """A worker's client-state store, spilling beyond ``state_memory_gb`` to ``state_spill_dir``, keeping tensors on
    a GPU within ``state_device_gb``."""
    device = None if cfg.state_device_gb is None else cfg.state_device_gb * 2**30
    if cfg.state_memory_gb is None:
        return ClientState(device_budget_bytes=device)
    try:
        return ClientState(cfg.state_memory_gb * 2**30, cfg.state_spill_dir, device)
    except OSError as exc:
        raise ConfigError(f"state_spill_dir: cannot make a spill folder in {cfg.state_spill_dir} ({exc.strerror})"
                          ) from None


def availability(cfg: RunConfig, layout: FederatedLayout) -> Availability:
    """Who is online when, on the simulated clock (``network.availability``)."""
    return Availability(cfg.network.availability, layout.num_clients, cfg.seed)


def wire_format(cfg: RunConfig) -> WireFormat:
    """How this run's messages travel: codecs, differential privacy, secure aggregation."""
    return WireFormat(cfg.compression, cfg.privacy, cfg.secure_aggregation, cfg.secagg, cfg.seed)


def algorithm_sides(cfg: RunConfig, ctx: RunContext, dataset: FederatedDataset, placement: Placement, rank: int,
                    size: int) -> tuple[ServerAlgorithm | None, ClientAlgorithm | None, ClientStore | None]:
    """This rank's sides of the algorithm, their handlers checked against each other: the server on rank 0, and
    the clients placed on it with their data (the store) on a worker, or on rank 0 when it is alone."""
    entry = get_algorithm(cfg.algorithm)
    server = entry.server(ctx) if rank == 0 else None
    client, store = None, None
    if size == 1 or rank > 0:
        store = ClientStore(dataset, placement.clients_of(rank), ctx.device, cfg.data_memory_gb * 2**30,
                            up_front=True)
        client = entry.client(ctx, store, client_state(cfg))
    check_handlers(server, client)
    return server, client, store


def assemble(cfg: RunConfig, ctx: RunContext, rank: RankContext, protocol: Protocol, placement: Placement,
             output: Path, cheap_clients: bool
             ) -> tuple[PlanWalker, Visits, Checkpointer, Recorder, Evaluation, SynchronousRounds | AsynchronousRounds]:
    """The parts that move, time, record and save one rank's rounds: its walker, placement of visiting clients,
    checkpoints, results record, evaluation and the rounds themselves (synchronous or asynchronous)."""
    layout, size = ctx.layout, rank.transport.size
    seen = np.flatnonzero(~layout.unseen)
    samples = protocol.samples_per_round()
    faults = FaultModel(cfg.faults, cfg.seed)
    simtime = SimulatedTime(NetworkModel.from_config(cfg.network, layout.num_clients, cfg.seed), rank.wire,
                            samples, protocol.turns)
    cohorts = CohortSelection(cfg, seen, availability(cfg, layout), faults, simtime, rank.transport)
    walker = PlanWalker(rank, faults, ctx.sum_weights)
    asynchronous = isinstance(protocol, AsynchronousProtocol)
    dynamic = cfg.placement == "dynamic" or cfg.placement == "auto" and cheap_clients
    visits = Visits(rank, placement, dynamic and size > 2 and not asynchronous, samples)
    checkpointer = Checkpointer(rank.transport, rank.times, output, cfg.checkpoint_keep)
    # every model kind on the test split, and on the validation split where the data has one (model selection)
    splits = ("test", "val") if cfg.data.val_fraction > 0 or layout.has_val else ("test",)
    eval_layout = EvalLayout(protocol.eval_kinds, splits)
    recorder = Recorder(cfg, layout, eval_layout, output, size, placement.owner)
    log = RoundLog(rank, recorder, samples)
    evaluation = Evaluation(rank, layout, eval_layout, cfg.eval_chunk, protocol, walker, recorder)
    rounds: SynchronousRounds | AsynchronousRounds
    if isinstance(protocol, AsynchronousProtocol):
        rounds = AsynchronousRounds(rank, protocol, walker, cohorts, faults, simtime, log)
    else:
        accountant = None
        if cfg.privacy.mode != "off" and rank.server is not None:
            accountant = PrivacyAccountant(cfg.privacy, len(seen), cfg.clients_per_round, layout.num_clients)
        rounds = SynchronousRounds(rank, protocol, walker, cohorts, visits, simtime, log, accountant)
    return walker, visits, checkpointer, recorder, evaluation, rounds
