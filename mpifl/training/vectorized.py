"""Local SGD of several clients as one computation (``torch.func.vmap``), for small models.

Clients that start from the same model with equally many training samples take the same number of
equally sized batches, so they can be trained together: their parameters stacked as rows, one
vmapped gradient per step. Everything else stays per client (the batch order from each client's own
generator, its reported loss, clipping and the optimizer step on each row).

A client's update must not depend on which clients share its rank, or results would change with the
rank count. So with ``client.vectorize`` on, every client of a vectorizable model goes through this
kernel, a group of one included, and the kernel runs on one intra-op thread: a batched matrix product
then computes each client's rows alone, the same for any group size (tests check it at two threads).
The kernel and the one-at-a-time loop agree bitwise for narrow layers (tests check it), but may round
differently for wide ones: ``client.vectorize`` is a setting of the results, like ``threads_per_rank``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from mpifl.models.flat import FlatModel
from mpifl.training.config import ClientConfig
from mpifl.training.sgd import TrainStats, sgd_step, training_batches

VECTORIZABLE_MODELS = ("linear", "logistic", "mlp")  # no buffers, no randomness in the forward pass


class VectorizedSGD:
    """Trains groups of clients of one flat model together."""

    def __init__(self, model: FlatModel, loss_fn: nn.Module):
        self.model, self.loss_fn = model, loss_fn
        module, names, shapes = model.module, model.names, model.shapes
        sizes = model.segment_sizes()

        def loss(flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            params = {name: part.view(shape) for name, part, shape in zip(names, flat.split(sizes), shapes)}
            out = functional_call(module, params, (x,))
            return loss_fn(out, y), out.detach()

        self.gradients: Callable = vmap(grad(loss, has_aux=True))

    def train(self, start: np.ndarray, x_train: Sequence[torch.Tensor], y_train: Sequence[torch.Tensor],
              generators: Sequence[torch.Generator], cfg: ClientConfig) -> tuple[torch.Tensor, list[TrainStats]]:
        """Local SGD of clients with equally many samples from ``start``: their final parameters as rows,
        and their statistics (computed on one thread: see the module's docstring)."""
        threads = torch.get_num_threads()
        if threads == 1:
            return self._train(start, x_train, y_train, generators, cfg)
        torch.set_num_threads(1)
        try:
            return self._train(start, x_train, y_train, generators, cfg)
        finally:
            torch.set_num_threads(threads)

    def _train(self, start: np.ndarray, x_train: Sequence[torch.Tensor], y_train: Sequence[torch.Tensor],
               generators: Sequence[torch.Generator], cfg: ClientConfig) -> tuple[torch.Tensor, list[TrainStats]]:
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
        return params, [TrainStats(steps, s) for s in loss_sums]

