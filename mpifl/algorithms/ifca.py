"""IFCA (Ghosh et al. 2020), model-averaging variant: k cluster models; a sampled client joins the cluster
whose model has the lowest loss on its training data, trains it locally and returns its delta and its
cluster index; the server averages deltas per cluster (by sample count) through FedAvg's server step
(``server.*``: the optimizer's state is kept per cluster model).
Clusters start from different random initializations, so they can separate."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from mpifl.algorithms.base import Handler, Protocol, RunContext, ServerAlgorithm, StepContext
from mpifl.algorithms.fedavg import GlobalModel
from mpifl.algorithms.state import ClientState
from mpifl.algorithms.toolkit import ClientStart, ClientToolkit
from mpifl.comm.messages import LOCAL, Message, Step, require
from mpifl.models import FlatModel, build_model
from mpifl.schema import INT32_MAX, limits
from mpifl.training.device import host_floats
from mpifl.training.localstep import LocalStep, Rows, TrainedRows


@dataclass(frozen=True)
class IFCAOptions:
    """IFCA (model averaging): k cluster models; each sampled client trains the one that fits its data best."""

    # k: cluster models, each from its own initialization (a client's choice travels as int32)
    clusters: int = field(default=3, metadata=limits(ge=1, le=INT32_MAX))


class IFCAProtocol(Protocol):
    eval_kinds = ("personal",)

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        self.k = ctx.options.clusters
        self.numel = ctx.new_model().numel
        self.models_msg = Message("cluster_models", "down", self.k * self.numel, broadcast=True)
        self.cluster_msg = Message("cluster_id", "up", 1, "int32")
        # one exact sum per cluster: a client's delta goes into its cluster's (IFCAClient.sum_group)
        self.delta_msg = Message("delta", "up", self.numel, update=True, summed="weighting", groups=self.k)
        self.eval_msg = Message("eval_cluster_models", "down", self.k * self.numel, broadcast=True)

    def train_plan(self, round_: int) -> Sequence[Step]:
        return (self.models_msg, LOCAL, self.cluster_msg, self.delta_msg)

    def samples_per_round(self) -> np.ndarray:
        """Local SGD, plus every cluster model's loss on the whole training split to pick the cluster."""
        return super().samples_per_round() + self.k * self.ctx.layout.train_sizes

    def eval_plan(self) -> Sequence[Step]:
        return (self.eval_msg,)


class IFCAServer(ServerAlgorithm):
    protocol_type: type[IFCAProtocol] = IFCAProtocol
    protocol: IFCAProtocol
    server_optimizer = True

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        seeds = np.random.SeedSequence([ctx.cfg.seed, 0x49464341]).generate_state(self.protocol.k)
        # one row per cluster; the server optimizer keeps its state per row, each stepped with its own members
        self.model = GlobalModel(ctx, np.stack([
            FlatModel(build_model(ctx.cfg.model, ctx.layout, int(s))).numpy() for s in seeds
        ]).astype(np.float32))
        self.assignment: dict[int, int] = {}  # this round's cluster of each client that reported one

    @property
    def params(self) -> np.ndarray:
        return self.model.params

    def handlers(self) -> Mapping[Message, Handler]:
        p = self.protocol
        return {p.models_msg: self.cluster_models, p.eval_msg: self.cluster_models,
                p.cluster_msg: self.note_assignment, p.delta_msg: self.apply_deltas}

    def cluster_models(self, step: StepContext) -> np.ndarray:
        return self.params.reshape(-1)

    def note_assignment(self, step: StepContext, rows: np.ndarray) -> None:
        self.assignment = dict(zip(step.clients.tolist(), rows[:, 0].tolist()))

    def apply_deltas(self, step: StepContext, totals: np.ndarray) -> None:
        """``totals``: each cluster's Σ wᵢ·Δᵢ over its accepted members; each cluster model steps by their mean."""
        clients = step.clients  # the clients whose delta was accepted
        assignment = np.array([self.assignment[c] for c in clients.tolist()])
        for j in np.unique(assignment):
            self.model.step(totals[j] / self.ctx.divisor(clients[assignment == j]), int(j))

    def final_state(self) -> dict[str, np.ndarray]:
        return {"cluster_models": self.params}


