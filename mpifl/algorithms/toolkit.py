"""Helpers an algorithm's client side may mix in (:class:`ClientToolkit`): local SGD stated once and run by the
executor (alone or many clients together), full-batch gradients and evaluation; none of it is the interface."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from mpifl.algorithms.base import ClientAlgorithm, Handler
from mpifl.algorithms.context import EvalLayout, RunContext, StepContext
from mpifl.algorithms.state import ClientState
from mpifl.models import loss_function
from mpifl.models.norm import batch_norms, norm_statistics, normalized_with
from mpifl.training.executor import LocalSGD
from mpifl.training.localstep import ClientRun, ClientStart, LocalStep, Rows, TrainedRows, read_together
from mpifl.training.sgd import client_generator, evaluate, to_device
from mpifl.training.tensors import TensorSplit
from mpifl.training.vectorizing import auto_chunk, vectorize_wanted

DEVICE_ROUND_BYTES = 2 << 30
"""Device memory the vectorized path's clients of one upload chunk may take (4 float32 rows each: parameters, gradients,
momentum, delta)."""


def send_from(outbox: dict[int, np.ndarray]) -> Handler:
    """A client's send handler that hands over what its local step left in ``outbox`` (client id -> row)."""
    return lambda step, client: outbox.pop(client)


STATED_STEP = "local_step, local_start and local_end (the step the runtime trains, batched or one client at a time)"
"""What a client's training overrides now (see :class:`ClientToolkit`)."""


