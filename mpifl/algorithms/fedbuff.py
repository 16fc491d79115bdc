"""FedBuff (Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation", AISTATS 2022).

The server keeps ``concurrency`` clients training at once. A client downloads the current model, runs local SGD
and uploads its delta; the server weights each arriving delta by its staleness, s(τ) = (1 + τ)^(−a) with τ the
number of server steps since the client downloaded (the paper's a = 0.5), and once ``buffer_size`` (K) updates
have arrived it steps: θ ← θ + η_s·v, v ← μ_s·v + (1/K)·Σ s(τᵢ)·Δᵢ (η_s = ``server.lr``, μ_s = ``server.momentum``:
the paper's server SGD is μ_s = 0; ``server.optimizer`` may step that mean adaptively instead). A slot that frees
is refilled at once with a new client, which downloads whatever model is current at that moment.

As in the paper, the buffer averages over K, not over the staleness weights, and weighs clients equally, not by
sample count. Arrivals whose update never came (a dropped client, a rejected non-finite upload) count towards K
so a round always ends; the mean is then over the updates that did arrive.

Clients whose updates arrive at the same simulated instant are all taken before a freed slot is refilled, so
with K = C and equal links every step waits for all C clients and FedBuff is FedAvg with equal weights.

The order of events comes from the simulated clock, so the server keeps it (:class:`EventDrivenServer`: each
in-flight client's simulated arrival time and the model version it downloaded). The runtime
(``mpifl.runtime.asynchronous``) decides who is dispatched when, tells the server, moves the messages, and asks for
the next arrival; one engine round is one server step. Everything here is state of the server object, so a
checkpoint carries the events in flight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from mpifl.algorithms.base import (
    AsynchronousProtocol,
    EventDrivenServer,
    Handler,
    RunContext,
)
from mpifl.algorithms.context import AsynchronousOptions
from mpifl.algorithms.fedavg import FedAvgClient, FedAvgProtocol, FedAvgServer
from mpifl.comm.exactsum import exact_sum
from mpifl.comm.messages import Message
from mpifl.schema import limits


@dataclass(frozen=True)
class FedBuffOptions(AsynchronousOptions):
    """FedBuff: asynchronous, buffered; a server step every buffer_size arrivals, each delta weighted by its
    staleness. Needs network.compute: model; no deadline, over-selection, DP, SecAgg or server link."""

    buffer_size: int = field(default=10, metadata=limits(ge=1))  # K: updates per server step
    staleness_exponent: float = field(default=0.5, metadata=limits(ge=0))  # a in s(τ) = (1 + τ)^(−a)


class FedBuffProtocol(FedAvgProtocol, AsynchronousProtocol):
    """FedAvg's messages (model down, delta up), walked one dispatch at a time on the simulated clock; each
    delta travels as its own row (the server weights it by its staleness when it arrives)."""

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        self.delta_msg = dataclasses.replace(self.delta_msg, summed=None)

    @property
    def arrivals_per_step(self) -> int:
        return int(self.ctx.options.buffer_size)


class FedBuffServer(FedAvgServer, EventDrivenServer):
    protocol_type = FedBuffProtocol
    protocol: FedBuffProtocol

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        self.arrivals = 0  # this step's arrivals so far, updates that never came included
        self.staleness: list[int] = []  # this step's updates' staleness
        self.buffered: list[np.ndarray] = []  # their deltas
        self.step_staleness: list[int] = []  # staleness of the updates the last step applied

    def handlers(self) -> Mapping[Message, Handler]:
        return {**super().handlers(), self.protocol.delta_msg: self.hold}

    def on_arrival(self, client: int, upload: np.ndarray | None, staleness: int) -> bool:
        """Buffer the update; the K-th arrival applies the step."""
        if upload is not None:
            self.staleness.append(staleness)
            self.buffered.append(upload)
        self.arrivals += 1
        if self.arrivals < self.ctx.options.buffer_size:
            return False
        self.arrivals = 0
        self._apply()
        return True

    def _apply(self) -> None:
        self.step_staleness = self.staleness
        if self.buffered:  # (1/K)·Σ s(τᵢ)·Δᵢ, the sum exact (with K = C, fresh updates, FedAvg's uniform sum)
            staleness = np.array(self.staleness, dtype=np.float64)
            weights = (1.0 + staleness) ** -self.ctx.options.staleness_exponent
            self.model.step(exact_sum(np.stack(self.buffered), weights) / len(self.buffered))
            self.version += 1
        self.staleness, self.buffered = [], []

    def round_metrics(self) -> dict[str, float]:
        tau = np.array(self.step_staleness, dtype=np.float64)
        return {"staleness_mean": float(tau.mean()) if len(tau) else np.nan,
                "staleness_max": float(tau.max()) if len(tau) else np.nan,
                "updates_applied": float(len(tau)), "server_version": float(self.version)}


class FedBuffClient(FedAvgClient):
    """FedAvg's client: local SGD from the downloaded model, the delta uploaded."""

    protocol_type = FedBuffProtocol
