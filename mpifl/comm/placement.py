"""Static ownership of clients by worker ranks, balanced by training-sample count."""

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
        """Greedy longest-processing-time: biggest clients first, each to the least-loaded worker."""
        n = len(train_sizes)
        if world_size == 1:
            return cls(np.zeros(n, dtype=np.int64), 1)
        order = np.lexsort((np.arange(n), -np.asarray(train_sizes, dtype=np.int64)))
        heap = [(0, rank) for rank in range(1, world_size)]
        owner = np.empty(n, dtype=np.int64)
        for client in order:
            load, rank = heapq.heappop(heap)
            owner[client] = rank
            heapq.heappush(heap, (load + int(train_sizes[client]), rank))
        return cls(owner, world_size)

    def clients_of(self, rank: int) -> np.ndarray:
        return np.flatnonzero(self.owner == rank)

    def local(self, clients: np.ndarray, rank: int) -> np.ndarray:
        """The subset of ``clients`` (kept in order) that ``rank`` hosts."""
        return clients[self.owner[clients] == rank]

    def rank_order(self, clients: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Permutation grouping ``clients`` by owner rank (stable), and how many each rank holds."""
        owners = self.owner[clients]
        return np.argsort(owners, kind="stable"), np.bincount(owners, minlength=self.world_size)
