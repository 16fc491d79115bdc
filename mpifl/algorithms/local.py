"""Local training: every client trains its own model from the common initialization, never communicating.

The lower reference point of personalized FL; a sampled client trains once per round.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from torch import nn

from mpifl.algorithms.base import ClientAlgorithm, Protocol, RunContext, ServerAlgorithm
from mpifl.comm.messages import LOCAL, Step


class LocalProtocol(Protocol):
    eval_kinds = ("local",)

    def train_plan(self, round_: int) -> Sequence[Step]:
        return (LOCAL,)


class LocalServer(ServerAlgorithm):
    """Nothing to hold: no global state exists."""

    protocol_type = LocalProtocol


class LocalClient(ClientAlgorithm):
    protocol_type = LocalProtocol

    def __init__(self, ctx: RunContext, data):  # noqa: ANN001
        super().__init__(ctx, data)
        self.initial = self.workspace.numpy().copy()
        self.models: dict[int, np.ndarray] = {}

    def compute(self, round_: int, client: int) -> None:
        self.workspace.load(self.models.get(client, self.initial))
        self.train_workspace(round_, client)
        self.models[client] = self.workspace.numpy().copy()

    def eval_model(self, client: int, kind: str) -> nn.Module:
        self.workspace.load(self.models.get(client, self.initial))
        return self.workspace.module
