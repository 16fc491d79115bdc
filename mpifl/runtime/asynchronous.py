"""Asynchronous rounds (FedBuff, FedAsync): clients dispatched and arriving one event at a time on the simulated
clock.

One engine round is one server step. Rank 0 decides every event (:class:`Events`: who is in flight and when each
arrives, checkpointed with the run; :class:`~mpifl.algorithms.base.EventDrivenServer`: what an arrival does), so
the workers need no copy of that state: before each event rank 0 broadcasts the clients it dispatches now, or that
the step is complete. Each dispatch
is a walk of the protocol's training plan among those clients (download the current model, train, upload); the
server holds each upload until its client's simulated arrival.

A client's arrival is its dispatch time plus its time alone on the network model (:meth:`.SimulatedTime.alone`:
the plan's messages over its own link and ``seconds_per_sample`` × its planned samples of compute, since
``network.compute: model`` is required, so the order of events never depends on this machine's load). Which idle
client a freed slot gets is drawn from (seed, dispatch event); with ``network.availability`` only among the
clients online at that time. The ledger counts a client's messages in the round of its dispatch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from mpifl.algorithms.base import AsynchronousProtocol, EventDrivenServer
from mpifl.comm import Message
from mpifl.comm.messages import require
from mpifl.results import Results
from mpifl.runtime.cohort import CohortSelection
from mpifl.runtime.faults import FaultModel
from mpifl.runtime.rank import RankContext
from mpifl.runtime.roundlog import TELEMETRY_FIELDS, RoundLog
from mpifl.runtime.simtime import SimulatedTime
from mpifl.runtime.walker import PlanWalker
from mpifl.schema import ConfigError

DISPATCH_TAG = 0x64697370


@dataclass
class Events:
    """Rank 0's event state: the simulated clock (the last event's time), the dispatch events so far (what keys the
    choice of clients), the free slots, and who is in flight with their simulated arrival times."""

    free_slots: int
    now_s: float = 0.0
    dispatches: int = 0
    arrival_s: dict[int, float] = field(default_factory=dict)  # in flight: client -> simulated arrival time

    def in_flight(self) -> np.ndarray:
        return np.array(sorted(self.arrival_s), dtype=np.int64)

    def dispatch(self, clients: np.ndarray, arrival_s: np.ndarray) -> None:
        """``clients`` leave now and will be back at ``arrival_s``."""
        for client, t in zip(clients.tolist(), arrival_s.tolist()):
            self.arrival_s[client] = t
        self.free_slots -= len(clients)
        self.dispatches += 1

    def next_arrival(self) -> tuple[int, float] | None:
        """The in-flight client that arrives first (ties: the lower id) and when; ``None`` if nobody is in flight."""
        if not self.arrival_s:
            return None
        client = min(self.arrival_s, key=lambda c: (self.arrival_s[c], c))
        return client, self.arrival_s[client]

    def arrive(self) -> int:
        """Advance the clock to the next arrival; returns who arrived."""
        client, self.now_s = require(self.next_arrival(), "a client in flight")
        del self.arrival_s[client]
        self.free_slots += 1
        return client


class AsynchronousRounds:
    def __init__(self, rank: RankContext, protocol: AsynchronousProtocol, walker: PlanWalker, cohorts: CohortSelection,
                 faults: FaultModel, simtime: SimulatedTime, log: RoundLog):
        server = rank.server
        if server is not None and not isinstance(server, EventDrivenServer):
            raise ConfigError(f"algorithm {server.ctx.cfg.algorithm}: an asynchronous protocol needs an "
                              "EventDrivenServer")
        self.rank, self.protocol, self.server, self.walker, self.cohorts = rank, protocol, server, walker, cohorts
        self.faults, self.simtime, self.log, self.times = faults, simtime, log, rank.times
        self.checkpointed = Events(protocol.concurrency) if server is not None else None  # rank 0's events
        # [step complete?, the dispatched clients, -1 padding]: the server's decision, on every rank
        self.decision_msg = Message("dispatch", "down", protocol.concurrency + 1, "int64", broadcast=True,
                                    logical=False)

    def train_round(self, round_: int) -> None:
        """Events until the server's next step: dispatches walked, arrivals buffered; rank 0 records the step."""
        events = self.checkpointed
        start, server_before = time.perf_counter(), self.times.server
        clock_before = events.now_s if events is not None else 0.0
        plan = self.protocol.train_plan(round_)
        dispatched, telemetry, rejected = [], [], 0
        while (clients := self._next_dispatch(round_)) is not None:
            if len(clients):
                dispatched.append(clients)
                walk = self.walker.walk(round_, "train", plan, clients)
                rejected += walk.rejected
                self.rank.end_round()
                gathered = self.log.telemetry(round_, walk)
                telemetry.append(gathered if gathered is not None else np.zeros((0, len(TELEMETRY_FIELDS))))
        if events is None:
            return
        self.log.record(round_, start, self.times.server - server_before, events.now_s - clock_before,
                        np.concatenate(telemetry) if telemetry else np.zeros((0, len(TELEMETRY_FIELDS))),
                        np.concatenate(dispatched) if dispatched else np.zeros(0, np.int64),
                        self.rank.transport.placement, rejected, sim_clock_s=events.now_s)

    def resume(self, saved: Results, round_: int) -> None:
        """Nothing more: the events (:attr:`checkpointed`) and the server come back with the checkpoint."""

    def _next_dispatch(self, round_: int) -> np.ndarray | None:
        """The clients rank 0 dispatches at its next event (maybe none: all of them dropped out), or ``None``
        once the step is complete; every rank learns it from rank 0's broadcast."""
        started = time.perf_counter()
        server, events = self.server, self.checkpointed
        payload = self._decide(round_, server, events) if server is not None and events is not None else None
        self.times.server += time.perf_counter() - started if server is not None else 0.0
        decision = self.walker.transport.broadcast(round_, self.decision_msg, payload)
        return None if decision[0] else decision[1:][decision[1:] >= 0]

    def _decide(self, round_: int, server: EventDrivenServer, events: Events) -> np.ndarray:
        """Rank 0: the next event's outcome, to broadcast: the step is complete (``[1, ...]``), or the clients that
        train now (``[0, clients..., -1...]``). Arrivals due by the current time are all taken before any free
        slot is refilled, so clients arriving together all see the step they complete."""
        decision = np.full(self.decision_msg.numel, -1, dtype=np.int64)
        decision[0] = 1
        while True:
            arrival = events.next_arrival()
            if arrival is not None and arrival[1] <= events.now_s:
                if server.arrive(events.arrive()):
                    return decision
                continue
            training = self._dispatch(round_, server, events)
            if training is not None:
                decision[0] = 0
                decision[1 : 1 + len(training)] = training
                return decision
            if arrival is not None:  # nobody to dispatch now: on to the next arrival
                if server.arrive(events.arrive()):
                    return decision
                continue
            # nobody in flight and nobody idle online: wait until someone comes online
            events.now_s = self.cohorts.next_online(events.now_s)

    def _dispatch(self, round_: int, server: EventDrivenServer, events: Events) -> np.ndarray | None:
        """Fill the free slots now from the idle clients online (None: no slot or nobody to fill it); returns
        the dispatched clients that train (one that drops out, ``faults.dropout``, is in flight but its upload
        never arrives)."""
        online = self.cohorts.online(events.now_s, np.setdiff1d(self.cohorts.seen, events.in_flight()))
        count = min(events.free_slots, len(online))
        if count == 0:
            return None
        rng = np.random.default_rng(np.random.SeedSequence([self.cohorts.cfg.seed, DISPATCH_TAG, events.dispatches]))
        clients = np.sort(rng.choice(online, size=count, replace=False))
        traffic = self.simtime.traffic(self.protocol.train_plan(round_), clients)
        events.dispatch(clients, events.now_s + self.simtime.alone(clients, traffic))
        server.dispatch(clients)
        return self.faults.survivors_of_dropout(round_, clients)
