"""FedBuff (Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation", AISTATS 2022).

The server keeps ``concurrency`` clients training at once. A client downloads the current model, runs local SGD
and uploads its delta; the server weights each arriving delta by its staleness, s(τ) = (1 + τ)^(−a) with τ the
number of server steps since the client downloaded (the paper's a = 0.5), and once ``buffer_size`` (K) updates
have arrived it steps: θ ← θ + η_s·v, v ← μ_s·v + (1/K)·Σ s(τᵢ)·Δᵢ (η_s = ``server.lr``, μ_s = ``server.momentum``:
the paper's server SGD is μ_s = 0). A slot that frees is refilled at once with a new client, which downloads
whatever model is current at that moment.

As in the paper, the buffer averages over K, not over the staleness weights, and weighs clients equally, not by
sample count. Arrivals whose update never came (a dropped client, a rejected non-finite upload) count towards K
so a round always ends; the mean is then over the updates that did arrive.

Clients whose updates arrive at the same simulated instant are all taken before a freed slot is refilled, so
with K = C and equal links every step waits for all C clients and FedBuff is FedAvg with equal weights.

The order of events comes from the simulated clock, so the server keeps it: each in-flight client's simulated
arrival time and the model version it downloaded. The runtime (``mpifl.runtime.asynchronous``) decides who is
dispatched when, tells the server, moves the messages, and asks for the next arrival; one engine round is one
server step. Everything here is state of the server object, so a checkpoint carries the events in flight.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mpifl.algorithms.base import RunContext, StepContext, weighted_sum
from mpifl.algorithms.fedavg import FedAvgClient, FedAvgProtocol, FedAvgServer
from mpifl.comm.messages import Message
from mpifl.schema import limits


@dataclass(frozen=True)
class FedBuffOptions:
    """FedBuff: asynchronous, buffered; a server step every buffer_size arrivals, each delta weighted by its
    staleness. Needs network.compute: model; no deadline, over-selection, DP, SecAgg or server link."""

    buffer_size: int = field(default=10, metadata=limits(ge=1))  # K: updates per server step
    concurrency: int = field(default=0, metadata=limits(ge=0))  # clients training at once; 0: clients_per_round
    staleness_exponent: float = field(default=0.5, metadata=limits(ge=0))  # a in s(τ) = (1 + τ)^(−a)


class FedBuffProtocol(FedAvgProtocol):
    """FedAvg's messages (model down, delta up), walked one dispatch at a time on the simulated clock."""

    asynchronous = True

    @property
    def concurrency(self) -> int:
        return self.ctx.options.concurrency or self.ctx.cfg.clients_per_round


class FedBuffServer(FedAvgServer):
    protocol_type = FedBuffProtocol
    protocol: FedBuffProtocol

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        self.version = 0  # server steps taken
        self.clock = 0.0  # simulated seconds: the last event's time
        self.dispatches = 0  # dispatch events so far (what keys the choice of clients)
        self.free_slots = self.protocol.concurrency
        self.arrival_s: dict[int, float] = {}  # in flight: client -> simulated arrival time
        self.downloaded: dict[int, int] = {}  # in flight: client -> the version it trains from
        self.deltas: dict[int, np.ndarray] = {}  # in flight, upload received: client -> its delta
        self.arrivals = 0  # this step's arrivals so far, updates that never came included
        self.arrived: list[tuple[int, int]] = []  # this step's updates: (client, staleness)
        self.buffered: list[np.ndarray] = []  # their deltas (absent for an update that never came)
        self.step_staleness: list[int] = []  # staleness of the updates the last step applied

    def in_flight(self) -> np.ndarray:
        return np.array(sorted(self.arrival_s), dtype=np.int64)

    def dispatch(self, clients: np.ndarray, arrival_s: np.ndarray) -> None:
        """``clients`` download the current model now and will be back at ``arrival_s``."""
        for client, t in zip(clients.tolist(), arrival_s.tolist()):
            self.arrival_s[client], self.downloaded[client] = t, self.version
        self.free_slots -= len(clients)
        self.dispatches += 1

    def consume(self, msg: Message, step: StepContext, rows: np.ndarray) -> None:
        """Hold each delta until its client's simulated arrival."""
        for client, row in zip(step.clients.tolist(), rows):
            self.deltas[client] = np.array(row)

    def next_arrival(self) -> tuple[int, float]:
        """The in-flight client that arrives first (ties: the lower id) and when."""
        client = min(self.arrival_s, key=lambda c: (self.arrival_s[c], c))
        return client, self.arrival_s[client]

    def arrive(self) -> bool:
        """Advance the clock to the next arrival and buffer its update; True once the step's K arrivals are in
        (the step is then applied)."""
        client, self.clock = self.next_arrival()
        del self.arrival_s[client]
        version = self.downloaded.pop(client)
        delta = self.deltas.pop(client, None)
        if delta is not None:
            self.arrived.append((client, self.version - version))
            self.buffered.append(delta)
        self.free_slots += 1
        self.arrivals += 1
        if self.arrivals < self.ctx.options.buffer_size:
            return False
        self.arrivals = 0
        self._apply()
        return True

    def _apply(self) -> None:
        staleness = np.array([tau for _, tau in self.arrived], dtype=np.float64)
        self.step_staleness = [tau for _, tau in self.arrived]
        if self.buffered:
            weights = (1.0 + staleness) ** -self.ctx.options.staleness_exponent / len(self.buffered)
            self.model.step(weighted_sum(np.stack(self.buffered), weights))
            self.version += 1
        self.arrived, self.buffered = [], []

    def round_metrics(self) -> dict[str, float]:
        tau = np.array(self.step_staleness, dtype=np.float64)
        return {"staleness_mean": float(tau.mean()) if len(tau) else np.nan,
                "staleness_max": float(tau.max()) if len(tau) else np.nan,
                "updates_applied": float(len(tau)), "server_version": float(self.version)}


class FedBuffClient(FedAvgClient):
    """FedAvg's client: local SGD from the downloaded model, the delta uploaded."""

    protocol_type = FedBuffProtocol
