"""SCAFFOLD (Karimireddy et al. 2020), option II, as the FedALS and FedDeper papers use it as a baseline.

Each client keeps a control variate cᵢ; the server keeps c = Σᵢ wᵢcᵢ over all N seen clients (wᵢ = nᵢ/n, or
1/N under ``server.weighting: uniform``, the paper's c ← c + (1/N)·Σ_{i∈S} Δcᵢ). Local steps descend
g − cᵢ + c. Afterwards option II sets

    cᵢ⁺ = cᵢ − c + (x − yᵢ)/(K·η),

which for K plain SGD steps of rate η is exactly the mean of the K local gradients, (1/K)Σₖ gₖ (the
correction cancels). mpifl computes that mean directly: gₖ is the gradient of the client's local
objective (loss plus weight decay) at its k-th iterate, before the correction, clipping and momentum.
With plain SGD the two agree to rounding (tested); under momentum β the displacement x − yᵢ grows
about 1/(1 − β) times faster than the gradients, so the printed formula would make cᵢ ten times too
large at β = 0.9 and the run diverge, while the mean gradient stays what option II estimates. Clients
upload Δyᵢ and Δcᵢ = cᵢ⁺ − cᵢ; the server applies the FedAvg update to x and c ← c + Σ_{i∈S} wᵢΔcᵢ.
A client whose update is rejected keeps its old cᵢ (the runtime discards its state edits), so c = Σᵢ wᵢcᵢ
holds under every fault. Control variates travel with the model both ways, so every round costs exactly
twice FedAvg's bytes (the ledger's ``control``/``control_delta`` rows).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from mpifl.algorithms.base import Handler, RunContext, StepContext
from mpifl.algorithms.fedavg import FedAvgClient, FedAvgProtocol, FedAvgServer
from mpifl.algorithms.state import ClientState
from mpifl.algorithms.toolkit import ClientStart
from mpifl.comm.messages import LOCAL, Message, Step
from mpifl.training.localstep import GradTransform, LocalStep, TrainedRows
from mpifl.training.sgd import to_device


def corrected(weight_decay: float) -> GradTransform:
    """g ← g + (c − cᵢ) on every row (its ``"shift"``), after adding the uncorrected gradient of the local
    objective (the loss's plus weight decay's) to the row's ``"gradient_sum"`` (float64: option II's Σₖ gₖ)."""

    def transform(params: torch.Tensor, grads: torch.Tensor, rows: Mapping[str, torch.Tensor]) -> None:
        total = rows["gradient_sum"]
        total += grads
        if weight_decay:
            total += weight_decay * params.double()
        grads.add_(rows["shift"])

    return transform


def mean_gradients(trained: TrainedRows) -> torch.Tensor:
    """Each trained row's mean local gradient (float32, option II's cᵢ⁺), computed and left where the rows are."""
    steps = torch.from_numpy(np.maximum(trained.steps, 1).astype(np.float64))
    total = trained.sums["gradient_sum"]
    return (total / to_device(steps, total.device)[:, None]).float()


def population_weights(ctx: RunContext, clients: np.ndarray) -> np.ndarray:
    """``clients``' shares of the whole population of seen clients, as ``server.weighting`` weighs them:
    nᵢ / (samples of all seen clients), or 1/N. Summing a cohort's Δcᵢ with them keeps c = Σᵢ wᵢcᵢ exact
    under partial participation."""
    return ctx.sum_weights("weighting", clients) / population_divisor(ctx)


def population_divisor(ctx: RunContext) -> float:
    """What a weighted sum of Δcᵢ is divided by to be their population share: the weights of every seen client
    (their samples, or their count under ``server.weighting: uniform``)."""
    return float(ctx.sum_weights("weighting", np.flatnonzero(~ctx.layout.unseen)).sum())


def sample_shares(ctx: RunContext, clients: np.ndarray) -> np.ndarray:
    """nᵢ / (samples of all seen clients), whatever the weighting: what pools per-sample statistics."""
    seen = ~ctx.layout.unseen
    return ctx.layout.train_sizes[clients].astype(np.float64) / ctx.layout.train_sizes[seen].sum()


def update_control(ctx: RunContext, control: np.ndarray, total: np.ndarray) -> np.ndarray:
    """c ← c + Σ wᵢΔcᵢ from ``total`` = Σ nᵢ·Δcᵢ (or Σ Δcᵢ, uniform) over the accepted clients (a new array, as
    clients on the server's rank may hold views of the old one)."""
    return (control + total / population_divisor(ctx)).astype(np.float32)


class ScaffoldProtocol(FedAvgProtocol):
    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        numel = self.model_msg.numel
        self.control_msg = Message("control", "down", numel, broadcast=True)
        self.control_delta_msg = Message("control_delta", "up", numel, update=True, summed="weighting")

    def train_plan(self, round_: int) -> Sequence[Step]:
        return (self.model_msg, self.control_msg, LOCAL, self.delta_msg, self.control_delta_msg)

    def client_state(self) -> dict[str, int]:
        return {"control": 4 * self.model_msg.numel}  # cᵢ, float32


class ScaffoldServer(FedAvgServer):
    protocol_type: type[ScaffoldProtocol] = ScaffoldProtocol
    protocol: ScaffoldProtocol

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        self.control = np.zeros_like(self.params)

    def handlers(self) -> Mapping[Message, Handler]:
        p = self.protocol
        return {**super().handlers(), p.control_msg: self.global_control, p.control_delta_msg: self.apply_controls}

    def global_control(self, step: StepContext) -> np.ndarray:
        return self.control

    def apply_controls(self, step: StepContext, total: np.ndarray) -> None:
        self.control = update_control(self.ctx, self.control, total)

    def final_state(self) -> dict[str, np.ndarray]:
        return {**super().final_state(), "control": self.control}


class ScaffoldClient(FedAvgClient):
    protocol_type: type[ScaffoldProtocol] = ScaffoldProtocol
    protocol: ScaffoldProtocol
    scratch: tuple[str, ...] = (*FedAvgClient.scratch, "global_control", "control_deltas")
    vectorized_on_cpu = False  # the loop under auto on the CPU, as before

    def __init__(self, ctx: RunContext, data, state: ClientState | None = None):  # noqa: ANN001
        super().__init__(ctx, data, state)
        self.global_control: dict[int, torch.Tensor] = {}
        self.control_deltas: dict[int, torch.Tensor] = {}

    def handlers(self) -> Mapping[Message, Handler]:
        p = self.protocol
        return {**super().handlers(), p.control_msg: self.receive_control, p.control_delta_msg: self.send_control}

    def receive_control(self, step: StepContext, client: int, row: np.ndarray) -> None:
        """c, copied to the device once a round however many clients receive it (one broadcast row)."""
        self.global_control[client] = self.on_device(step, row)

    def own_control(self, client: int) -> torch.Tensor:
        """cᵢ on the device: kept there by the client state within its budget (``state_device_gb``), else copied
        up; zero before the client's first round."""
        own = self.state.get_on(client, "control", self.device)
        return torch.zeros(self.workspace.numel, device=self.device) if own is None else own

    def local_step(self, step: StepContext) -> LocalStep | None:
        return LocalStep(corrected(self.ctx.cfg.client.weight_decay), sums=("gradient_sum",), delta=True)

    def local_start(self, step: StepContext, client: int) -> ClientStart:
        shift = self.global_control.pop(client) - self.own_control(client)  # c − cᵢ
        return ClientStart(self.start.pop(client), {"shift": shift})

    def local_end(self, step: StepContext, clients: list[int], trained: TrainedRows) -> None:
        """Δcᵢ to send and cᵢ⁺ to keep, both rows on the device (a GPU folds the Δcᵢ there and keeps cᵢ⁺)."""
        super().local_end(step, clients, trained)
        for client, new in zip(clients, mean_gradients(trained)):
            self.control_deltas[client] = new - self.own_control(client)
            self.state.edit(client)["control"] = new

    def send_control(self, step: StepContext, client: int) -> torch.Tensor:
        return self.control_deltas.pop(client)
