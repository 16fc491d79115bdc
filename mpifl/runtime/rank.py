"""What every part of one rank's run works with, handed around as one frozen value."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpifl.algorithms.base import ClientAlgorithm, ServerAlgorithm
from mpifl.comm import Ledger, Transport
from mpifl.comm.wire import WireFormat
from mpifl.runtime.store import ClientStore
from mpifl.runtime.timing import RankTimes


@dataclass(frozen=True)
class RankContext:
    """This rank's collaborators: how messages move (``transport``) and travel (``wire``), where logical bytes are
    counted (``ledger``, rank 0's), the algorithm's sides it holds (the server on rank 0, the clients it hosts
    with their data on a worker; both when alone) and where its seconds go (``times``)."""

    transport: Transport
    ledger: Ledger
    wire: WireFormat
    server: ServerAlgorithm | None
    client: ClientAlgorithm | None
    store: ClientStore | None
    times: RankTimes

    def time_parts(self) -> np.ndarray:
        """This rank's cumulative seconds in each of :data:`~.timing.TIME_PARTS`."""
        t, transport = self.times, self.transport
        return np.array([t.compute, t.data, t.server, t.evaluation, transport.physical.total_seconds,
                         t.serialization + transport.pack_seconds, t.io])

    def release_data(self) -> None:
        """Between uses of client data: keep only what fits ``data_memory_gb``."""
        if self.store is not None:
            self.store.release()

    def end_round(self) -> None:
        """After a walk: the clients forget the round's in-flight values, and their data is trimmed."""
        if self.client is not None:
            self.client.end_round()
        self.release_data()
