"""pFedMe (Dinh et al. 2020): personalized models through Moreau envelopes.

Each local step draws a batch and approximately solves θ_i = argmin f_i(θ; batch) + (λ/2)‖θ − w_i‖² with
``inner_steps`` gradient steps of size ``personal_lr`` (θ carried over between steps, as in the authors'
code), then moves the local model w_i ← w_i − η·λ(w_i − θ_i) (η = client.lr). The server averages the
local models' deltas through FedAvg's server optimizer, whose lr is pFedMe's β. The personalized model
evaluated is a client's last θ_i (the global model for a client that never trained).

``pfedme.personalize`` says who updates θ_i in a round: ``sampled`` (default, as FL-Bench, which PeFLL's
baselines ran on) only the sampled clients; ``all``, Algorithm 1 and the authors' code: the server sends w
to every seen client, every one of them trains (so no personal model goes stale), and only the sampled
clients upload. ``all`` costs w's bytes for every seen client each round and every client's computation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch import nn

from mpifl.algorithms.base import RunContext, StepContext
from mpifl.algorithms.fedavg import DeltaClient, FedAvgProtocol, FedAvgServer
from mpifl.comm.messages import EVERYONE_LOCAL, LOCAL, Step, require
from mpifl.schema import limits
from mpifl.training.device import host_floats, host_numpy
from mpifl.training.sgd import client_generator, training_batches


@dataclass(frozen=True)
class PFedMeOptions:
    """pFedMe: personalized models through Moreau envelopes; server.lr is pFedMe's β."""

    lam: float = field(default=15.0, metadata=limits(ge=0))  # λ: the pull (λ/2)‖θ − w‖² of θ towards the local model
    personal_lr: float = field(default=0.01, metadata=limits(gt=0))  # the inner steps' size on θ
    inner_steps: int = field(default=5, metadata=limits(ge=1))  # gradient steps approximating θ per local step
    # sampled: only the sampled clients update θ_i (FL-Bench's); all: Algorithm 1, every seen client trains each
    # round (w sent to all of them) and only the sampled ones upload
    personalize: Literal["sampled", "all"] = "sampled"


class PFedMeProtocol(FedAvgProtocol):
    eval_kinds = ("personal", "global")

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        if ctx.options.personalize == "all":  # every seen client receives w and trains; the sampled upload
            self.model_msg = dataclasses.replace(self.model_msg, everyone=True)

    def train_plan(self, round_: int) -> Sequence[Step]:
        local = EVERYONE_LOCAL if self.model_msg.everyone else LOCAL
        return (self.model_msg, local, self.delta_msg)

    def client_state(self) -> dict[str, int]:
        return {"personal": 4 * self.model_msg.numel}  # θᵢ, float32

    def samples_per_round(self) -> np.ndarray:
        return self.ctx.options.inner_steps * super().samples_per_round()


class PFedMeServer(FedAvgServer):
    """FedAvg's server (β = server.lr) with pFedMe's protocol, so both sides agree on what is evaluated."""

    protocol_type: type[PFedMeProtocol] = PFedMeProtocol
    protocol: PFedMeProtocol


class PFedMeClient(DeltaClient):
    protocol_type: type[PFedMeProtocol] = PFedMeProtocol
    protocol: PFedMeProtocol

    def compute(self, step: StepContext, client: int) -> None:
        opts: PFedMeOptions = self.ctx.options
        cfg = self.ctx.cfg.client
        start = self.start.pop(client)
        split = self.data[client]
        local = torch.from_numpy(start.copy()).to(self.device)
        self.workspace.load(start)
        theta, grads = self.workspace.params, self.workspace.grads
        losses = []
        gen = client_generator(self.ctx.cfg.seed, step.round, client)
        for xb, yb in training_batches(split.x_train, split.y_train, cfg, gen):
            for _ in range(opts.inner_steps):
                loss = self.loss_fn(self.workspace.module(xb), yb)
                self.workspace.compute_gradient(loss)
                with torch.no_grad():
                    grads.add_(theta, alpha=cfg.weight_decay).add_(theta - local, alpha=opts.lam)
                    theta.add_(grads, alpha=-opts.personal_lr)
            losses.append(loss.detach())
            local.add_(local - theta, alpha=-cfg.lr * opts.lam)
        self.round_losses[client] = float(np.mean(host_floats(losses)))  # read once, not once per batch
        self.state.edit(client)["personal"] = host_numpy(theta).copy()
        self.deltas[client] = host_numpy(local) - start

    def eval_model(self, step: StepContext, client: int, kind: str) -> nn.Module:
        own = self.state.get(client, "personal") if kind == "personal" else None
        self.workspace.load(require(self.global_params, "the global model") if own is None else own)
        return self.workspace.module
