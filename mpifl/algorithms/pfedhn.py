"""pFedHN (Shamsian et al., ICML 2021), the hypernetwork baseline of PeFLL (reference-code spec §1): the
server holds h and one learned embedding e_i ∈ R^l per client; client i's model is θ_i = h(e_i).

Messages per sampled client and round: θ_i down (d floats, per client), Δθ_i = θ_i^new − θ_i up (d floats)
after k local steps. The embeddings never travel. ``pfedhn.server_steps`` says how the server steps (SGD
with momentum and weight decay by default, as the code):

* ``per_client`` (the authors' code and FL-Bench): the round's clients take turns, one hypernetwork step
  on J_iᵀ(θ_i − θ_i^new) per client, so the next client's θ comes from the updated h (c steps per round);
* ``averaged``: all c clients get their θ from the same h and the server makes one step on the mean
  pseudo-gradient (1/c)Σ_i J_iᵀ(θ_i − θ_i^new): c times fewer server steps at the same learning rate.

Before each evaluation, every client never seen in training gets a fresh random embedding that
is optimized with h frozen over ``new_client_rounds`` round trips (PeFLL spec §4.2), each θ down and Δθ
up (d + d floats) after local training; then every client gets θ_i = h(e_i) for evaluation (d floats).
The engine may walk both plans ``eval_chunk`` clients at a time: each chunk of new clients adapts its own
embeddings, so the server holds K models and K new embeddings in flight, plus l floats per new client.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch import nn

from mpifl.algorithms.base import Handler, RunContext, ServerAlgorithm, StepContext
from mpifl.algorithms.pefll import HyperClient, HyperOptions, HyperProtocol, clip_, rows_of, rowwise
from mpifl.algorithms.state import ClientState
from mpifl.comm.messages import LOCAL, Message, Step, require
from mpifl.models import FlatModel
from mpifl.models.hyper import seeded
from mpifl.schema import limits
from mpifl.training.device import host_numpy
from mpifl.training.localstep import TrainedRows

TABLE_STREAM, NEWCOMER_STREAM = 0x5441424C45, 0x4E4557  # seed streams of the embedding table, new embeddings
NEWCOMER_PURPOSE = 2  # client_generator purposes from here on: a new client's adaptation steps


@dataclass(frozen=True)
class PFedHNOptions(HyperOptions):
    """pFedHN: a hypernetwork and one learned embedding per client on the server; a client's model is h(e_i)."""

    optimizer: Literal["sgd", "adam"] = "sgd"  # the server's optimizer of h and the embeddings
    lr: float = field(default=1e-2, metadata=limits(gt=0))  # the hypernetwork's learning rate
    momentum: float = field(default=0.9, metadata=limits(ge=0, lt=1))  # sgd
    weight_decay: float = field(default=1e-3, metadata=limits(ge=0))  # sgd
    embed_lr: float | None = field(default=None, metadata=limits(gt=0))  # the embeddings' lr; none: lr
    # round trips that adapt an unseen client's fresh embedding (h frozen) before each evaluation
    new_client_rounds: int = field(default=20, metadata=limits(ge=0))
    new_client_lr: float = field(default=1e-2, metadata=limits(gt=0))  # SGD (with ``momentum``) on new embeddings
    # per_client: a round's clients take turns, one hypernetwork step each (the authors' code, FL-Bench);
    # averaged: one step per round on the mean pseudo-gradient
    server_steps: Literal["per_client", "averaged"] = "per_client"


class PFedHNProtocol(HyperProtocol):
    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        self.turns = ctx.options.server_steps == "per_client"
        d = self.model_numel
        self.model_msg = Message("model", "down", d)
        self.delta_msg = Message("delta", "up", d, update=True)
        self.newcomer_model_msg = Message("newcomer_model", "down", d)
        self.newcomer_delta_msg = Message("newcomer_delta", "up", d)
        self.eval_model_msg = Message("eval_model", "down", d)

    def train_plan(self, round_: int) -> Sequence[Step]:
        return (self.model_msg, LOCAL, self.delta_msg)

    def newcomer_plan(self) -> Sequence[Step]:
        return (self.newcomer_model_msg, LOCAL, self.newcomer_delta_msg) * self.ctx.options.new_client_rounds

    def eval_plan(self) -> Sequence[Step]:
        return (self.eval_model_msg,)


