"""BatchNorm at evaluation: inference with statistics estimated on training data, never on the test batch.

mpifl's BatchNorm keeps no running buffers (``zoo.norm_layer``), so a client's training never depends on
which clients ran before it on the same rank. Evaluated as is, it would normalize with the test batch's
own statistics: transductive, and with a label-skewed client's test split, wrong. At evaluation the
runtime instead estimates every BatchNorm layer's input mean and variance on training data (what a
running average over training batches converges to: the sample-weighted mean of per-batch statistics)
and evaluates in inference mode with them. Which data gives the statistics is the algorithm's choice:
by default the evaluating client's own training split; FedALS averages all clients' (the authors average
their running statistics).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn


def batch_norms(module: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def norm_size(module: nn.Module) -> int:
    """Floats of :func:`norm_statistics` for ``module``: a mean and a variance per channel of each layer."""
    return sum(2 * m.num_features for m in batch_norms(module))


@torch.no_grad()
def norm_statistics(module: nn.Module, x: torch.Tensor, batch: int) -> np.ndarray:
    """Every BatchNorm layer's input mean and unbiased variance per channel, as the sample-weighted mean of
    the statistics of consecutive ``batch``-sized batches of ``x`` (layers in order, each mean then variance;
    float64). Empty for a model without BatchNorm."""
    layers = batch_norms(module)
    if not layers or len(x) == 0:
        return np.zeros(norm_size(module))
    totals = [torch.zeros(2 * m.num_features, dtype=torch.float64, device=x.device) for m in layers]

    def recorder(k: int):  # noqa: ANN202
        def hook(_: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
            h = inputs[0].double()
            dims = [d for d in range(h.dim()) if d != 1]
            count = h.numel() // h.shape[1]
            var = h.var(dim=dims, unbiased=count > 1)
            totals[k] += len(h) * torch.cat([h.mean(dim=dims), var])

        return hook

    handles = [m.register_forward_pre_hook(recorder(k)) for k, m in enumerate(layers)]
    try:
        for start in range(0, len(x), batch):
            module(x[start : start + batch])
    finally:
        for handle in handles:
            handle.remove()
    return torch.cat(totals).cpu().numpy() / len(x)


@contextmanager
def normalized_with(module: nn.Module, statistics: np.ndarray) -> Iterator[nn.Module]:
    """``module`` in inference mode, its BatchNorm layers normalizing with ``statistics`` (as
    :func:`norm_statistics` lays them out); restored to batch statistics afterwards."""
    layers = batch_norms(module)
    flat = torch.from_numpy(np.array(statistics, dtype=np.float32))  # a copy: a received row is read-only
    offset = 0
    try:
        for m in layers:
            c = m.num_features
            device = m.weight.device if m.weight is not None else flat.device
            m.running_mean = flat[offset : offset + c].to(device)
            m.running_var = flat[offset + c : offset + 2 * c].to(device)
            m.track_running_stats = True
            offset += 2 * c
        module.eval()
        yield module
    finally:
        module.train()
        for m in layers:
            m.running_mean = m.running_var = None
            m.track_running_stats = False
