"""Which worker rank hosts which client: static ownership balanced by training-sample count, and
per-round placements that rebalance a round's clients (a visiting client's state goes along: runtime/visits.py)."""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Placement:
    """``owner[c]`` is the rank hosting client ``c``; rank 0 hosts clients only when it runs alone."""

    owner: np.ndarray
    world_size: int

    @classmethod
    def balanced(cls, train_sizes: np.ndarray, world_size: int) -> Placement:
        """Static ownership: clients spread by training-sample count (greedy longest-processing-time)."""
        return cls(_longest_processing_time(np.asarray(train_sizes), world_size), world_size)

    def for_round(self, clients: np.ndarray, work: np.ndarray) -> Placement:
        """This placement with one round's ``clients`` re-spread over the workers by their ``work``,
        moving as few as it can: biggest first, a client stays home while its home worker is within
        its fair share (total work / workers), and the others go, biggest first, to the least-loaded
        worker (greedy LPT). Every other client is left where it lives. A client's arithmetic is the same
        on any rank, so results do not change."""
        if self.world_size == 1:
            return self
        work = np.asarray(work, dtype=np.int64)
        fair = work.sum() / (self.world_size - 1)
        load = np.zeros(self.world_size, dtype=np.int64)
        placed = self.owner[clients].copy()
        movers = []
        for i in np.lexsort((np.arange(len(work)), -work)):
            home = placed[i]
            if load[home] + work[i] <= fair:
                load[home] += work[i]
            else:
                movers.append(i)
        placed[movers] = _longest_processing_time(work[movers], self.world_size, load)
        owner = self.owner.copy()
        owner[clients] = placed
        return Placement(owner, self.world_size)

    def clients_of(self, rank: int) -> np.ndarray:
        return np.flatnonzero(self.owner == rank)

    def local(self, clients: np.ndarray, rank: int) -> np.ndarray:
        """The subset of ``clients`` (kept in order) that ``rank`` hosts."""
        return clients[self.owner[clients] == rank]

    def rank_order(self, clients: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Permutation grouping ``clients`` by owner rank (stable), and how many each rank holds."""
        owners = self.owner[clients]
        return np.argsort(owners, kind="stable"), np.bincount(owners, minlength=self.world_size)


def _longest_processing_time(work: np.ndarray, world_size: int, load: np.ndarray | None = None) -> np.ndarray:
    """Worker rank (1..world_size-1; 0 when alone) of each item: biggest first, each to the least-loaded
    worker (starting from ``load[rank]``, else empty), ties broken by item index and rank, so every rank
    computes the same answer."""
    n = len(work)
    if world_size == 1:
        return np.zeros(n, dtype=np.int64)
    order = np.lexsort((np.arange(n), -work.astype(np.int64)))
    heap = [(0 if load is None else int(load[rank]), rank) for rank in range(1, world_size)]
    heapq.heapify(heap)
    owner = np.empty(n, dtype=np.int64)
    for item in order:
        least, rank = heapq.heappop(heap)
        owner[item] = rank
        heapq.heappush(heap, (least + int(work[item]), rank))
    return owner
