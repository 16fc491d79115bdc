"""FedProx (Li et al. 2020): FedAvg whose local objective adds the proximal term (μ/2)·‖w − x‖².

The only change is the local gradient, g + μ(w − x) with x the round's global model; messages and
bytes are FedAvg's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from mpifl.algorithms.base import StepContext
from mpifl.algorithms.fedavg import FedAvgClient
from mpifl.schema import limits
from mpifl.training.localstep import GradTransform, LocalStep


@dataclass(frozen=True)
class FedProxOptions:
    """FedProx: FedAvg with a proximal term on the local objective."""

    mu: float = field(default=0.01, metadata=limits(ge=0))  # μ of the proximal term (μ/2)·‖w − x‖²


class FedProxClient(FedAvgClient):
    vectorized_on_cpu = False  # the loop under auto on the CPU, as before

    def local_step(self, step: StepContext) -> LocalStep | None:
        return LocalStep(proximal(self.ctx.options.mu), delta=True)


def proximal(mu: float) -> GradTransform:
    """g ← g + μ(w − x) on every row, x its start (the round's global model)."""

    def transform(params: torch.Tensor, grads: torch.Tensor, rows: Mapping[str, torch.Tensor]) -> None:
        grads.add_(params - rows["start"], alpha=mu)

    return transform