class ClientToolkit(ClientAlgorithm):
    """A client side that trains and evaluates its clients on one shared workspace model.

    An algorithm whose :data:`~mpifl.comm.LOCAL` step is local SGD states it once, in three parts (google/fedjax's
    client_init / client_step / client_final): :meth:`local_step` (the SGD settings and the gradient's transform,
    an operation on a block of clients' rows), :meth:`local_start` (one client's start and the values its step
    reads) and :meth:`local_end` (what the trained rows become). The executor (:class:`LocalSGD`) runs it: one
    client at a time on the workspace, or many as one batched program (``client.vectorize``), the same step
    either way. An algorithm whose local step is something else overrides :meth:`compute` instead.
    """

    vectorized_on_cpu = False
    """Under ``client.vectorize: auto`` on the CPU, dense models train in the vectorized path (FedAvg's untransformed
    step, measured faster there; see ``vectorize_wanted``); otherwise the loop, as before."""
    retired = {"takes_batch": "can_vectorize",
               **dict.fromkeys(("train_together", "train_workspace", "vectorizer_if"), STATED_STEP)}

    def __init__(self, ctx: RunContext, data: Mapping[int, TensorSplit], state: ClientState | None = None):
        super().__init__(ctx, data, state)
        self.workspace = ctx.new_model(ctx.device)
        self.loss_fn = loss_function(ctx.layout)
        self.round_losses: dict[int, float] = {}
        self.trained_vectorized = 0  # clients trained in the vectorized path
        # this round's received rows on the device (:meth:`on_device`), with the rows they came from
        self.uploaded: dict[tuple, tuple[np.ndarray, torch.Tensor]] = {}
        cfg = ctx.cfg
        vectorized = (self.can_vectorize()
                      and vectorize_wanted(cfg.client, cfg.model.name, self.device, self.vectorized_on_cpu))
        chunk = cfg.client.vectorize_chunk
        self.executor = LocalSGD(self.workspace, self.loss_fn, vectorized,
                                 auto_chunk(cfg.clients_per_round, self.device) if chunk == "auto" else chunk,
                                 cuda_graph=cfg.client.cuda_graph)

    def on_device(self, step: StepContext, row: np.ndarray) -> torch.Tensor:
        """A row received in ``step`` on the training device, copied up once however many clients receive it (a
        broadcast row: every client's is a view of one buffer, told apart by the memory it views). A later step
        copies its rows afresh, even into the same memory (on one rank the server's own array arrives, which it may
        change between the round's training and its evaluation). The row is kept until the round ends, so that no
        other row reuses its memory meanwhile; do not change the tensor."""
        key = (step.round, step.stage, row.__array_interface__["data"][0], row.shape, row.strides)
        if key not in self.uploaded:
            self.uploaded[key] = row, to_device(torch.from_numpy(np.array(row)), self.device)
        return self.uploaded[key][1]

    def end_round(self) -> None:
        """Forget this round's in-flight values and the received rows' device copies (:meth:`on_device`)."""
        super().end_round()
        self.uploaded.clear()

    def can_vectorize(self) -> bool:
        """Whether this algorithm's clients can train in the vectorized path: those whose local step is stated as
        :meth:`local_step`, and not replaced by an override of :meth:`compute` (:meth:`computes_alone`)."""
        return type(self).local_step is not ClientToolkit.local_step and not self.computes_alone()

    @classmethod
    def computes_alone(cls) -> bool:
        """Whether a subclass overrides :meth:`compute` below the class that states :meth:`local_step` (a plug-in
        that records or alters what a client trains): then every client goes through that override, one at a time,
        so it is honoured, never bypassed by the vectorized path. Overriding :meth:`local_start`, :meth:`local_step` or
        :meth:`local_end` instead keeps the vectorized path."""
        def position(name: str) -> int:  # of the class whose definition of ``name`` this one uses
            return next(k for k, klass in enumerate(cls.__mro__) if name in vars(klass))

        # compute found first in the MRO (a subclass or a mixin before the stating class); one class stating both
        # means both
        return position("compute") < position("local_step")

    @property
    def device(self) -> torch.device:
        """Where this rank's clients compute: their data, the workspace and the tensors of a round."""
        return self.workspace.device

    def clients_per_upload(self) -> int:
        """In the vectorized path, a round's clients as one program: as many at a time as keep their parameters,
        gradients, momentum and deltas within ``DEVICE_ROUND_BYTES`` (W2: about 80), a whole number of calls, so a
        cohort is one chunk, on a GPU screened with one read and folded with one more; otherwise the default few.
        (A client's update does not depend on its company in the vectorized path, so the chunk changes no bit.)"""
        if not self.executor.vectorized:
            return super().clients_per_upload()
        most = max(super().clients_per_upload(), DEVICE_ROUND_BYTES // (4 * 4 * self.workspace.numel))
        call = self.executor.chunk or 1
        return max(most // call, 1) * call

    def local_step(self, step: StepContext) -> LocalStep | tuple[LocalStep, ...] | None:
        """This algorithm's local SGD in ``step`` (see the class's docstring), or its phases in order, each
        starting where the last left off with the same generator (FedRep: the head, then the body), or None where
        its local step is not local SGD (then :meth:`compute` runs, a client at a time)."""
        return None

    def local_start(self, step: StepContext, client: int) -> ClientStart:
        """Where ``client``'s local SGD starts, and the values its step reads."""
        raise NotImplementedError

    def local_end(self, step: StepContext, clients: list[int], trained: TrainedRows) -> None:
        """What ``clients``' trained rows become (to send, to keep in their state)."""
        raise NotImplementedError

    def sent_rows(self, trained: TrainedRows) -> Rows:
        """``trained``'s parameter rows (deltas, with :attr:`LocalStep.delta`) as clients hand them over for a summed
        message: on a GPU the rows of the kernel's device tensor, which the walker screens with one read and folds
        on the device (``ExactSum.add_rows``), so no row is copied out client by client; on the CPU host views of
        the same memory (numpy's fold, the faster there). FedAvg's client and IFCA's send these."""
        return trained.params if trained.params.device.type != "cpu" else trained.host("params")[0]

    def compute(self, step: StepContext, client: int) -> None:
        """One client's local step: the stated local SGD through the executor (an algorithm with another kind of
        local step overrides this; so may a plug-in that records or alters a client's training, calling
        ``super().compute``: :meth:`computes_alone`)."""
        spec = self.local_step(step)
        if spec is not None:
            self.train_stated(step, [client], spec)

    def compute_clients(self, step: StepContext, clients: np.ndarray) -> np.ndarray:
        """The local step of ``clients``: the stated local SGD of all of them through the executor (each one's
        seconds: its :meth:`local_start` plus its compute, an equal share of its group's in the vectorized path); one
        at a time through :meth:`compute` where that is overridden (:meth:`computes_alone`) or nothing is stated."""
        spec = self.local_step(step)
        if spec is None or self.computes_alone():
            return super().compute_clients(step, clients)
        return self.train_stated(step, [int(c) for c in clients], spec)

    def train_stated(self, step: StepContext, ids: list[int], spec: LocalStep | tuple[LocalStep, ...]) -> np.ndarray:
        """:meth:`local_starts`, the executor, :meth:`local_end`: the stated local SGD of ``ids``, each one's
        seconds."""
        starts, seconds = self.local_starts(step, ids)
        trained = self.train_clients(step, ids, starts, spec)
        self.local_end(step, ids, trained)
        return seconds + trained.seconds

    def local_starts(self, step: StepContext, clients: list[int]) -> tuple[list[ClientStart], np.ndarray]:
        """Every client's :meth:`local_start`, and the seconds each took (an algorithm that finds its clients'
        starts together, reading the device once for all, overrides this: IFCA)."""
        seconds = np.empty(len(clients))
        starts = []
        for i, client in enumerate(clients):
            began = time.perf_counter()
            starts.append(self.local_start(step, client))
            seconds[i] = time.perf_counter() - began
        return starts, seconds

    def train_clients(self, step: StepContext, clients: list[int], starts: list[ClientStart],
                      spec: LocalStep | tuple[LocalStep, ...]) -> TrainedRows:
        """Local SGD of ``clients`` from ``starts`` as ``spec`` (or each of its phases in turn) says, their mean
        losses in :attr:`round_losses` (all read in one copy); the rows stay where they were trained, and the
        seconds are every phase's."""
        seed = self.ctx.cfg.seed
        runs = [ClientRun(start, self.data[c].x_train, self.data[c].y_train,
                          client_generator(seed, step.round, c, start.purpose)) for c, start in zip(clients, starts)]
        phases: list[TrainedRows] = []
        for phase in (spec,) if isinstance(spec, LocalStep) else spec:
            if phases:  # where the last phase left each client, with its generator where it left it
                runs = [dataclasses.replace(run, start=ClientStart(phases[-1].params[k])) for k, run in enumerate(runs)]
            phases.append(self.executor.train(runs, phase, self.ctx.cfg.client))
        self.round_losses.update(zip(clients, _mean_losses(phases).tolist()))
        if self.executor.vectorized:
            self.trained_vectorized += len(clients)
        trained = phases[-1]
        for earlier in phases[:-1]:
            trained.timer.spans.extend(earlier.timer.spans)
        return trained

    def rank_stats(self) -> dict[str, float]:
        return {"clients_trained_vectorized": self.trained_vectorized}

    def eval_model(self, step: StepContext, client: int, kind: str) -> nn.Module:
        """The model to evaluate ``client`` with for ``kind`` (one of :attr:`eval_kinds`); it is used
        before the next call, so it may live in the shared workspace."""
        raise NotImplementedError

    def evaluate(self, step: StepContext, client: int, layout: EvalLayout) -> np.ndarray:
        """``client``'s evaluation row as ``layout`` orders it (every model kind on every split), for the
        runtime to pool. Which model, which BatchNorm statistics and which loss are the algorithm's business."""
        data = self.data[client]
        rows = []
        for kind in layout.kinds:
            model = self.eval_model(step, client, kind)
            stats = self.eval_norm_statistics(step, client, kind, model)
            with normalized_with(model, stats) if stats is not None else contextlib.nullcontext():
                for split in layout.splits:
                    rows.append(evaluate(model, getattr(data, f"x_{split}"), getattr(data, f"y_{split}"),
                                         self.loss_fn))
        return np.concatenate(rows)

    def take_train_loss(self, client: int) -> float:
        """``client``'s mean training loss of this round (NaN if it reported none), forgotten once taken."""
        return self.round_losses.pop(client, float("nan"))

    def eval_norm_statistics(self, step: StepContext, client: int, kind: str, model: nn.Module) -> np.ndarray | None:
        """The BatchNorm statistics ``model`` evaluates with (:mod:`mpifl.models.norm`); ``None`` without
        BatchNorm. By default estimated on the client's own training split (never its test batch)."""
        if not batch_norms(model):
            return None
        return norm_statistics(model, self.data[client].x_train, self.ctx.cfg.client.batch_size)
    def gradient_at(self, client: int, params: np.ndarray, rows: torch.Tensor | None = None) -> np.ndarray:
        """∇ at ``params`` of ``client``'s mean loss over ``rows`` of its training split, plus the configured
        weight decay; all rows (the default) give the full-batch gradient (Karula's queries)."""
        split = self.data[client]
        x, y = (split.x_train, split.y_train) if rows is None else (split.x_train[rows], split.y_train[rows])
        trained = self.gradient_on(params, x, y)
        self.round_losses[client] = float(trained.mean_losses()[0])
        return trained.host("params")[0][0]

    def gradient_on(self, params: Rows, x: torch.Tensor, y: torch.Tensor, decay: bool = True) -> TrainedRows:
        """The executor's one gradient (:attr:`LocalStep.gradient`, FedSGD's step) at ``params`` of the mean loss
        on ``x``, ``y``: the row it leaves, on the device, plus the configured weight decay unless ``decay`` is
        off; its loss is the row's loss sum."""
        cfg = self.ctx.cfg.client if decay else dataclasses.replace(self.ctx.cfg.client, weight_decay=0.0)
        return self.executor.train([ClientRun(ClientStart(params), x, y)], LocalStep(gradient=True), cfg)


def _mean_losses(phases: list[TrainedRows]) -> np.ndarray:
    """Each client's mean training loss over every phase: the phases' mean losses weighted by their steps (NaN
    for none), all loss sums read in one copy."""
    if len(phases) == 1:
        return phases[0].mean_losses()
    sums = read_together([phase.loss_sums for phase in phases])
    weighted = sum(total / np.maximum(phase.steps, 1) * phase.steps for total, phase in zip(sums, phases))
    steps = sum(phase.steps for phase in phases)
    return np.where(steps > 0, weighted / np.maximum(steps, 1), np.nan)
