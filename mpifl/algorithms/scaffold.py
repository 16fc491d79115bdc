"""SCAFFOLD (Karimireddy et al. 2020), option II, as the FedALS and FedDeper papers use it as a baseline.

Each client keeps a control variate cᵢ; the server keeps c = Σᵢ wᵢcᵢ over all clients (wᵢ = nᵢ/n, i.e.
1/N for equal shards). Local steps descend g − cᵢ + c; afterwards cᵢ⁺ = cᵢ − c + (x − yᵢ)/(K·η) for K
local steps of rate η. Clients upload Δyᵢ and Δcᵢ = cᵢ⁺ − cᵢ; the server applies the FedAvg update to
x and c ← c + Σ_{i∈S} wᵢΔcᵢ. Control variates travel with the model both ways, so every round costs
exactly twice FedAvg's bytes (the ledger's ``control``/``control_delta`` rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mpifl.algorithms.base import RunContext, weighted_sum
from mpifl.algorithms.fedavg import FedAvgClient, FedAvgProtocol, FedAvgServer
from mpifl.comm.messages import LOCAL, Message, Step
from mpifl.runtime.training import GradHook, planned_steps


def correction_hook(correction: np.ndarray, device: torch.device | str = "cpu") -> GradHook:
    """g ← g + (c − cᵢ): SCAFFOLD's drift correction of every local gradient (computed on ``device``)."""
    shift = torch.from_numpy(np.ascontiguousarray(correction)).to(device)

    def hook(params: torch.Tensor, grads: torch.Tensor) -> None:
        grads.add_(shift)

    return hook


def option_ii(own: np.ndarray, mean: np.ndarray, start_minus_end: np.ndarray, lr: float, steps: int) -> np.ndarray:
    """cᵢ⁺ = cᵢ − c + (x − yᵢ)/(K·η), element by element (so a slice of it equals the slice's update)."""
    return (own - mean + start_minus_end / (lr * steps)).astype(np.float32)


def population_weights(ctx: RunContext, clients: np.ndarray) -> np.ndarray:
    """wᵢ = nᵢ / (samples of all seen clients): keeps c = Σᵢ wᵢcᵢ exact under partial participation."""
    seen = ~ctx.layout.unseen
    return ctx.layout.train_sizes[clients].astype(np.float64) / ctx.layout.train_sizes[seen].sum()


def update_control(control: np.ndarray, rows: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """c ← c + Σ wᵢΔcᵢ (a new array, as clients on the server's rank may hold views of the old one)."""
    return (control + weighted_sum(rows, weights)).astype(np.float32)


class ScaffoldProtocol(FedAvgProtocol):
    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        numel = self.model_msg.numel
        self.control_msg = Message("control", "down", numel, broadcast=True)
        self.control_delta_msg = Message("control_delta", "up", numel)

    def train_plan(self, round_: int) -> Sequence[Step]:
        return (self.model_msg, self.control_msg, LOCAL, self.delta_msg, self.control_delta_msg)


class ScaffoldServer(FedAvgServer):
    protocol_type = ScaffoldProtocol

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        self.control = np.zeros_like(self.params)

    def payload(self, msg: Message, round_: int, clients: np.ndarray) -> np.ndarray:
        return self.control if msg.name == self.protocol.control_msg.name else super().payload(msg, round_, clients)

    def consume(self, msg: Message, round_: int, clients: np.ndarray, rows: np.ndarray) -> None:
        if msg.name == self.protocol.control_delta_msg.name:
            self.control = update_control(self.control, rows, population_weights(self.ctx, clients))
        else:
            super().consume(msg, round_, clients, rows)


class ScaffoldClient(FedAvgClient):
    protocol_type = ScaffoldProtocol
    stateless = False  # per-client state persists across rounds

    def __init__(self, ctx: RunContext, data):  # noqa: ANN001
        super().__init__(ctx, data)
        self.controls: dict[int, np.ndarray] = {}  # cᵢ, persistent on the rank that owns client i
        self.global_control: dict[int, np.ndarray] = {}
        self.control_deltas: dict[int, np.ndarray] = {}

    def receive(self, msg: Message, round_: int, client: int, row: np.ndarray) -> None:
        if msg.name == self.protocol.control_msg.name:
            self.global_control[client] = row
        else:
            super().receive(msg, round_, client, row)

    def own_control(self, client: int) -> np.ndarray:
        return self.controls.get(client, np.zeros(self.workspace.numel, dtype=np.float32))

    def grad_hook(self, client: int, start: np.ndarray) -> GradHook:
        return correction_hook(self.global_control[client] - self.own_control(client), self.device)

    def compute(self, round_: int, client: int) -> None:
        super().compute(round_, client)
        cfg = self.ctx.cfg.client
        steps = planned_steps(len(self.data[client].x_train), cfg)
        own = self.own_control(client)
        new = option_ii(own, self.global_control.pop(client), -self.deltas[client], cfg.lr, steps)
        self.control_deltas[client] = new - own
        self.controls[client] = new

    def send(self, msg: Message, round_: int, client: int) -> np.ndarray:
        if msg.name == self.protocol.control_delta_msg.name:
            return self.control_deltas.pop(client)
        return super().send(msg, round_, client)
