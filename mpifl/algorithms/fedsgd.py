"""FedSGD: each sampled client returns one full-batch gradient at the global model; the server steps
θ ← θ − η_c·Σ (N_i/N_S)·g_i (η_c = client.lr) through the server optimizer (``server.*``: sgd with lr and
momentum, or an adaptive one, whose pseudo-gradient is then −η_c·Σ (N_i/N_S)·g_i).

Mini-batch FedSGD is FedAvg with ``client.steps: 1``; this is the variant Karula's Table 1 compares with
("clients return full gradients"), and Karula with t = 0 is its variance-reduced counterpart.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np

from mpifl.algorithms.base import Handler, RunContext, StepContext
from mpifl.algorithms.fedavg import FedAvgClient, FedAvgProtocol, FedAvgServer
from mpifl.comm.messages import LOCAL, Message, Step
from mpifl.training.device import host_numpy
from mpifl.training.executor import LocalStep


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
    kernel_on_cpu = False  # the loop under auto on the CPU, as before
    protocol_type: type[FedSGDProtocol] = FedSGDProtocol
    protocol: FedSGDProtocol

    def handlers(self) -> Mapping[Message, Handler]:
        return {**super().handlers(), self.protocol.grad_msg: self.send_delta}  # the gradient, kept as a delta

    def compute(self, step: StepContext, client: int) -> None:
        self.deltas[client] = self.gradient_at(client, self.start.pop(client))

    def local_step(self, step: StepContext) -> LocalStep | None:
        return None  # a full-batch gradient, not local SGD: compute, or the batch's full_gradients below

    def compute_clients(self, step: StepContext, clients: np.ndarray) -> np.ndarray:
        """In the batch, the full-batch gradients of a rank's equally sized clients as one computation (each
        reporting an equal share of the seconds)."""
        if not self.executor.batched:
            return super().compute_clients(step, clients)
        began = time.perf_counter()
        ids = [int(c) for c in clients]
        starts = [self.start.pop(c) for c in ids]
        grads, losses = self.executor.full_gradients(starts, [self.data[c].x_train for c in ids],
                                                       [self.data[c].y_train for c in ids])
        decay, rows = self.ctx.cfg.client.weight_decay, host_numpy(grads)
        for k, (client, start) in enumerate(zip(ids, starts)):
            self.deltas[client] = rows[k].copy()
            if decay:  # as gradient_at adds it
                self.deltas[client] += decay * start
            self.round_losses[client] = losses[k]
        self.trained_together += len(ids)
        return np.full(len(ids), (time.perf_counter() - began) / max(len(ids), 1))