class IFCAClient(ClientToolkit):
    """Each sampled client picks its cluster (:meth:`best_clusters`), trains from that model and sends its delta
    into its cluster's exact sum. On a GPU the k cluster models go up once a broadcast (:meth:`receive_models`: the
    pick, the starts and evaluation read them there) and the deltas stay rows of the kernel's device tensor, folded
    there as FedAvg's are (:meth:`ClientToolkit.sent_rows`): no model crosses per client."""

    protocol_type: type[IFCAProtocol] = IFCAProtocol
    protocol: IFCAProtocol
    scratch: tuple[str, ...] = ("chosen", "deltas")
    retired = {"report": "local_end (it keeps each client's cluster and delta)",
               "best_cluster": "best_clusters (a call's clients at once)"}

    def __init__(self, ctx: RunContext, data, state: ClientState | None = None):  # noqa: ANN001
        super().__init__(ctx, data, state)
        self.models_on_device: torch.Tensor | None = None  # the k cluster models, as last broadcast
        self.chosen: dict[int, int] = {}  # this round: client -> its cluster
        self.deltas: dict[int, Rows] = {}  # device rows on a GPU (sent_rows)

    def handlers(self) -> Mapping[Message, Handler]:
        p = self.protocol
        return {p.models_msg: self.receive_models, p.eval_msg: self.receive_models,
                p.cluster_msg: self.send_cluster, p.delta_msg: self.send_delta}

    def receive_models(self, step: StepContext, client: int, row: np.ndarray) -> None:
        """The k cluster models (k × numel) on this rank's device, copied up once a broadcast however many clients
        receive them (:meth:`ClientToolkit.on_device`; on the CPU a copy of the received buffer, which the transport
        may reuse): the pick, the starts and evaluation read them there."""
        self.models_on_device = self.on_device(step, row).reshape(self.protocol.k, -1)

    def device_models(self) -> torch.Tensor:
        return require(self.models_on_device, "the cluster models")

    @torch.no_grad()
    def best_clusters(self, clients: list[int]) -> np.ndarray:
        """For each client, the cluster whose model has the lowest loss on its training split (ties: lowest
        index): each cluster model loaded once, every loss read in one copy."""
        losses = []
        models = self.device_models()
        for model in models:
            self.workspace.load(model)
            losses += [self.loss_fn(self.workspace.module(self.data[c].x_train), self.data[c].y_train) for c in clients]
        return np.argmin(host_floats(losses).reshape(len(models), len(clients)), axis=0)

    def local_step(self, step: StepContext) -> LocalStep | None:
        return LocalStep(delta=True)  # final − start where the rows are: the bits of numpy's, on the device

    def local_starts(self, step: StepContext, clients: list[int]) -> tuple[list[ClientStart], np.ndarray]:
        """Each client starts from the cluster model that fits it best, a row of :meth:`device_models` (the
        executor stacks each distinct row once, on the device); the pick counts as its compute, an equal share of
        the whole pick's seconds."""
        began = time.perf_counter()
        picks = self.best_clusters(clients)
        self.chosen.update((client, int(j)) for client, j in zip(clients, picks))
        models = self.device_models()
        starts = [ClientStart(models[int(j)]) for j in picks]
        return starts, np.full(len(clients), (time.perf_counter() - began) / max(len(clients), 1))

    def local_end(self, step: StepContext, clients: list[int], trained: TrainedRows) -> None:
        """Each client's delta from its cluster's model, to send into that cluster's sum (:meth:`sent_rows`)."""
        self.deltas.update(zip(clients, self.sent_rows(trained)))

    def send_cluster(self, step: StepContext, client: int) -> np.ndarray:
        return np.array([self.chosen[client]], dtype=np.int32)

    def sum_group(self, msg: Message, client: int) -> int:
        return self.chosen[client]

    def send_delta(self, step: StepContext, client: int) -> Rows:
        return self.deltas.pop(client)

    def eval_model(self, step: StepContext, client: int, kind: str) -> nn.Module:
        self.workspace.load(self.device_models()[int(self.best_clusters([client])[0])])
        return self.workspace.module
