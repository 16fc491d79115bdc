"""FedRep (Collins et al. 2021), a baseline of PeFLL's Table 1 (pefll spec §4.2), as FL-Bench ran it
(``src/client/fedrep.py``; docs/papers/pefll_baselines.md).

The model splits into a shared body (representation) φ and a personal head h: the last ``head_layers`` layer
groups (:func:`~mpifl.models.flat.layer_groups`; PeFLL's LeNet: the output Linear). A sampled client

1. loads the server's φ and its own head (the initial model's head the first time),
2. trains the head for ``head_epochs`` epochs with φ frozen, then φ for ``body_epochs`` epochs with h frozen
   (local SGD, ``client.*``; PeFLL: 5 and 1),
3. keeps h in its client state and sends Δφ; the server averages the Δφ by sample count (FedAvg's server
   optimizer, on φ only).

Only φ travels: per client and round |φ| floats down and |φ| up, 2·|φ|·4 bytes; h never leaves its worker.
Evaluation: a seen client uses φ with its own head (the initial head if it was never sampled; FL-Bench hands
such a client the server's average of the heads trained so far, since its server averages every parameter, the
head included, and a client's own head replaces it once it has one: docs/papers/pefll_baselines.md); an unseen
client (pefll spec §4.2) trains a fresh head from the initial one for
``new_head_epochs`` epochs (20) on its training data with φ frozen, is evaluated, and forgets it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from mpifl.algorithms.base import Handler, RunContext, ServerAlgorithm, StepContext
from mpifl.algorithms.fedavg import DeltaClient, FedAvgProtocol, GlobalModel
from mpifl.comm.messages import Message, require
from mpifl.models.flat import layer_groups
from mpifl.schema import ConfigError, limits
from mpifl.training.executor import local_sgd
from mpifl.training.localstep import ClientStart, LocalStep, TrainedRows, TrainStats
from mpifl.training.sgd import client_generator, planned_samples

NEW_HEAD_PURPOSE = 4  # client_generator purpose of an unseen client's head training


@dataclass(frozen=True)
class FedRepOptions:
    """FedRep: a shared body and a personal head per client; only the body travels."""

    head_epochs: int = field(default=5, metadata=limits(ge=0))  # per round, body frozen (PeFLL: 5)
    body_epochs: int = field(default=1, metadata=limits(ge=0))  # per round, head frozen (PeFLL: 1)
    new_head_epochs: int = field(default=20, metadata=limits(ge=0))  # an unseen client's head, before evaluation
    head_layers: int = field(default=1, metadata=limits(ge=1))  # the last layer groups that are personal


class FedRepProtocol(FedAvgProtocol):
    """FedAvg's plan with the body in place of the model."""

    eval_kinds = ("personal",)

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        model = ctx.new_model()
        groups = layer_groups(model)
        layers = ctx.options.head_layers
        if layers >= len(groups):
            raise ConfigError(f"fedrep.head_layers: {layers} leaves no body of the model's {len(groups)} layer groups")
        boundary = groups[-layers].start
        self.body, self.head = slice(0, boundary), slice(boundary, model.numel)
        self.model_msg = Message("body", "down", boundary, broadcast=True)
        self.delta_msg = Message("body_delta", "up", boundary, update=True, summed="weighting")
        self.eval_msg = Message("eval_body", "down", boundary, broadcast=True)

    def client_state(self) -> dict[str, int]:
        return {"head": 4 * (self.head.stop - self.head.start)}  # float32

    def samples_per_round(self) -> np.ndarray:
        opts, client = self.ctx.options, self.ctx.cfg.client
        sizes = self.ctx.layout.train_sizes
        return planned_samples(sizes, client.for_epochs(opts.head_epochs)) + planned_samples(
            sizes, client.for_epochs(opts.body_epochs))


