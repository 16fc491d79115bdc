"""FedSGD: each sampled client returns one full-batch gradient at the global model; the server steps
θ ← θ − η_c·Σ (N_i/N_S)·g_i (η_c = client.lr) through the server optimizer (``server.*``: sgd with lr and
momentum, or an adaptive one, whose pseudo-gradient is then −η_c·Σ (N_i/N_S)·g_i).

Mini-batch FedSGD is FedAvg with ``client.steps: 1``; this is the variant Karula's Table 1 compares with
("clients return full gradients"), and Karula with t = 0 is its variance-reduced counterpart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from mpifl.algorithms.base import Handler, RunContext, StepContext
from mpifl.algorithms.fedavg import FedAvgClient, FedAvgProtocol, FedAvgServer
from mpifl.comm.messages import LOCAL, Message, Step
from mpifl.training.localstep import LocalStep


class FedSGDProtocol(FedAvgProtocol):
    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        self.grad_msg = Message("gradient", "up", self.delta_msg.numel, update=True, summed="weighting")

    def train_plan(self, round_: int) -> Sequence[Step]:
        return (self.model_msg, LOCAL, self.grad_msg)

    def samples_per_round(self) -> np.ndarray:
        return self.ctx.layout.train_sizes.copy()  # one full-batch gradient


class FedSGDServer(FedAvgServer):
    protocol_type: type[FedSGDProtocol] = FedSGDProtocol
    protocol: FedSGDProtocol

    def handlers(self) -> Mapping[Message, Handler]:
        return {**super().handlers(), self.protocol.grad_msg: self.apply_gradients}

    def apply_gradients(self, step: StepContext, total: np.ndarray) -> None:
        self.model.step(-self.ctx.cfg.client.lr * (total / self.ctx.divisor(step.clients)))


class FedSGDClient(FedAvgClient):
    """FedAvg's client whose local step is one full-batch gradient (:attr:`LocalStep.gradient`), kept as its
    delta: the loop or the vectorized path, as the executor chooses."""

    vectorized_on_cpu = False  # the loop under auto on the CPU, as before
    protocol_type: type[FedSGDProtocol] = FedSGDProtocol
    protocol: FedSGDProtocol

    def handlers(self) -> Mapping[Message, Handler]:
        return {**super().handlers(), self.protocol.grad_msg: self.send_delta}  # the gradient, kept as a delta

    def local_step(self, step: StepContext) -> LocalStep | None:
        return LocalStep(gradient=True)
