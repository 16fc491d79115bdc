"""A worker's client data, as tensors on its device, materialized when the runtime stages it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import torch

from mpifl.data import FederatedDataset
from mpifl.training.tensors import TensorSplit, as_tensors

STARTUP_BATCH = 1024  # file-backed clients read (and checked) this many at a time at start-up
GENERATED_BATCH = 32  # generated clients made this many at a time before round 1 (the budget overshot by less)


class ClientStore(Mapping[int, TensorSplit]):
    """The clients a worker hosts: its home clients (static ownership) for the whole run, and under
    dynamic placement a round's visiting clients for that round only.

    A client's data is made when the runtime stages it (generated) or read (file-backed) and kept while the
    staged data of all clients fits ``budget_bytes``; beyond it, :meth:`release` forgets the least recently
    staged clients, which are staged again when next needed (bitwise the same: generators are seeded per
    client, files are read again). So a worker's memory is the budget plus what one round or one evaluation
    chunk stages, however many clients it hosts or evaluates. File-backed datasets are read through once at
    start-up, a batch at a time, so a damaged file fails before training.
    """

    def __init__(self, dataset: FederatedDataset, home: np.ndarray, device: torch.device,
                 budget_bytes: float = float("inf"), up_front: bool = False):
        """``up_front``: also make generated clients' data now, while it fits the budget, so that rounds spend
        their time training rather than making data on first touch (the same bits made now or later: each
        client's generator is seeded by its id)."""
        self.dataset, self.device, self.budget_bytes = dataset, device, budget_bytes
        self.home = frozenset(int(c) for c in home)
        self.visitors: set[int] = set()
        self.loaded: OrderedDict[int, TensorSplit] = OrderedDict()  # least recently staged first
        self.loaded_bytes = 0
        self.loads = 0  # clients made or read so far (a client forgotten and needed again counts again)
        if not dataset.generated or up_front:
            ordered = sorted(self.home)
            batch = GENERATED_BATCH if dataset.generated else STARTUP_BATCH
            for start in range(0, len(ordered), batch):
                self.stage(ordered[start : start + batch])
                if dataset.generated and self.loaded_bytes > self.budget_bytes:
                    break  # the rest would only be forgotten again: made on first use instead
                self.release()
            self.release()

    def stage(self, clients: Iterable[int]) -> None:
        """Materialize these hosted clients now (one batched read), if not yet in memory."""
        wanted = [int(c) for c in clients]
        unknown = [c for c in wanted if c not in self.home and c not in self.visitors]
        if unknown:
            raise KeyError(f"clients {unknown[:5]} are not hosted on this rank")
        for client in wanted:
            if client in self.loaded:
                self.loaded.move_to_end(client)
        missing = [c for c in wanted if c not in self.loaded]
        for client, split in self.dataset.load_clients(missing).items():
            self.loaded[client] = tensors = as_tensors(split, self.device)
            self.loaded_bytes += _nbytes(tensors)
            self.loads += 1

    def release(self) -> None:
        """Between uses (after a round, after an evaluation chunk): forget the least recently staged clients'
        data until what is kept fits the budget."""
        while self.loaded and self.loaded_bytes > self.budget_bytes:
            self._forget(next(iter(self.loaded)))

    def _forget(self, client: int) -> None:
        self.loaded_bytes -= _nbytes(self.loaded.pop(client))

    def visit(self, clients: np.ndarray) -> None:
        """Host these clients for the current round (dynamic placement); staged like home clients."""
        self.visitors.update(int(c) for c in clients if int(c) not in self.home)

    def end_visits(self) -> None:
        """The round is over: drop its visiting clients' data."""
        for client in self.visitors:
            if client in self.loaded:
                self._forget(client)
        self.visitors.clear()

    def __getitem__(self, client: int) -> TensorSplit:
        if client not in self.loaded:
            self.stage([client])
        return self.loaded[client]

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self.home | self.visitors))

    def __len__(self) -> int:
        return len(self.home | self.visitors)

    def __contains__(self, client: object) -> bool:
        return client in self.home or client in self.visitors


def _nbytes(split: TensorSplit) -> int:
    return sum(t.element_size() * t.nelement() for t in vars(split).values())