class PFedHNServer(ServerAlgorithm):
    protocol_type: type[PFedHNProtocol] = PFedHNProtocol
    protocol: PFedHNProtocol
    networks = True

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        opts, n, dim = ctx.options, ctx.layout.num_clients, self.protocol.embed_dim
        self.device = device = ctx.server_device  # h, the embeddings and their optimizer; messages stay numpy
        self.hyper = self.protocol.new_hypernetwork()
        self.table = seeded(lambda: nn.Embedding(n, dim), ctx.cfg.seed, TABLE_STREAM)
        self.joint = FlatModel(nn.ModuleDict({"table": self.table, "hyper": self.hyper}).to(device))
        groups = [{"params": list(self.hyper.parameters())},
                  {"params": list(self.table.parameters()), "lr": opts.embed_lr or opts.lr}]
        self.optimizer = (torch.optim.SGD(groups, lr=opts.lr, momentum=opts.momentum, weight_decay=opts.weight_decay)
                          if opts.optimizer == "sgd" else torch.optim.Adam(groups, lr=opts.lr))
        gen = torch.Generator().manual_seed(int(np.random.SeedSequence([ctx.cfg.seed, NEWCOMER_STREAM])
                                                .generate_state(1)[0]))
        # new clients' embeddings by client id (rows of seen clients unused): the fixed start, N(0, 1) as
        # nn.Embedding's init, and where the last evaluation's adaptation took them
        unseen = torch.from_numpy(np.flatnonzero(ctx.layout.unseen))
        self.newcomer_init = torch.zeros(n, dim)
        self.newcomer_init[unseen] = torch.randn(len(unseen), dim, generator=gen)
        self.newcomer_init = self.newcomer_init.to(device)
        self.adapted = self.newcomer_init.clone()
        self.newcomers: torch.Tensor | None = None  # the adapting chunk's embeddings (leaf of the VJP)
        self.newcomer_velocity: torch.Tensor | None = None
        self.newcomer_steps = 0
        self.sent: np.ndarray | None = None  # the clients whose h(e_i) self.models holds (id order)
        self.models: torch.Tensor | None = None
        self.scalars: dict[str, float] = {}

    def handlers(self) -> Mapping[Message, Handler]:
        p = self.protocol
        return {p.model_msg: self.personal_models, p.delta_msg: self.step_hypernetwork,
                p.newcomer_model_msg: self.newcomer_models, p.newcomer_delta_msg: self.adapt_newcomers,
                p.eval_model_msg: self.evaluated_models}

    def personal_models(self, step: StepContext) -> np.ndarray:
        self.models = self.hyper(self.table(torch.tensor(step.clients, device=self.device)))
        self.sent = step.clients
        return host_numpy(self.models.detach())

    def newcomer_models(self, step: StepContext) -> np.ndarray:
        if self.newcomer_steps == 0:  # every evaluation adapts new clients afresh from the same start
            self.newcomers = self.newcomer_init[torch.tensor(step.clients, device=self.device)]
            self.newcomer_velocity = torch.zeros_like(self.newcomers)
        newcomers = require(self.newcomers, "the new clients' embeddings").requires_grad_(True)
        self.models = rowwise(self.hyper, newcomers)
        return host_numpy(self.models.detach())

    @torch.no_grad()
    def evaluated_models(self, step: StepContext) -> np.ndarray:
        ids = torch.tensor(step.clients, device=self.device)
        new = torch.from_numpy(self.ctx.layout.unseen[step.clients]).to(self.device)
        embeddings = torch.where(new[:, None], self.adapted[ids], self.table.weight[ids])
        return host_numpy(rowwise(self.hyper, embeddings))

    def step_hypernetwork(self, step: StepContext, rows: np.ndarray) -> None:
        """Only the accepted clients' rows of h(E), each with cotangent θ_i − θ_i^new."""
        self.joint.grads.zero_()
        models, sent = require(self.models, "the round's models"), require(self.sent, "their clients")
        if len(step.clients) < len(sent):
            models = models[rows_of(sent, step.clients)]
        models.backward(-torch.from_numpy(rows.copy()).to(self.device) / len(step.clients))
        self.scalars = {"update_norm": clip_(self.joint.grads, self.ctx.options.clip_norm)}
        self.optimizer.step()
        self.models = None

    def adapt_newcomers(self, step: StepContext, rows: np.ndarray) -> None:
        """Each new client's embedding follows its own gradient; h stays frozen."""
        opts = self.ctx.options
        newcomers = require(self.newcomers, "the new clients' embeddings")
        velocity = require(self.newcomer_velocity, "their momentum")
        cotangent = -torch.from_numpy(rows.copy()).to(self.device)
        (grad,) = torch.autograd.grad(require(self.models, "their models"), newcomers, cotangent)
        with torch.no_grad():
            velocity.mul_(opts.momentum).add_(grad)
            self.newcomers = newcomers.detach() - opts.new_client_lr * velocity
            self.adapted[torch.tensor(step.clients, device=self.device)] = self.newcomers
        self.newcomer_steps = (self.newcomer_steps + 1) % opts.new_client_rounds
        self.models = None

    def round_metrics(self) -> dict[str, float]:
        return self.scalars

    def final_state(self) -> dict[str, np.ndarray]:
        return {"hypernetwork": self.joint.numpy()[self.table.weight.numel() :].copy(),
                "client_embeddings": host_numpy(self.table.weight.detach()).copy()}


class PFedHNClient(HyperClient):
    protocol_type: type[PFedHNProtocol] = PFedHNProtocol
    protocol: PFedHNProtocol
    scratch: tuple[str, ...] = (*HyperClient.scratch, "newcomer_steps")

    def __init__(self, ctx: RunContext, data, state: ClientState | None = None):  # noqa: ANN001
        super().__init__(ctx, data, state)
        self.newcomer_steps: dict[int, int] = {}  # a new client's adaptation step within this evaluation

    def handlers(self) -> Mapping[Message, Handler]:
        p = self.protocol
        return {p.model_msg: self.receive_start, p.delta_msg: self.send_delta, p.newcomer_model_msg:
                self.receive_newcomer_start, p.newcomer_delta_msg: self.send_delta,
                p.eval_model_msg: self.receive_eval_model}

    def receive_newcomer_start(self, step: StepContext, client: int, row: np.ndarray) -> None:
        self.start[client] = row
        self.newcomer_steps[client] = self.newcomer_steps.get(client, -1) + 1

    def purpose(self, step: StepContext, client: int) -> int:
        return NEWCOMER_PURPOSE + self.newcomer_steps[client] if step.stage == "newcomer" else 0

    def local_end(self, step: StepContext, clients: list[int], trained: TrainedRows) -> None:
        super().local_end(step, clients, trained)
        if step.stage == "newcomer":  # a new client adapting its embedding: not a training loss
            for client in clients:
                self.round_losses.pop(client, None)
