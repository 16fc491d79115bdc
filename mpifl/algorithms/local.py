"""Local training: every client trains its own model from the common initialization, never communicating.

The lower reference point of personalized FL. Two schedules (``local.mode``):

* ``rounds`` (default): each round the sampled seen clients train (``client.*``) their own model further;
  unseen clients never train, so they are evaluated with the initial model.
* ``all``: PeFLL's Local (spec §4.2): before round 1 every client, seen and unseen, trains its own model for
  ``local.epochs`` epochs (200 in the paper); the rounds then only evaluate. This is the protocol the PeFLL
  paper reports for unseen clients.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from torch import nn

from mpifl.algorithms.base import Protocol, RunContext, ServerAlgorithm, StepContext
from mpifl.algorithms.state import ClientState
from mpifl.algorithms.toolkit import ClientToolkit
from mpifl.comm.messages import LOCAL, Step
from mpifl.schema import limits
from mpifl.training.config import ClientConfig


@dataclass(frozen=True)
class LocalOptions:
    """Local training only: no communication."""

    # rounds: each round's sampled seen clients train their own model further (unseen clients keep the initial
    # one); all: PeFLL's Local, every client, unseen too, trains epochs epochs before round 1
    mode: Literal["rounds", "all"] = "rounds"
    epochs: int = field(default=200, metadata=limits(ge=1))  # mode all: each client's epochs before round 1


class LocalProtocol(Protocol):
    eval_kinds = ("local",)

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        self.upfront = ctx.options.mode == "all"
        self.setup_includes_unseen = self.upfront

    def setup_plan(self) -> Sequence[Step]:
        return (LOCAL,) if self.upfront else ()

    def train_plan(self, round_: int) -> Sequence[Step]:
        return () if self.upfront else (LOCAL,)

    def samples_per_round(self) -> np.ndarray:
        sizes = self.ctx.layout.train_sizes
        return np.zeros(len(sizes), dtype=np.int64) if self.upfront else super().samples_per_round()

    def upfront_config(self) -> ClientConfig:
        """``client.*`` with ``local.epochs`` passes in place of the configured steps or epochs."""
        return self.ctx.cfg.client.for_epochs(self.ctx.options.epochs)


class LocalServer(ServerAlgorithm):
    """Nothing to hold: no global state exists."""

    protocol_type: type[LocalProtocol] = LocalProtocol
    protocol: LocalProtocol


class LocalClient(ClientToolkit):
    protocol_type: type[LocalProtocol] = LocalProtocol
    protocol: LocalProtocol

    def __init__(self, ctx: RunContext, data, state: ClientState | None = None):  # noqa: ANN001
        super().__init__(ctx, data, state)
        self.initial = self.workspace.numpy().copy()
        self.vectorizer = self.vectorizer_if(cpu_default=False)

    def compute(self, step: StepContext, client: int) -> None:
        self.workspace.load(self.model(client))
        self.train_workspace(step, client, config=self.config(step))
        self.state.edit(client)["model"] = self.workspace.numpy().copy()

    def compute_clients(self, step: StepContext, clients: np.ndarray) -> np.ndarray:
        """With the kernel, each client trains its own model, those with equally many local steps together."""
        if self.vectorizer is None:
            return super().compute_clients(step, clients)
        starts = {int(c): self.model(int(c)) for c in clients}
        trained, seconds = self.train_together(self.vectorizer, step, starts, config=self.config(step))
        for client, params in trained.items():
            self.state.edit(client)["model"] = params.copy()
        return seconds

    def config(self, step: StepContext) -> ClientConfig | None:
        """``local.epochs`` passes in the set-up (mode ``all``), else ``client.*`` (None)."""
        return self.protocol.upfront_config() if step.stage == "setup" else None

    def model(self, client: int) -> np.ndarray:
        return self.state.get(client, "model", self.initial)

    def eval_model(self, step: StepContext, client: int, kind: str) -> nn.Module:
        self.workspace.load(self.model(client))
        return self.workspace.module
