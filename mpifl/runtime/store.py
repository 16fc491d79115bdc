"""A worker's client data, as tensors on its device, materialized when the runtime stages it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import torch

from mpifl.data import FederatedDataset
from mpifl.training.tensors import TensorSplit, as_tensors


class ClientStore(Mapping[int, TensorSplit]):
    """The clients a worker hosts: its home clients (static ownership) for the whole run, and under
    dynamic placement a round's visiting clients for that round only.

    File-backed datasets are read in full at start-up, so a damaged file fails before training.
    Generated datasets cannot be damaged: their clients are generated when first staged, so start-up
    stays O(layout) at 10^5 clients and a client that never trains or evaluates costs nothing.
    """

    def __init__(self, dataset: FederatedDataset, home: np.ndarray, device: torch.device):
        self.dataset, self.device = dataset, device
        self.home = frozenset(int(c) for c in home)
        self.visitors: set[int] = set()
        self.loaded: dict[int, TensorSplit] = {}
        if not dataset.generated:
            self.stage(sorted(self.home))

    def stage(self, clients: Iterable[int]) -> None:
        """Materialize these hosted clients now (one batched read), if not yet in memory."""
        missing = [int(c) for c in clients if int(c) not in self.loaded]
        unknown = [c for c in missing if c not in self.home and c not in self.visitors]
        if unknown:
            raise KeyError(f"clients {unknown[:5]} are not hosted on this rank")
        for client, split in self.dataset.load_clients(missing).items():
            self.loaded[client] = as_tensors(split, self.device)

    def visit(self, clients: np.ndarray) -> None:
        """Host these clients for the current round (dynamic placement); staged like home clients."""
        self.visitors.update(int(c) for c in clients if int(c) not in self.home)

    def end_visits(self) -> None:
        """The round is over: drop its visiting clients' data."""
        for client in self.visitors:
            self.loaded.pop(client, None)
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
