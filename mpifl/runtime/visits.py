"""A round's visiting clients under dynamic placement: a client that computes on another worker than its home
this round takes its data and its state along.

Its data is read where it visits (:class:`~mpifl.runtime.store.ClientStore`). Its state travels from its home
worker to the round's host before the round and back home after it, each way in one variable-size exchange
among the ranks (physical traffic of the simulator, never logical bytes). Why back home rather than staying:
a client's home is where checkpoints, evaluation and its data already live, and the placement of the next
round starts again from the homes, so the owner of every client's state never depends on the history of
rounds (a resume on any rank count finds it by client id). Moving twice costs two transfers per visitor and
round; dynamic placement keeps visitors few (a client stays home while its home is within its fair share).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from mpifl.algorithms.state import pack_states, unpack_states
from mpifl.comm import Placement
from mpifl.comm.transport import exchange_names
from mpifl.runtime.rank import RankContext

OUTWARD, HOMEWARD = "visitor_state", "visitor_state_home"  # the two exchanges' names in the physical log


class Visits:
    """Where a round's clients compute: at home (static placement), or (``dynamic``) re-spread over the workers
    by their planned samples, visitors taking their state along."""

    def __init__(self, rank: RankContext, home: Placement, dynamic: bool = False, samples: np.ndarray | None = None):
        self.transport, self.home, self.store, self.times = rank.transport, home, rank.store, rank.times
        self.state = rank.client.state if rank.client is not None else None
        self.dynamic, self.samples = dynamic, samples
        self.visitors = np.zeros(0, dtype=np.int64)
        self.moved_states = 0  # visits that took a client's state along (counted on the way out)

    @contextmanager
    def placed(self, round_: int, clients: np.ndarray) -> Iterator[Placement]:
        """The round's placement of ``clients``, its messages moved under it and its visitors there meanwhile."""
        placement = self.home
        if self.dynamic and self.samples is not None:
            placement = placement.for_round(clients, self.samples[clients])
        with self.transport.placed(placement):
            self.arrive(round_, placement, clients)
            yield placement
            self.depart(round_, placement)

    def arrive(self, round_: int, placement: Placement, clients: np.ndarray) -> None:
        """Before the round: this round's visitors' data is staged where they visit and their state goes there."""
        rank = self.transport.rank
        away = clients[placement.owner[clients] != self.home.owner[clients]]
        self.visitors = away
        if len(away) == 0:
            return
        if self.store is not None:
            self.store.visit(away[placement.owner[away] == rank])
        leaving = away[self.home.owner[away] == rank]
        self.moved_states += self._move(round_, OUTWARD, leaving, placement.owner)

    def depart(self, round_: int, placement: Placement) -> None:
        """After the round: the visitors' state (committed by now) goes back home; their data is dropped."""
        if self.store is not None:
            self.store.end_visits()
        if len(self.visitors) == 0:
            return
        hosted = self.visitors[placement.owner[self.visitors] == self.transport.rank]
        self._move(round_, HOMEWARD, hosted, self.home.owner)
        if self.state is not None:
            self.state.drop(hosted)
        self.visitors = np.zeros(0, dtype=np.int64)

    def traffic(self) -> tuple[int, float]:
        """Bytes this rank moved in visitors' state exchanges, and the seconds it spent in them."""
        return self.transport.physical.by_message(exchange_names(OUTWARD) + exchange_names(HOMEWARD))

    def _move(self, round_: int, name: str, clients: np.ndarray, destination: np.ndarray) -> int:
        """Send these local clients' committed state to ``destination[client]`` and take in what arrives;
        returns how many clients' states this rank sent."""
        start = time.perf_counter()
        outgoing: dict[int, np.ndarray] = {}
        sent = 0
        if self.state is not None:
            for rank in np.unique(destination[clients]):
                states = self.state.export_states(clients[destination[clients] == rank])
                if states:
                    outgoing[int(rank)] = pack_states(states)
                    sent += len(states)
        self.times.serialization += time.perf_counter() - start
        incoming = self.transport.exchange(round_, name, outgoing)
        start = time.perf_counter()
        if self.state is not None:
            for blob in incoming.values():
                self.state.import_states(unpack_states(blob))
        self.times.serialization += time.perf_counter() - start
        return sent
