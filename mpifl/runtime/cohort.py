"""Choosing a round's cohort: who is online at its simulated start, who is sampled, who survives the faults.

Every decision is a function of (seed, round, client) and the simulated clock, never of this machine, so every
rank agrees and every rerun repeats it. Only the clock lives on rank 0 alone; with ``network.availability`` rank 0
sends it to every rank before the round.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mpifl.comm import Message, Step, Transport
from mpifl.comm.availability import Availability
from mpifl.comm.privacy import poisson_cohort
from mpifl.config import RunConfig
from mpifl.runtime.faults import FaultModel
from mpifl.runtime.sampling import sample_clients
from mpifl.runtime.simtime import SimulatedTime

_CLOCK_MSG = Message("sim_clock", "down", 1, "float64", broadcast=True, logical=False)


@dataclass(frozen=True)
class Cohort:
    """Who takes part in one round, and when it starts."""

    online: np.ndarray  # the seen clients online at the round's start (all of them without availability)
    sampled: np.ndarray  # drawn from them (under Poisson sampling, from every seen client)
    participants: np.ndarray  # the sampled clients that survive drop-out, the deadline and over-selection
    start_s: float  # the round's simulated start: the clock, or later if the server waited for a client


class CohortSelection:
    """Availability, sampling (uniform or Poisson) and faults, in that order."""

    def __init__(self, cfg: RunConfig, seen: np.ndarray, availability: Availability, faults: FaultModel,
                 simtime: SimulatedTime, transport: Transport):
        self.cfg, self.seen, self.availability, self.faults = cfg, seen, availability, faults
        self.simtime, self.transport = simtime, transport

    def choose(self, round_: int, plan: Sequence[Step]) -> Cohort:
        """The cohort of a round of ``plan`` (a collective with availability: the clock's broadcast)."""
        wanted = self.cfg.clients_per_round
        online, start_s = self.online_at_start(round_)
        if self.cfg.privacy.sampling == "poisson":  # each seen client independently, as the accountant assumes
            sampled = poisson_cohort(self.cfg.seed, round_, self.seen, wanted / len(self.seen))
        else:
            sampled = sample_clients(self.cfg.seed, round_, online, min(self.faults.selection_size(wanted),
                                                                        len(online)))

        def expected_finish(clients: np.ndarray) -> np.ndarray:
            return self.simtime.expected_finish(clients, self.simtime.traffic(plan, clients))

        participants = self.faults.participants(round_, sampled, wanted, expected_finish)
        return Cohort(online, sampled, participants, start_s)

    def online_at_start(self, round_: int) -> tuple[np.ndarray, float]:
        """The seen clients online at the round's simulated start, and that start: the clock (the same on every
        rank, sent by the server), moved on to the next time a client comes online while nobody is."""
        if self.availability.always:
            return self.seen, self.simtime.now_s
        payload = np.array([self.simtime.now_s]) if self.transport.is_server else None
        t = self.simtime.now_s = float(self.transport.broadcast(round_, _CLOCK_MSG, payload)[0])
        online = self.online(t)
        while not len(online):  # the server waits (a float's last bit may need a step past a trace's start)
            t = self.next_online(t)
            online = self.online(t)
        return online, t

    def online(self, t: float, among: np.ndarray | None = None) -> np.ndarray:
        """The clients of ``among`` (default: the seen clients) online at simulated time ``t``."""
        among = self.seen if among is None else among
        return among[self.availability.available(t)[among]]

    def next_online(self, t: float) -> float:
        """When the next client comes online after ``t`` (at least one float step later)."""
        return max(self.availability.next_online(t), float(np.nextafter(t, np.inf)))
