"""pFedMe (Dinh et al. 2020): personalized models through Moreau envelopes.

Each local step draws a batch and approximately solves θ_i = argmin f_i(θ; batch) + (λ/2)‖θ − w_i‖² with
``inner_steps`` gradient steps of size ``personal_lr`` (θ carried over between steps, as in the authors'
code), then moves the local model w_i ← w_i − η·λ(w_i − θ_i) (η = client.lr). The server averages the
local models' deltas through FedAvg's server optimizer, whose lr is pFedMe's β. The personalized model
evaluated is a client's last θ_i (the global model for a client that never trained).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from mpifl.algorithms.base import RunContext
from mpifl.algorithms.fedavg import FedAvgClient, FedAvgProtocol, FedAvgServer
from mpifl.runtime.device import host_numpy
from mpifl.runtime.training import batch_schedule, client_generator
from mpifl.schema import limits


@dataclass(frozen=True)
class PFedMeOptions:
    lam: float = field(default=15.0, metadata=limits(ge=0))
    personal_lr: float = field(default=0.01, metadata=limits(gt=0))
    inner_steps: int = field(default=5, metadata=limits(ge=1))


class PFedMeProtocol(FedAvgProtocol):
    eval_kinds = ("personal", "global")


class PFedMeServer(FedAvgServer):
    """FedAvg's server (β = server.lr) with pFedMe's protocol, so both sides agree on what is evaluated."""

    protocol_type = PFedMeProtocol


class PFedMeClient(FedAvgClient):
    protocol_type = PFedMeProtocol
    stateless = False  # per-client state persists across rounds

    def __init__(self, ctx: RunContext, data):  # noqa: ANN001
        super().__init__(ctx, data)
        self.personal: dict[int, np.ndarray] = {}

    def compute(self, round_: int, client: int) -> None:
        opts: PFedMeOptions = self.ctx.options
        cfg = self.ctx.cfg.client
        start = self.start.pop(client)
        split = self.data[client]
        local = torch.from_numpy(start.copy()).to(self.device)
        self.workspace.load(start)
        theta, grads = self.workspace.params, self.workspace.grads
        losses = []
        gen = client_generator(self.ctx.cfg.seed, round_, client)
        for idx in batch_schedule(len(split.x_train), cfg, gen):
            for _ in range(opts.inner_steps):
                loss = self.loss_fn(self.workspace.module(split.x_train[idx]), split.y_train[idx])
                self.workspace.compute_gradient(loss)
                with torch.no_grad():
                    grads.add_(theta, alpha=cfg.weight_decay).add_(theta - local, alpha=opts.lam)
                    theta.add_(grads, alpha=-opts.personal_lr)
            losses.append(float(loss.detach()))
            local.add_(local - theta, alpha=-cfg.lr * opts.lam)
        self.round_losses[client] = float(np.mean(losses))
        self.personal[client] = host_numpy(theta).copy()
        self.deltas[client] = host_numpy(local) - start

    def eval_model(self, client: int, kind: str) -> nn.Module:
        self.workspace.load(self.personal.get(client, self.global_params) if kind == "personal" else self.global_params)
        return self.workspace.module
