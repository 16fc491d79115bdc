"""FedAvg (McMahan et al.): broadcast the global model, train locally, average the deltas by sample count.

Server step: θ ← θ + η_s·v with v ← μ_s·v + Σᵢ (nᵢ/n)·Δᵢ; η_s = 1, μ_s = 0 is plain FedAvg. The deltas travel as
one exact sum Σᵢ nᵢ·Δᵢ (a summed message), divided by n on the server. With
``server.optimizer: adam | yogi | adagrad`` the averaged delta goes through Reddi et al.'s adaptive server
optimizers instead (:class:`GlobalModel`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import nn

from mpifl.algorithms.base import Handler, Protocol, RunContext, ServerAlgorithm, StepContext
from mpifl.algorithms.state import ClientState
from mpifl.algorithms.toolkit import ClientStart, ClientToolkit
from mpifl.comm.messages import LOCAL, Message, Step, require
from mpifl.training.executor import LocalStep, TrainedRows


class FedAvgProtocol(Protocol):
    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        numel = ctx.new_model().numel
        self.model_msg = Message("model", "down", numel, broadcast=True)
        # the server needs only Σ wᵢ·Δᵢ: it travels as an exact sum (mpifl.comm.exactsum), never as rows
        self.delta_msg = Message("delta", "up", numel, update=True, summed="weighting")
        self.eval_msg = Message("eval_model", "down", numel, broadcast=True)

    def train_plan(self, round_: int) -> Sequence[Step]:
        return (self.model_msg, LOCAL, self.delta_msg)

    def eval_plan(self) -> Sequence[Step]:
        return (self.eval_msg,)


class GlobalModel:
    """The global model of FedAvg-style algorithms and the server optimizer (``server.*``) on averaged
    pseudo-gradients Δ. ``sgd``: θ ← θ + η·v with v ← μ·v + Δ. The adaptive ones are Reddi et al.'s Algorithm 2
    (FedAdam, FedYogi, FedAdagrad): m ← β₁·m + (1 − β₁)·Δ, then

    * adagrad: v ← v + Δ²
    * yogi: v ← v − (1 − β₂)·Δ²·sign(v − Δ²)
    * adam: v ← β₂·v + (1 − β₂)·Δ²

    and θ ← θ + η·m / (√v + τ), from m = 0 and v = τ² (the paper's v₋₁ ≥ τ²; no bias correction, as in the
    paper). The state is float64, one entry per parameter, and part of the checkpoint."""

    def __init__(self, ctx: RunContext, params: np.ndarray | None = None):
        self.params = ctx.new_model().numpy().copy() if params is None else params
        self.server = ctx.cfg.server  # frozen: rebuilt from the config on resume
        if self.server.optimizer == "sgd":
            self.velocity = np.zeros(self.params.shape, dtype=np.float64)
        else:
            self.first_moment = np.zeros(self.params.shape, dtype=np.float64)
            self.second_moment = np.full(self.params.shape, self.server.tau**2, dtype=np.float64)

    def step(self, mean_delta: np.ndarray, part: slice | int = slice(None)) -> None:
        """Apply the averaged delta; ``part`` updates a slice of the model only (FedALS, FedRep's body) or one
        row (one of IFCA's cluster models), element for element as a whole-model update would."""
        params = self.params.copy()  # a new array: clients on this rank may still hold views of the old one
        params[part] = (params[part] + self._update(mean_delta, part)).astype(np.float32)
        self.params = params

    def _update(self, delta: np.ndarray, part: slice | int) -> np.ndarray:
        """The step to add to ``params[part]``, the optimizer's state there advanced by ``delta``."""
        if self.server.optimizer == "sgd":
            self.velocity[part] = self.server.momentum * self.velocity[part] + delta
            return self.server.lr * self.velocity[part]
        server, m, v = self.server, self.first_moment, self.second_moment
        m[part] = server.beta1 * m[part] + (1 - server.beta1) * delta
        square = delta * delta
        if server.optimizer == "adagrad":
            v[part] = v[part] + square
        elif server.optimizer == "yogi":
            v[part] = v[part] - (1 - server.beta2) * square * np.sign(v[part] - square)
        else:
            v[part] = server.beta2 * v[part] + (1 - server.beta2) * square
        return server.lr * m[part] / (np.sqrt(v[part]) + server.tau)


class FedAvgServer(ServerAlgorithm):
    protocol_type: type[FedAvgProtocol] = FedAvgProtocol
    protocol: FedAvgProtocol
    server_optimizer = True

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        self.model = GlobalModel(ctx)

    @property
    def params(self) -> np.ndarray:
        return self.model.params

    def handlers(self) -> Mapping[Message, Handler]:
        p = self.protocol
        return {p.model_msg: self.global_params, p.eval_msg: self.global_params, p.delta_msg: self.apply_deltas}

    def global_params(self, step: StepContext) -> np.ndarray:
        return self.params

    def apply_deltas(self, step: StepContext, total: np.ndarray) -> None:
        """``total``: Σ wᵢ·Δᵢ over the accepted clients (sample counts, or one each): their mean is it over
        ``RunContext.divisor``."""
        self.model.step(total / self.ctx.divisor(step.clients))

    def final_state(self) -> dict[str, np.ndarray]:
        return {"global_model": self.params}


class DeltaClient(ClientToolkit):
    """The client side of a FedAvg-style plan: each participant receives its start point (``model_msg``),
    trains, and sends its delta (``delta_msg``); ``eval_msg`` brings the parameters evaluation starts from."""

    protocol_type: type[FedAvgProtocol] = FedAvgProtocol
    protocol: FedAvgProtocol
    scratch: tuple[str, ...] = ("start", "deltas")

    def __init__(self, ctx: RunContext, data, state: ClientState | None = None):  # noqa: ANN001
        super().__init__(ctx, data, state)
        self.start: dict[int, np.ndarray] = {}
        self.deltas: dict[int, np.ndarray | torch.Tensor] = {}  # a tensor on a GPU (FedAvgClient.compute)
        self.global_params: np.ndarray | None = None

    def handlers(self) -> Mapping[Message, Handler]:
        p = self.protocol
        return {p.model_msg: self.receive_start, p.eval_msg: self.receive_evaluated, p.delta_msg: self.send_delta}

    def receive_start(self, step: StepContext, client: int, row: np.ndarray) -> None:
        self.start[client] = row

    def receive_evaluated(self, step: StepContext, client: int, row: np.ndarray) -> None:
        self.global_params = row

    def send_delta(self, step: StepContext, client: int) -> np.ndarray | torch.Tensor:
        return self.deltas.pop(client)

    def eval_model(self, step: StepContext, client: int, kind: str) -> nn.Module:
        self.workspace.load(require(self.global_params, "the evaluated model"))
        return self.workspace.module


class FedAvgClient(DeltaClient):
    """Local SGD from the received start; the delta stays where it was trained (on a GPU the fold runs there).
    A variant changes the step's gradient (:meth:`local_step`: FedProx, SCAFFOLD) and what it keeps
    (:meth:`local_end`)."""

    kernel_on_cpu = True

    def local_step(self, step: StepContext) -> LocalStep | None:
        return LocalStep(delta=True)

    def local_start(self, step: StepContext, client: int) -> ClientStart:
        return ClientStart(self.start.pop(client))

    def local_end(self, step: StepContext, clients: list[int], trained: TrainedRows) -> None:
        """Each client's delta: rows of one device tensor on a GPU (a summed upload is screened and folded there,
        never copied out client by client), host views on the CPU."""
        rows = trained.params if trained.params.device.type != "cpu" else trained.host("params")[0]
        self.deltas.update((client, rows[k]) for k, client in enumerate(clients))