class FedRepServer(ServerAlgorithm):
    """The body: FedAvg's global model and server optimizer restricted to φ (the head entries stay initial)."""

    protocol_type: type[FedRepProtocol] = FedRepProtocol
    protocol: FedRepProtocol
    server_optimizer = True

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        self.model = GlobalModel(ctx)

    def handlers(self) -> Mapping[Message, Handler]:
        p = self.protocol
        return {p.model_msg: self.global_body, p.eval_msg: self.global_body, p.delta_msg: self.apply_deltas}

    def global_body(self, step: StepContext) -> np.ndarray:
        return self.model.params[self.protocol.body]

    def apply_deltas(self, step: StepContext, total: np.ndarray) -> None:
        self.model.step(total / self.ctx.divisor(step.clients), self.protocol.body)

    def final_state(self) -> dict[str, np.ndarray]:
        return {"body": self.model.params[self.protocol.body]}


class FedRepClient(DeltaClient):
    """FedAvg's client plumbing on the body (``global_params`` is the evaluated body)."""

    protocol_type: type[FedRepProtocol] = FedRepProtocol
    protocol: FedRepProtocol

    def __init__(self, ctx: RunContext, data, state=None):  # noqa: ANN001
        super().__init__(ctx, data, state)
        self.initial_head = self.workspace.numpy()[self.protocol.head].copy()
        self.bodies: dict[int, np.ndarray] = {}  # each training client's received body, until its delta is taken

    def head(self, client: int) -> np.ndarray:
        return self.state.get(client, "head", self.initial_head)

    def load(self, body: np.ndarray, head: np.ndarray) -> None:
        params = self.workspace.numpy()  # a view on the CPU; the staging buffer's copy on a GPU
        params[self.protocol.body], params[self.protocol.head] = body, head
        self.workspace.load(params)

    def train_part(self, client: int, part: slice, epochs: int, generator: torch.Generator) -> TrainStats:
        """``epochs`` of local SGD on the ``part`` of the workspace model, the rest frozen (none for 0)."""
        split = self.data[client]
        return local_sgd(self.workspace, split.x_train, split.y_train, self.loss_fn,
                         self.ctx.cfg.client.for_epochs(epochs), generator, part=part)

    def local_step(self, step: StepContext) -> tuple[LocalStep, ...]:
        """Two phases with one generator: the head with the body frozen, then the body with the head frozen."""
        opts, protocol, cfg = self.ctx.options, self.protocol, self.ctx.cfg.client
        return (LocalStep(config=cfg.for_epochs(opts.head_epochs), part=protocol.head),
                LocalStep(config=cfg.for_epochs(opts.body_epochs), part=protocol.body))

    def local_start(self, step: StepContext, client: int) -> ClientStart:
        """The server's body with the client's own head."""
        body = self.bodies[client] = self.start.pop(client)
        params = np.empty(self.workspace.numel, dtype=body.dtype)
        params[self.protocol.body], params[self.protocol.head] = body, self.head(client)
        return ClientStart(params)

    def local_end(self, step: StepContext, clients: list[int], trained: TrainedRows) -> None:
        """The head stays in the client's state; the body's change is sent."""
        protocol = self.protocol
        for client, params in zip(clients, trained.host("params")[0]):
            self.state.edit(client)["head"] = params[protocol.head].copy()
            self.deltas[client] = params[protocol.body] - self.bodies.pop(client)

    def eval_model(self, step: StepContext, client: int, kind: str) -> nn.Module:
        body = require(self.global_params, "the evaluated body")
        if not self.ctx.layout.unseen[client]:
            self.load(body, self.head(client))
            return self.workspace.module
        self.load(body, self.initial_head)  # a newcomer: a head of its own on the frozen body, forgotten after
        generator = client_generator(self.ctx.cfg.seed, step.round, client, NEW_HEAD_PURPOSE)
        self.train_part(client, self.protocol.head, self.ctx.options.new_head_epochs, generator)
        return self.workspace.module
