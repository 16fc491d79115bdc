"""Local SGD of several clients as one computation (``torch.func.vmap``), for small models.

Clients that start from the same model with equally many training samples take the same number of
equally sized batches, so they can be trained together: their parameters stacked as rows, one
vmapped gradient per step. Everything else stays per client (the batch order from each client's own
generator, its reported loss, clipping and the optimizer step on each row), so every client's update is
bitwise that of :func:`~mpifl.training.sgd.local_sgd` (tests check it) and vectorizing only
changes speed. Whether it is faster depends on the model and the group size: ``auto`` measures both
ways once per group size on the rank and keeps the faster.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from mpifl.models.flat import FlatModel
from mpifl.training.config import ClientConfig
from mpifl.training.sgd import TrainStats, sgd_step, training_batches

VECTORIZABLE_MODELS = ("linear", "logistic", "mlp")  # no buffers, no randomness in the forward pass
_TRIALS = 3


class VectorizedSGD:
    """Trains groups of clients of one flat model together; decides per group size when ``auto``."""

    def __init__(self, model: FlatModel, loss_fn: nn.Module, mode: bool | str):
        self.model, self.loss_fn, self.mode = model, loss_fn, mode
        module, names, shapes = model.module, model.names, model.shapes
        sizes = model.segment_sizes()

        def loss(flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            params = {name: part.view(shape) for name, part, shape in zip(names, flat.split(sizes), shapes)}
            out = functional_call(module, params, (x,))
            return loss_fn(out, y), out.detach()

        self.gradients: Callable = vmap(grad(loss, has_aux=True))
        self.faster: dict[int, bool] = {}  # group size bucket -> vectorized was faster (auto)

    def decided(self, group: int) -> bool | None:
        """Whether to train ``group`` clients together, if that needs no (more) measuring: always (mode
        True), never (False), or as measured before for this power-of-two group size ("auto")."""
        if group < 2 or self.mode is False:
            return False
        if self.mode is True:
            return True
        return self.faster.get(_bucket(group))

    def worth_it(self, group: int, x: torch.Tensor, y: torch.Tensor) -> bool:
        """:meth:`decided`, measuring on one batch of stacked inputs ``x``, ``y`` where it is not yet."""
        choice = self.decided(group)
        if choice is None:
            choice = self.faster[_bucket(group)] = self._measure(x, y) < 1.0
        return choice

    def _measure(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """Seconds of one vmapped gradient over seconds of the same gradients one client at a time
        (on the workspace model; only its gradient buffer changes)."""
        model = self.model
        stacked = model.params.expand(len(x), -1).clone()

        def one_at_a_time() -> None:
            for xk, yk in zip(x, y):
                model.compute_gradient(self.loss_fn(model.module(xk), yk))

        vectorized = min(_timed(lambda: self.gradients(stacked, x, y)) for _ in range(_TRIALS))
        looped = min(_timed(one_at_a_time) for _ in range(_TRIALS))
        return vectorized / looped

    def train(self, start: np.ndarray, x_train: Sequence[torch.Tensor], y_train: Sequence[torch.Tensor],
              generators: Sequence[torch.Generator], cfg: ClientConfig) -> tuple[torch.Tensor, list[TrainStats]]:
        """Local SGD of clients with equally many samples from ``start``: their final parameters as rows,
        and their statistics."""
        group = len(x_train)
        params = torch.tensor(start, device=self.model.device).expand(group, -1).clone()
        momentum = torch.zeros_like(params) if cfg.momentum else None
        loss_sums = torch.zeros(group, dtype=torch.float64, device=params.device)
        clients = [training_batches(x, y, cfg, g) for x, y, g in zip(x_train, y_train, generators)]
        steps = 0
        for batches in zip(*clients):  # each client draws its batches (and augmentation) from its own generator
            xb = torch.stack([b[0] for b in batches])
            yb = torch.stack([b[1] for b in batches])
            grads, outputs = self.gradients(params, xb, yb)
            with torch.no_grad():  # a vmapped mean may round differently: each client's own loss, as alone
                loss_sums += torch.stack([self.loss_fn(out, y) for out, y in zip(outputs, yb)])
            for k in range(group):
                sgd_step(params[k], grads[k], None if momentum is None else momentum[k], cfg.lr, cfg)
            steps += 1
        return params, [TrainStats(steps, float(s) / max(steps, 1)) for s in loss_sums]


def _bucket(group: int) -> int:
    return 1 << (group - 1).bit_length()


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
