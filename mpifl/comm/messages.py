"""Message declarations: what an algorithm sends, in which direction, of what size."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeVar

import numpy as np

Direction = Literal["down", "up"]
SumWeights = Literal["weighting", "samples", "uniform"]
"""What a summed message's rows are weighted by: ``samples`` (each client's training samples), ``uniform`` (one
each), or ``weighting`` (as ``server.weighting`` says)."""


@dataclass(frozen=True)
class Message:
    """One message type of a protocol.

    ``broadcast`` down-messages carry the same payload for every participating client (one
    ``Bcast``); the others carry one row per client (``Scatterv``/``Gatherv``). ``logical``
    messages are what a real deployment would send and go into the ledger; the simulator's own
    bookkeeping (evaluation metrics, compute timings) is marked ``logical=False`` and only shows
    up as physical MPI traffic. An ``update`` is a model delta or gradient the server aggregates: what
    differential privacy clips and noises and secure aggregation masks. An ``everyone`` step of a training
    plan reaches every seen client that is up this round, not only the sampled participants (pFedMe's
    Algorithm 1: all clients receive w and train, the sampled ones upload); only down messages and local steps
    can be.

    A ``summed`` up message is one the server needs only as Σᵢ weightᵢ·rowᵢ over the accepted clients (a FedAvg
    delta): each worker folds its clients' rows into an exact running total as they finish and one reduction
    brings the total to rank 0 (:mod:`mpifl.comm.exactsum.distributed`), so no rank holds every client's row (where
    each worker hosts only a few, their rows travel instead, cheaper and with the same bits).
    ``groups`` sums side by side (IFCA: one per cluster; each client's row goes into the one its client side
    names).
    """

    name: str
    direction: Direction
    numel: int
    dtype: str = "float32"
    broadcast: bool = False
    logical: bool = True
    everyone: bool = False
    update: bool = False
    summed: SumWeights | None = None
    groups: int = 1

    def __post_init__(self) -> None:
        if self.broadcast and self.direction != "down":
            raise ValueError(f"message {self.name}: only down messages can be broadcast")
        if self.everyone and self.direction != "down":
            raise ValueError(f"message {self.name}: only down messages can reach every client")
        if self.update and (self.direction != "up" or np.dtype(self.dtype).kind != "f"):
            raise ValueError(f"message {self.name}: an update is a float upload")
        if self.numel < 0:
            raise ValueError(f"message {self.name}: negative size")
        if self.summed is not None and (self.direction != "up" or np.dtype(self.dtype).kind != "f"):
            raise ValueError(f"message {self.name}: only float uploads can be summed")
        if self.groups < 1 or self.groups > 1 and self.summed is None:
            raise ValueError(f"message {self.name}: groups are sums side by side, at least one")

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def nbytes(self) -> int:
        """Bytes one client sends or receives for this message: numel × itemsize."""
        return self.numel * self.itemsize


def masked_nbytes(numel: int, field_bits: int) -> int:
    """Bytes of a vector of ``numel`` entries as ``field_bits``-bit field elements (secure aggregation's masked
    input), packed."""
    return -(-numel * field_bits // 8)


@dataclass(frozen=True)
class LocalCompute:
    """A protocol step with no traffic: every participating client runs its local computation."""

    name: str = "local"
    everyone: bool = False  # every seen client computes, not only the participants (see Message)


LOCAL = LocalCompute()
EVERYONE_LOCAL = LocalCompute(everyone=True)
Step = Message | LocalCompute

T = TypeVar("T")


def require(value: T | None, what: str) -> T:
    """``value``, which an earlier step of the plan must have set; ``None`` means the steps came out of
    order (an algorithm bug, reported as such)."""
    if value is None:
        raise RuntimeError(f"{what} is missing: the plan's steps came out of order")
    return value
