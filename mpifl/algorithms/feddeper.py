"""FedDeper (Zhou et al., "Depersonalized Federated Learning", spec depersonalized.md §1).

Every sampled client i starts a globalized model y ← x and keeps a personalized model vᵢ across rounds
(it lives only on the rank that owns i and is never sent). Each of τ local steps uses one mini-batch
for both models (spec §1.3: "same batch" reading):

    y ← y − η·g(y) − ρ·(v + y − 2x)      (the gradient of eq. 5 at the step's v, before v moves)
    v ← v − η·g(v)

then v ← (1 − λ)v + λy, and y − x is uploaded. Messages and bytes are FedAvg's; a round costs 2τ
gradients, which is why the paper's FedDeper* simply halves τ (set ``client.steps``). Both the global
model x and each client's stored vᵢ (after mixing; the initial model for a client not yet sampled) are
evaluated on that client's own test split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from mpifl.algorithms.base import RunContext, StepContext
from mpifl.algorithms.fedavg import DeltaClient, FedAvgProtocol, FedAvgServer
from mpifl.algorithms.state import ClientState
from mpifl.schema import limits
from mpifl.training.sgd import client_generator, sgd_update, training_batches


@dataclass(frozen=True)
class FedDeperOptions:
    """FedDeper: each client keeps a personal model (never sent) that regularizes its global-model steps."""

    rho: float = field(default=0.03, metadata=limits(ge=0))  # penalty ρ of eq. 5 (same order as η)
    mixing: float = field(default=0.5, metadata=limits(ge=0, le=1))  # λ of eq. 6


class FedDeperProtocol(FedAvgProtocol):
    eval_kinds = ("global", "personal")

    def samples_per_round(self) -> np.ndarray:
        return 2 * super().samples_per_round()  # every step takes a gradient at y and one at v

    def client_state(self) -> dict[str, int]:
        return {"personal": 4 * self.model_msg.numel}  # v, float32


class FedDeperServer(FedAvgServer):
    protocol_type: type[FedDeperProtocol] = FedDeperProtocol
    protocol: FedDeperProtocol


class FedDeperClient(DeltaClient):
    protocol_type: type[FedDeperProtocol] = FedDeperProtocol
    protocol: FedDeperProtocol

    def __init__(self, ctx: RunContext, data, state: ClientState | None = None):  # noqa: ANN001
        super().__init__(ctx, data, state)
        self.initial = self.workspace.numpy().copy()
        self.personal_model = ctx.new_model(ctx.device)

    def compute(self, step: StepContext, client: int) -> None:
        cfg, opts = self.ctx.cfg.client, self.ctx.options
        start = self.start.pop(client)
        y, v = self.workspace, self.personal_model
        y.load(start)
        v.load(self.personal(client))
        twice_x = 2 * torch.tensor(start, device=self.device)
        momenta = [torch.zeros_like(y.params) if cfg.momentum > 0 else None for _ in range(2)]
        split = self.data[client]
        gen = client_generator(self.ctx.cfg.seed, step.round, client)
        loss_sum, steps = torch.zeros((), dtype=torch.float64, device=self.device), 0
        for xb, yb in training_batches(split.x_train, split.y_train, cfg, gen):
            loss = self.loss_fn(y.module(xb), yb)
            y.compute_gradient(loss)
            y.grads.add_(v.params + y.params - twice_x, alpha=opts.rho / cfg.lr)
            v.compute_gradient(self.loss_fn(v.module(xb), yb))
            for model, momentum in zip((y, v), momenta):  # each model its own one-row block
                sgd_update(model.params[None], model.grads[None], None if momentum is None else momentum[None],
                           cfg.lr, cfg)
            loss_sum += loss.detach()
            steps += 1
        self.round_losses[client] = float(loss_sum) / max(steps, 1)
        mixed = (1 - opts.mixing) * v.numpy() + opts.mixing * y.numpy()
        self.state.edit(client)["personal"] = mixed.astype(np.float32)
        self.deltas[client] = y.numpy() - start

    def eval_model(self, step: StepContext, client: int, kind: str) -> nn.Module:
        if kind == "global":
            return super().eval_model(step, client, kind)
        self.workspace.load(self.personal(client))
        return self.workspace.module

    def personal(self, client: int) -> np.ndarray:
        """vᵢ after its last mixing; the initial model for a client not yet sampled."""
        return self.state.get(client, "personal", self.initial)
