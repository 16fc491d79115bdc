"""Synchronous rounds: every participant of a round walks the training plan together (or, ``turns``, one after
another), and the round ends when all of them are done.

A round is five phases, each a part of its own: choose the cohort (:mod:`.cohort`), place it (:mod:`.visits`),
walk the algorithm's plan among it (:mod:`.walker`), account its simulated time (:mod:`.simtime`) and privacy,
record it (:mod:`.roundlog`). :class:`~mpifl.runtime.asynchronous.AsynchronousRounds` has the same shape.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from mpifl.algorithms.base import Protocol
from mpifl.comm import Step
from mpifl.comm.privacy import PrivacyAccountant
from mpifl.results import Results
from mpifl.runtime.cohort import Cohort, CohortSelection
from mpifl.runtime.rank import RankContext
from mpifl.runtime.roundlog import RoundLog
from mpifl.runtime.simtime import SimulatedTime
from mpifl.runtime.visits import Visits
from mpifl.runtime.walker import PlanWalker, Walk


class SynchronousRounds:
    checkpointed = None  # what a checkpoint holds of this part beyond the algorithm's state: nothing

    def __init__(self, rank: RankContext, protocol: Protocol, walker: PlanWalker, cohorts: CohortSelection,
                 visits: Visits, simtime: SimulatedTime, log: RoundLog, accountant: PrivacyAccountant | None):
        self.rank, self.protocol, self.walker, self.cohorts, self.visits = rank, protocol, walker, cohorts, visits
        self.simtime, self.log, self.accountant = simtime, log, accountant

    def train_round(self, round_: int) -> None:
        """One synchronous round, phase by phase; rank 0 records it."""
        times = self.rank.times
        started, server_before = time.perf_counter(), times.server
        plan = self.protocol.train_plan(round_)
        cohort = self.cohorts.choose(round_, plan)
        with self.visits.placed(round_, cohort.participants) as placement:
            walk = self._walk(round_, plan, cohort)
            self.rank.end_round()
            telemetry = self.log.telemetry(round_, walk)
        if self.rank.server is None or telemetry is None:  # a worker: the rest is rank 0's
            return
        clients = walk.clients
        if self.rank.wire.masks:
            self.walker.record_secure_aggregation(round_, plan, cohort.participants, clients)
        server_s = times.server - server_before
        clients_s = self.simtime.round_seconds(clients, self.simtime.traffic(plan, clients, len(cohort.participants)),
                                               telemetry[:, 0])
        sim_time_s = self.simtime.advance(cohort.start_s, server_s, clients_s)
        privacy = {"epsilon": self.accountant.step(clients)} if self.accountant is not None else {}
        online = {} if self.cohorts.availability.always else {"sim_clock_s": cohort.start_s,
                                                              "available_clients": len(cohort.online)}
        self.log.record(round_, started, server_s, sim_time_s, telemetry, clients, placement, walk.rejected,
                        **privacy, **online)

    def resume(self, saved: Results, round_: int) -> None:
        """Rank 0, from a results file up to ``round_``: the simulated clock and the privacy accountant."""
        self.simtime.resume(saved, round_)
        if self.accountant is not None:
            self.accountant.resume(self.rank.ledger, round_)

    def _walk(self, round_: int, plan: Sequence[Step], cohort: Cohort) -> Walk:
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
