"""FedProx (Li et al. 2020): FedAvg whose local objective adds the proximal term (μ/2)·‖w − x‖².

The only change is the local gradient, g + μ(w − x) with x the round's global model; messages and
bytes are FedAvg's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from mpifl.algorithms.fedavg import FedAvgClient
from mpifl.schema import limits
from mpifl.training.sgd import GradHook


@dataclass(frozen=True)
class FedProxOptions:
    """FedProx: FedAvg with a proximal term on the local objective."""

    mu: float = field(default=0.01, metadata=limits(ge=0))  # μ of the proximal term (μ/2)·‖w − x‖²


class FedProxClient(FedAvgClient):
    def grad_hook(self, client: int, start: np.ndarray) -> GradHook:
        anchor = torch.tensor(start, device=self.device)  # a copy: ``start`` may be a read-only received view
        mu = self.ctx.options.mu

        def hook(params: torch.Tensor, grads: torch.Tensor) -> None:
            grads.add_(params - anchor, alpha=mu)

        return hook
