"""Per-FedAvg (Fallah, Mokhtari, Ozdaglar 2020), a baseline of PeFLL's Table 1 (pefll spec §4.2), as FL-Bench ran
it (``src/client/perfedavg.py``; PeFLL's baselines are built on FL-Bench; docs/papers/pefll_baselines.md).

The global model w is meta-trained for good one-step personalization. A client's round walks ``perfedavg.epochs``
passes over its training data (PeFLL: one; none: ``client.steps`` batches or ``client.epochs`` passes) in groups
of batches, one meta-step per group:

* first order (``variant: fo``), batches D, D′:  w′ = w − α∇f(w; D),  w ← w − β∇f(w′; D′);
* Hessian-free (``hf``), batches D, D′, D″: g = ∇f(w′; D′), and the Hessian-vector product of the true
  meta-gradient by finite differences, Hg ≈ (∇f(w + δg; D″) − ∇f(w − δg; D″)) / 2δ:  w ← w − β(g − αHg).

A round takes max(1, ⌊B/2⌋) meta-steps (``hf``: ⌊B/3⌋) for a client whose configured passes hold B
batches, drawing 2 (3) batches per meta-step as the passes walk on (FL-Bench: ⌊B/2⌋ per epoch, and none at
all for a client whose data fits one batch; mpifl takes one). The steps are plain (no momentum or weight
decay, as the meta-optimizer is plain SGD). The client sends Δw, and the server averages the deltas with equal
weights (FL-Bench gives every client weight 1; the paper averages uniformly too) through FedAvg's server
optimizer. Bytes per client and round are FedAvg's.

Evaluation (``personal``): every client, seen or unseen, personalizes the global model with
``personalize_epochs`` epochs of plain SGD at α on its own training data (FL-Bench: one epoch of its
fine-tuning), is evaluated, and forgets the result; ``global`` is the global model itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch import nn

from mpifl.algorithms.base import RunContext, StepContext
from mpifl.algorithms.fedavg import DeltaClient, FedAvgProtocol, FedAvgServer
from mpifl.schema import limits
from mpifl.training.config import ClientConfig
from mpifl.training.device import host_floats
from mpifl.training.executor import local_sgd
from mpifl.training.sgd import client_generator, planned_samples, planned_step_counts, training_batches

PERSONALIZE_PURPOSE = 3  # client_generator purpose of the evaluation-time personalization


@dataclass(frozen=True)
class PerFedAvgOptions:
    """Per-FedAvg: the global model meta-trained for one-step personalization; every client fine-tunes it before
    evaluation."""

    variant: Literal["fo", "hf"] = "fo"  # fo: first order; hf: Hessian-free (finite-difference Hessian-vector)
    alpha: float | None = field(default=None, metadata=limits(gt=0))  # inner (personalization) step; none: client.lr
    beta: float = field(default=1e-3, metadata=limits(gt=0))  # outer (meta) step (FL-Bench's default)
    delta: float = field(default=1e-3, metadata=limits(gt=0))  # hf: the finite difference's radius
    personalize_epochs: int = field(default=1, metadata=limits(ge=0))  # before evaluation
    epochs: int | None = field(default=1, metadata=limits(ge=1))  # a round's passes; none: client.steps/epochs


class PerFedAvgProtocol(FedAvgProtocol):
    eval_kinds = ("personal", "global")

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        self.delta_msg = dataclasses.replace(self.delta_msg, summed="uniform")  # the paper weighs clients equally

    def training_config(self) -> ClientConfig:
        """``client.*`` with ``perfedavg.epochs`` passes in place of the configured steps or epochs."""
        epochs = self.ctx.options.epochs
        cfg = self.ctx.cfg.client
        return cfg if epochs is None else cfg.for_epochs(epochs)

    @property
    def group(self) -> int:
        """Batches per meta-step."""
        return 3 if self.ctx.options.variant == "hf" else 2

    def batches(self, sizes: np.ndarray) -> np.ndarray:
        """Batches clients with ``sizes`` training samples draw in a round: whole groups, at least one."""
        return np.maximum(1, planned_step_counts(sizes, self.training_config()) // self.group) * self.group

    def samples_per_round(self) -> np.ndarray:
        """The round's batches; Hessian-free steps take two more gradients on every third batch."""
        sizes = self.ctx.layout.train_sizes
        samples = planned_samples(sizes, self.training_config(), self.batches(sizes))
        return samples * 4 // 3 if self.ctx.options.variant == "hf" else samples


class PerFedAvgServer(FedAvgServer):
    protocol_type: type[PerFedAvgProtocol] = PerFedAvgProtocol
    protocol: PerFedAvgProtocol

    def apply_deltas(self, step: StepContext, total: np.ndarray) -> None:
        self.model.step(total / len(step.clients))  # every client weighs 1 (the protocol's uniform sum)


class PerFedAvgClient(DeltaClient):
    protocol_type: type[PerFedAvgProtocol] = PerFedAvgProtocol
    protocol: PerFedAvgProtocol

    def __init__(self, ctx: RunContext, data, state=None):  # noqa: ANN001
        super().__init__(ctx, data, state)
        opts = ctx.options
        self.alpha = ctx.cfg.client.lr if opts.alpha is None else opts.alpha

    def gradient(self, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """∇f(params; x, y) and the loss (both left on the device): the executor's one gradient, no weight decay."""
        trained = self.gradient_on(params, x, y, decay=False)
        return trained.params[0], trained.loss_sums[0]

    def compute(self, step: StepContext, client: int) -> None:
        opts = self.ctx.options
        start = self.start.pop(client)
        w = torch.tensor(start, device=self.device)
        split = self.data[client]
        protocol = self.protocol
        batches = training_batches(split.x_train, split.y_train, protocol.training_config(),
                                   client_generator(self.ctx.cfg.seed, step.round, client),
                                   int(protocol.batches(np.array([len(split.x_train)]))[0]))
        losses = []
        for group in _groups(batches, protocol.group):
            inner, loss = self.gradient(w, *group[0])
            adapted = w - self.alpha * inner
            meta, _ = self.gradient(adapted, *group[1])
            if opts.variant == "hf":
                plus, _ = self.gradient(w + opts.delta * meta, *group[2])
                minus, _ = self.gradient(w - opts.delta * meta, *group[2])
                meta = meta - self.alpha * (plus - minus) / (2 * opts.delta)
            w = w - opts.beta * meta
            losses.append(loss)
        self.round_losses[client] = float(np.mean(host_floats(losses))) if losses else float("nan")  # one read
        self.workspace.load(w)
        self.deltas[client] = self.workspace.numpy() - start

    def eval_model(self, step: StepContext, client: int, kind: str) -> nn.Module:
        model = super().eval_model(step, client, kind)  # the global model, in the workspace
        epochs = self.ctx.options.personalize_epochs
        if kind == "personal" and epochs:  # a fresh personalization each evaluation, from the global model
            split = self.data[client]
            config = dataclasses.replace(self.ctx.cfg.client.for_epochs(epochs), lr=self.alpha, momentum=0.0,
                                         weight_decay=0.0)
            local_sgd(self.workspace, split.x_train, split.y_train, self.loss_fn, config,
                      client_generator(self.ctx.cfg.seed, step.round, client, PERSONALIZE_PURPOSE))
        return model


def _groups(batches: Iterator[tuple[torch.Tensor, torch.Tensor]], size: int
            ) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Consecutive batches ``size`` at a time."""
    group: list[tuple[torch.Tensor, torch.Tensor]] = []
    for batch in batches:
        group.append(batch)
        if len(group) == size:
            yield group
            group = []
