"""FedAvg (McMahan et al.): broadcast the global model, train locally, average the deltas by sample count.

Server step: θ ← θ + η_s·v with v ← μ_s·v + Σᵢ (nᵢ/n)·Δᵢ; η_s = 1, μ_s = 0 is plain FedAvg.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch import nn

from mpifl.algorithms.base import ClientAlgorithm, Protocol, RunContext, ServerAlgorithm, weighted_sum
from mpifl.comm.messages import LOCAL, Message, Step


class FedAvgProtocol(Protocol):
    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        numel = ctx.new_model().numel
        self.model_msg = Message("model", "down", numel, broadcast=True)
        self.delta_msg = Message("delta", "up", numel)
        self.eval_msg = Message("eval_model", "down", numel, broadcast=True)

    def train_plan(self, round_: int) -> Sequence[Step]:
        return (self.model_msg, LOCAL, self.delta_msg)

    def eval_plan(self) -> Sequence[Step]:
        return (self.eval_msg,)


class FedAvgServer(ServerAlgorithm):
    protocol_type = FedAvgProtocol

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        self.params = ctx.new_model().numpy().copy()
        self.velocity = np.zeros(self.params.shape, dtype=np.float64)

    def payload(self, msg: Message, round_: int, clients: np.ndarray) -> np.ndarray:
        return self.params

    def consume(self, msg: Message, round_: int, clients: np.ndarray, rows: np.ndarray) -> None:
        self.apply_update(weighted_sum(rows, self.ctx.weights(clients)))

    def apply_update(self, mean_delta: np.ndarray) -> None:
        """Server optimizer on the averaged pseudo-gradient (shared by FedAvg-style algorithms)."""
        server = self.ctx.cfg.server
        self.velocity = server.momentum * self.velocity + mean_delta
        self.params = (self.params + server.lr * self.velocity).astype(np.float32)


class FedAvgClient(ClientAlgorithm):
    protocol_type = FedAvgProtocol

    def __init__(self, ctx: RunContext, data):  # noqa: ANN001
        super().__init__(ctx, data)
        self.start: dict[int, np.ndarray] = {}
        self.deltas: dict[int, np.ndarray] = {}
        self.global_params: np.ndarray | None = None

    def receive(self, msg: Message, round_: int, client: int, row: np.ndarray) -> None:
        if msg.name == self.protocol.eval_msg.name:
            self.global_params = row
        else:
            self.start[client] = row

    def compute(self, round_: int, client: int) -> None:
        start = self.start.pop(client)
        self.workspace.load(start)
        self.train_workspace(round_, client)
        self.deltas[client] = self.workspace.numpy() - start

    def send(self, msg: Message, round_: int, client: int) -> np.ndarray:
        return self.deltas.pop(client)

    def eval_model(self, client: int, kind: str) -> nn.Module:
        self.workspace.load(self.global_params)
        return self.workspace.module
