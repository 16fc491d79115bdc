"""Asynchronous rounds (FedBuff, FedAsync): clients dispatched and arriving one event at a time on the simulated
clock.

One engine round is one server step. The server decides every event (:class:`~mpifl.algorithms.base.
EventDrivenServer`: it alone knows who is in flight and when each arrives), so the workers need no copy of that
state: before each event it broadcasts the clients it dispatches now, or that the step is complete. Each dispatch
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

import numpy as np

from mpifl.algorithms.base import AsynchronousProtocol, EventDrivenServer
from mpifl.comm import Message
from mpifl.results import Results
from mpifl.runtime.cohort import CohortSelection
from mpifl.runtime.faults import FaultModel
from mpifl.runtime.rank import RankContext
from mpifl.runtime.roundlog import TELEMETRY_FIELDS, RoundLog
from mpifl.runtime.simtime import SimulatedTime
from mpifl.runtime.walker import PlanWalker
from mpifl.schema import ConfigError

DISPATCH_TAG = 0x64697370


class AsynchronousRounds:
    def __init__(self, rank: RankContext, protocol: AsynchronousProtocol, walker: PlanWalker, cohorts: CohortSelection,
                 faults: FaultModel, simtime: SimulatedTime, log: RoundLog):
        server = rank.server
        if server is not None and not isinstance(server, EventDrivenServer):
            raise ConfigError(f"algorithm {server.ctx.cfg.algorithm}: an asynchronous protocol needs an "
                              "EventDrivenServer")
        self.rank, self.protocol, self.server, self.walker, self.cohorts = rank, protocol, server, walker, cohorts
        self.faults, self.simtime, self.log, self.times = faults, simtime, log, rank.times
        # [step complete?, the dispatched clients, -1 padding]: the server's decision, on every rank
        self.decision_msg = Message("dispatch", "down", protocol.concurrency + 1, "int64", broadcast=True,
                                    logical=False)

    def train_round(self, round_: int) -> None:
        """Events until the server's next step: dispatches walked, arrivals buffered; rank 0 records the step."""
        server = self.server
        start, server_before = time.perf_counter(), self.times.server
        clock_before = server.now_s if server is not None else 0.0
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
        if server is None:
            return
        self.log.record(round_, start, self.times.server - server_before, server.now_s - clock_before,
                        np.concatenate(telemetry) if telemetry else np.zeros((0, len(TELEMETRY_FIELDS))),
                        np.concatenate(dispatched) if dispatched else np.zeros(0, np.int64),
                        self.rank.transport.placement, rejected, sim_clock_s=server.now_s)

    def resume(self, saved: Results, round_: int) -> None:
        """Nothing to do: the clock and the events in flight are the server's state, restored with its checkpoint."""

    def _next_dispatch(self, round_: int) -> np.ndarray | None:
        """The clients the server dispatches at its next event (maybe none: all of them dropped out), or ``None``
        once the step is complete; every rank learns it from rank 0's broadcast."""
        started = time.perf_counter()
        payload = self._decide(round_, self.server) if self.server is not None else None
        self.times.server += time.perf_counter() - started if self.server is not None else 0.0
        decision = self.walker.transport.broadcast(round_, self.decision_msg, payload)
        return None if decision[0] else decision[1:][decision[1:] >= 0]

    def _decide(self, round_: int, server: EventDrivenServer) -> np.ndarray:
        """Rank 0: the next event's outcome, to broadcast: the step is complete (``[1, ...]``), or the clients that
        train now (``[0, clients..., -1...]``). Arrivals due by the current time are all taken before any free
        slot is refilled, so clients arriving together all see the step they complete."""
        decision = np.full(self.decision_msg.numel, -1, dtype=np.int64)
        decision[0] = 1
        while True:
            arrival = server.next_arrival()
            if arrival is not None and arrival[1] <= server.now_s:
                if server.arrive():
                    return decision
                continue
            training = self._dispatch(round_, server)
            if training is not None:
                decision[0] = 0
                decision[1 : 1 + len(training)] = training
                return decision
            if arrival is not None:  # nobody to dispatch now: on to the next arrival
                if server.arrive():
                    return decision
                continue
            # nobody in flight and nobody idle online: wait until someone comes online
            server.now_s = self.cohorts.next_online(server.now_s)

    def _dispatch(self, round_: int, server: EventDrivenServer) -> np.ndarray | None:
        """Fill the free slots now from the idle clients online (None: no slot or nobody to fill it); returns
        the dispatched clients that train (one that drops out, ``faults.dropout``, is in flight but its upload
        never arrives)."""
        online = self.cohorts.online(server.now_s, np.setdiff1d(self.cohorts.seen, server.in_flight()))
        count = min(server.free_slots, len(online))
        if count == 0:
            return None
        rng = np.random.default_rng(np.random.SeedSequence([self.cohorts.cfg.seed, DISPATCH_TAG, server.dispatches]))
        clients = np.sort(rng.choice(online, size=count, replace=False))
        traffic = self.simtime.traffic(self.protocol.train_plan(round_), clients)
        server.dispatch(clients, server.now_s + self.simtime.alone(clients, traffic))
        return self.faults.survivors_of_dropout(round_, clients)
