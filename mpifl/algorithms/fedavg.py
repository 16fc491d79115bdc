"""FedAvg (McMahan et al.): broadcast the global model, train locally, average the deltas by sample count.

Server step: θ ← θ + η_s·v with v ← μ_s·v + Σᵢ (nᵢ/n)·Δᵢ; η_s = 1, μ_s = 0 is plain FedAvg.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch import nn

from mpifl.algorithms.base import ClientAlgorithm, Protocol, RunContext, ServerAlgorithm, weighted_sum
from mpifl.comm.messages import LOCAL, Message, Step
from mpifl.runtime.training import GradHook


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

    def final_state(self) -> dict[str, np.ndarray]:
        return {"global_model": self.params}

    def apply_update(self, mean_delta: np.ndarray, part: slice = slice(None)) -> None:
        """Server optimizer on the averaged pseudo-gradient (shared by FedAvg-style algorithms); ``part``
        updates a slice of the model only (FedALS), element for element as a whole-model update would."""
        server = self.ctx.cfg.server
        self.velocity[part] = server.momentum * self.velocity[part] + mean_delta
        params = self.params.copy()  # a new array: clients on this rank may still hold views of the old one
        params[part] = (params[part] + server.lr * self.velocity[part]).astype(np.float32)
        self.params = params


class FedAvgClient(ClientAlgorithm):
    protocol_type = FedAvgProtocol
    stateless = True

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
        self.train_workspace(round_, client, self.grad_hook(client, start))
        self.deltas[client] = self.workspace.numpy() - start

    def grad_hook(self, client: int, start: np.ndarray) -> GradHook | None:
        """The local-gradient correction of FedAvg-style variants (FedProx, SCAFFOLD); FedAvg has none."""
        return None

    def send(self, msg: Message, round_: int, client: int) -> np.ndarray:
        return self.deltas.pop(client)

    def eval_model(self, client: int, kind: str) -> nn.Module:
        self.workspace.load(self.global_params)
        return self.workspace.module
