"""Helpers an algorithm's client side may mix in (:class:`ClientToolkit`): local SGD on the shared workspace, alone
or many clients through the vectorized kernel, and full-batch gradients; none of it is the interface."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from mpifl.algorithms.base import ClientAlgorithm, Handler
from mpifl.algorithms.context import EvalLayout, RunContext, StepContext
from mpifl.algorithms.state import ClientState
from mpifl.models import loss_function
from mpifl.models.norm import batch_norms, norm_statistics, normalized_with
from mpifl.training.config import ClientConfig
from mpifl.training.device import host_numpy
from mpifl.training.sgd import GradHook, client_generator, evaluate, local_sgd
from mpifl.training.tensors import TensorSplit
from mpifl.training.vectorized import ClientRun, KernelResult, VectorizedSGD, kernel_wanted

DEVICE_ROUND_BYTES = 2 << 30
"""Device memory the kernel's clients of one upload chunk may take (4 float32 rows each: parameters, gradients,
momentum, delta)."""


def send_from(outbox: dict[int, np.ndarray]) -> Handler:
    """A client's send handler that hands over what its local step left in ``outbox`` (client id -> row)."""
    return lambda step, client: outbox.pop(client)



class ClientToolkit(ClientAlgorithm):
    """A client side that trains and evaluates its clients on one shared workspace model."""

    def __init__(self, ctx: RunContext, data: Mapping[int, TensorSplit], state: ClientState | None = None):
        super().__init__(ctx, data, state)
        self.workspace = ctx.new_model(ctx.device)
        self.loss_fn = loss_function(ctx.layout)
        self.round_losses: dict[int, float] = {}
        self.trained_together = 0  # clients trained through the vectorized kernel (:meth:`train_together`)
        self.vectorizer: VectorizedSGD | None = None  # the kernel, where a subclass trains through it

    @property
    def device(self) -> torch.device:
        """Where this rank's clients compute: their data, the workspace and the tensors of a round."""
        return self.workspace.device

    def clients_per_upload(self) -> int:
        """With the kernel, a round's clients as one batched program: as many at a time as keep their parameters,
        gradients, momentum and deltas within ``DEVICE_ROUND_BYTES`` (W2: about 80), so a cohort is one chunk, on
        a GPU screened with one read and folded with one more; otherwise the default few. (A client's update does
        not depend on its company in the kernel, so the chunk changes no bit.)"""
        if self.vectorizer is None:
            return super().clients_per_upload()
        return max(super().clients_per_upload(), DEVICE_ROUND_BYTES // (4 * 4 * self.workspace.numel))

    def rank_stats(self) -> dict[str, float]:
        return {"clients_trained_vectorized": self.trained_together}

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
        weight decay; all rows (the default) give the full-batch gradient ("clients return full gradients")."""
        split = self.data[client]
        x, y = (split.x_train, split.y_train) if rows is None else (split.x_train[rows], split.y_train[rows])
        self.workspace.load(params)
        loss = self.loss_fn(self.workspace.module(x), y)
        self.workspace.compute_gradient(loss)
        self.round_losses[client] = float(loss.detach())
        grads = host_numpy(self.workspace.grads).copy()
        if self.ctx.cfg.client.weight_decay:
            grads += self.ctx.cfg.client.weight_decay * self.workspace.numpy()
        return grads

    def train_workspace(self, step: StepContext, client: int, grad_hook: GradHook | None = None,
                        steps: int | None = None, momentum: torch.Tensor | None = None,
                        lr: float | None = None, config: ClientConfig | None = None) -> int:
        """Run local SGD (``config``, by default ``client.*``) on the workspace model with ``client``'s
        training data (``steps``, ``momentum`` and ``lr`` as in :func:`local_sgd`); returns the steps taken."""
        split = self.data[client]
        gen = client_generator(self.ctx.cfg.seed, step.round, client)
        stats = local_sgd(self.workspace, split.x_train, split.y_train, self.loss_fn, config or self.ctx.cfg.client,
                          gen, grad_hook, lr=lr, steps=steps, momentum=momentum)
        self.round_losses[client] = stats.mean_loss
        return stats.steps

    def vectorizer_if(self, cpu_default: bool) -> VectorizedSGD | None:
        """The kernel for :meth:`train_together` if ``client.vectorize`` wants it for this model and device
        (``cpu_default``: the kernel under ``auto`` on the CPU; see ``kernel_wanted``), else None."""
        cfg = self.ctx.cfg
        if not kernel_wanted(cfg.client, cfg.model.name, self.device, cpu_default):
            return None
        return VectorizedSGD(self.workspace, self.loss_fn, cfg.client)

    def train_together(self, vectorizer: VectorizedSGD, step: StepContext, starts: Mapping[int, np.ndarray],
                       hooks: Mapping[int, GradHook | None] | None = None, config: ClientConfig | None = None,
                       purpose: int = 0) -> tuple[dict[int, np.ndarray], np.ndarray]:
        """Local SGD of several clients from ``starts`` through the kernel, each as :meth:`train_workspace` trains
        it alone (its generator keyed by ``purpose``, its gradient hook, its mean loss in :attr:`round_losses`,
        all losses read in one copy); their final parameters in host memory (views on the CPU), and each one's
        seconds."""
        result = self._train_runs(vectorizer, step, starts, hooks, config, purpose, delta=False)
        rows = host_numpy(result.params)  # one copy from a GPU
        return {c: rows[k] for k, c in enumerate(starts)}, result.seconds

    def train_deltas_together(self, vectorizer: VectorizedSGD, step: StepContext, starts: Mapping[int, np.ndarray],
                              hooks: Mapping[int, GradHook | None] | None = None
                              ) -> tuple[dict[int, np.ndarray | torch.Tensor], np.ndarray]:
        """As :meth:`train_together`, each client's final − start instead: on a GPU rows of one device tensor (a
        summed upload is screened and folded there, never copied out client by client), host views on the CPU."""
        result = self._train_runs(vectorizer, step, starts, hooks, None, 0, delta=True)
        rows = result.params if result.params.device.type != "cpu" else host_numpy(result.params)
        return {c: rows[k] for k, c in enumerate(starts)}, result.seconds

    def _train_runs(self, vectorizer: VectorizedSGD, step: StepContext, starts: Mapping[int, np.ndarray],
                    hooks: Mapping[int, GradHook | None] | None, config: ClientConfig | None, purpose: int,
                    delta: bool) -> KernelResult:
        seed, clients = self.ctx.cfg.seed, list(starts)
        runs = [ClientRun(starts[c], self.data[c].x_train, self.data[c].y_train,
                          client_generator(seed, step.round, c, purpose), None if hooks is None else hooks[c])
                for c in clients]
        result = vectorizer.train(runs, config or self.ctx.cfg.client, delta=delta)
        self.round_losses.update(zip(clients, result.mean_losses().tolist()))
        self.trained_together += len(clients)
        return result
