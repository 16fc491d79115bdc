"""FedAsync (Xie, Koyejo & Gupta, "Asynchronous Federated Optimization", 2019; APPFL ships it).

The server keeps ``concurrency`` clients training at once. A client downloads the current model θ, runs local
SGD and uploads its trained model θᵢ; the moment it arrives the server mixes it in:

    θ ← (1 − α_τ)·θ + α_τ·θᵢ,   α_τ = α·s(τ),

τ being the server steps taken since the client downloaded, and s the staleness function: ``constant`` s = 1,
``polynomial`` s(τ) = (1 + τ)^(−a), ``hinge`` s(τ) = 1 for τ ≤ b, else 1/(a·(τ − b) + 1) (the paper's §5).
Every arrival is one server step, so one engine round is one arrival; an arrival whose model never came (a
dropped client, a rejected upload) leaves θ as it is. The runtime orders the events on the simulated clock
(:class:`~mpifl.algorithms.base.EventDrivenServer`, ``mpifl.runtime.asynchronous``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from torch import nn

from mpifl.algorithms.base import (
    AsynchronousProtocol,
    EventDrivenServer,
    Handler,
    RunContext,
    StepContext,
)
from mpifl.algorithms.context import AsynchronousOptions
from mpifl.algorithms.state import ClientState
from mpifl.algorithms.toolkit import ClientStart, ClientToolkit, send_from
from mpifl.comm.messages import LOCAL, Message, Step, require
from mpifl.schema import limits
from mpifl.training.localstep import LocalStep, TrainedRows


@dataclass(frozen=True)
class FedAsyncOptions(AsynchronousOptions):
    """FedAsync: asynchronous; every arrival mixed into the global model at once, weighted α·s(staleness). Needs
    network.compute: model; no deadline, over-selection, DP, SecAgg or server link."""

    alpha: float = field(default=0.6, metadata=limits(gt=0, le=1))  # α: the weight of a fresh model in the mix
    staleness: Literal["constant", "polynomial", "hinge"] = "polynomial"  # s(τ), how staleness damps α
    a: float = field(default=0.5, metadata=limits(ge=0))  # s(τ)'s decay: the polynomial's exponent, the hinge's slope
    b: int = field(default=4, metadata=limits(ge=0))  # hinge: the staleness still mixed in at full weight


def staleness_weight(opts: FedAsyncOptions, tau: int) -> float:
    """s(τ) of the options' staleness function."""
    if opts.staleness == "polynomial":
        return float((1.0 + tau) ** -opts.a)
    if opts.staleness == "hinge":
        return 1.0 if tau <= opts.b else 1.0 / (opts.a * (tau - opts.b) + 1.0)
    return 1.0


class FedAsyncProtocol(AsynchronousProtocol):
    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        numel = ctx.new_model().numel
        self.model_msg = Message("model", "down", numel, broadcast=True)
        self.upload_msg = Message("local_model", "up", numel)
        self.eval_msg = Message("eval_model", "down", numel, broadcast=True)

    def train_plan(self, round_: int) -> Sequence[Step]:
        return (self.model_msg, LOCAL, self.upload_msg)

    def eval_plan(self) -> Sequence[Step]:
        return (self.eval_msg,)


class FedAsyncServer(EventDrivenServer):
    protocol_type = FedAsyncProtocol
    protocol: FedAsyncProtocol

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        self.params = ctx.new_model().numpy().copy()
        self.mixed: tuple[float, float] = (np.nan, np.nan)  # the last step's (staleness, α_τ)

    def handlers(self) -> Mapping[Message, Handler]:
        p = self.protocol
        return {p.model_msg: self.global_params, p.eval_msg: self.global_params, p.upload_msg: self.hold}

    def global_params(self, step: StepContext) -> np.ndarray:
        return self.params

    def on_arrival(self, client: int, upload: np.ndarray | None, staleness: int) -> bool:
        """Mix the arriving model in (a new array: clients on this rank may hold views of the old one)."""
        self.mixed = (float(staleness), np.nan)
        if upload is not None:
            alpha = self.ctx.options.alpha * staleness_weight(self.ctx.options, staleness)
            mixed = (1.0 - alpha) * self.params.astype(np.float64) + alpha * upload.astype(np.float64)
            self.params = mixed.astype(np.float32)
            self.version += 1
            self.mixed = (float(staleness), alpha)
        return True

    def round_metrics(self) -> dict[str, float]:
        staleness, alpha = self.mixed
        return {"staleness": staleness, "mixing_weight": alpha, "updates_applied": float(np.isfinite(alpha)),
                "server_version": float(self.version)}

    def final_state(self) -> dict[str, np.ndarray]:
        return {"global_model": self.params}


class FedAsyncClient(ClientToolkit):
    """Local SGD from the downloaded model; the trained model goes up."""

    protocol_type = FedAsyncProtocol
    protocol: FedAsyncProtocol
    scratch: tuple[str, ...] = ("start", "trained")

    def __init__(self, ctx: RunContext, data, state: ClientState | None = None):  # noqa: ANN001
        super().__init__(ctx, data, state)
        self.start: dict[int, np.ndarray] = {}
        self.trained: dict[int, np.ndarray] = {}
        self.global_params: np.ndarray | None = None

    def handlers(self) -> Mapping[Message, Handler]:
        p = self.protocol
        return {p.model_msg: self.receive_start, p.eval_msg: self.receive_evaluated,
                p.upload_msg: send_from(self.trained)}

    def receive_start(self, step: StepContext, client: int, row: np.ndarray) -> None:
        self.start[client] = row

    def receive_evaluated(self, step: StepContext, client: int, row: np.ndarray) -> None:
        self.global_params = row

    def local_step(self, step: StepContext) -> LocalStep | None:
        return LocalStep()

    def local_start(self, step: StepContext, client: int) -> ClientStart:
        return ClientStart(self.start.pop(client))

    def local_end(self, step: StepContext, clients: list[int], trained: TrainedRows) -> None:
        rows = trained.host("params")[0]
        self.trained.update((client, rows[k].copy()) for k, client in enumerate(clients))

    def eval_model(self, step: StepContext, client: int, kind: str) -> nn.Module:
        self.workspace.load(require(self.global_params, "the evaluated model"))
        return self.workspace.module
