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
from mpifl.algorithms.toolkit import ClientStart, ClientToolkit
from mpifl.comm.messages import LOCAL, Step
from mpifl.schema import limits
from mpifl.training.config import ClientConfig
from mpifl.training.localstep import LocalStep, TrainedRows


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

    def client_state(self) -> dict[str, int]:
        return {"model": 4 * self.ctx.new_model().numel}  # float32 (asked once, before round 1)

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

    def local_step(self, step: StepContext) -> LocalStep | None:
        return LocalStep(config=self.config(step))

    def local_start(self, step: StepContext, client: int) -> ClientStart:
        return ClientStart(self.model(client))

    def local_end(self, step: StepContext, clients: list[int], trained: TrainedRows) -> None:
        rows = trained.host("params")[0]
        for k, client in enumerate(clients):
            self.state.edit(client)["model"] = rows[k].copy()

    def config(self, step: StepContext) -> ClientConfig | None:
        """``local.epochs`` passes in the set-up (mode ``all``), else ``client.*`` (None)."""
        return self.protocol.upfront_config() if step.stage == "setup" else None

    def model(self, client: int) -> np.ndarray:
        return self.state.get(client, "model", self.initial)

    def eval_model(self, step: StepContext, client: int, kind: str) -> nn.Module:
        self.workspace.load(self.model(client))
        return self.workspace.module
