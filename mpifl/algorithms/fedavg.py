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
from mpifl.training.localstep import LocalStep, TrainedRows


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


STEP_SPAN = 1 << 14
"""Entries of the server step computed together: its temporaries (a few float64 arrays of this size) stay in cache."""


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

    def step(self, mean_delta: np.ndarray, part: slice | int = slice(None), divisor: float | None = None) -> None:
        """Apply the averaged delta (``mean_delta``, or with ``divisor`` the sum ``mean_delta / divisor``); ``part``
        updates a slice of the model only (FedALS, FedRep's body) or one row (one of IFCA's cluster models), element
        for element as a whole-model update would. It runs ``STEP_SPAN`` entries at a time, every operation of the
        step on a span while it is in the core's cache: rank 0 does this while every worker waits for the next
        broadcast (a W2 model's 1.6 M float64 entries: several times faster than whole-array passes), with the bits of
        the whole-array expressions, as each is elementwise."""
        whole = isinstance(part, slice) and part == slice(None)
        # a new array: clients on this rank may still hold views of the old one
        params = np.empty_like(self.params) if whole else self.params.copy()
        state = (self.velocity,) if self.server.optimizer == "sgd" else (self.first_moment, self.second_moment)
        views = [params[part], self.params[part], mean_delta, *(array[part] for array in state)]
        if all(view.flags.c_contiguous and view.shape == views[0].shape for view in views):
            views = [view.reshape(-1) for view in views]  # views, not copies: contiguous
            spans = [slice(start, start + STEP_SPAN) for start in range(0, len(views[0]), STEP_SPAN)]
        else:
            spans = [slice(None)]  # one span of any shape (mean_delta broadcast, say)
        new, old, delta, *moments = views
        scratch = np.empty(delta.size if len(spans) == 1 else STEP_SPAN)  # the mean's span
        for span in spans:
            piece = delta[span]
            out = scratch[: piece.size].reshape(piece.shape)
            mean = piece if divisor is None else np.divide(piece, divisor, out=out)
            moved = np.add(old[span], self._update(mean, [moment[span] for moment in moments]), dtype=np.float64)
            new[span] = moved  # rounded to float32, as astype does
        self.params = params

    def _update(self, delta: np.ndarray, state: list[np.ndarray]) -> np.ndarray:
        """The step to add to the parameters, the optimizer's ``state`` there (views: the velocity, or the first and
        second moments) advanced in place by ``delta``."""
        if self.server.optimizer == "sgd":  # v ← μ·v + Δ in place, each product and sum rounded as before
            velocity = state[0]
            np.multiply(velocity, self.server.momentum, out=velocity)
            np.add(velocity, delta, out=velocity)
            return velocity if self.server.lr == 1.0 else self.server.lr * velocity  # 1.0·v is v, bit for bit
        server, (m, v) = self.server, state
        m[...] = server.beta1 * m + (1 - server.beta1) * delta
        square = delta * delta
        if server.optimizer == "adagrad":
            v[...] = v + square
        elif server.optimizer == "yogi":
            v[...] = v - (1 - server.beta2) * square * np.sign(v - square)
        else:
            v[...] = server.beta2 * v + (1 - server.beta2) * square
        return server.lr * m / (np.sqrt(v) + server.tau)


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
        self.model.step(total, divisor=self.ctx.divisor(step.clients))

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

    vectorized_on_cpu = True
    retired = {"grad_hook": "local_step (its LocalStep's transform changes each gradient)",
               "after_training": "local_end (it is handed the call's clients and their trained rows)",
               "make_vectorizer": "local_step (client.vectorize chooses how its step runs)"}

    def local_step(self, step: StepContext) -> LocalStep | None:
        return LocalStep(delta=True)

    def local_start(self, step: StepContext, client: int) -> ClientStart:
        return ClientStart(self.start.pop(client))

    def local_end(self, step: StepContext, clients: list[int], trained: TrainedRows) -> None:
        """Each client's delta: rows of one device tensor on a GPU (a summed upload is screened and folded there,
        never copied out client by client), host views on the CPU (:meth:`sent_rows`)."""
        rows = self.sent_rows(trained)
        self.deltas.update((client, rows[k]) for k, client in enumerate(clients))
