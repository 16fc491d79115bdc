"""kNN-Per (Marfoq et al. 2022), a baseline of PeFLL's Table 1 (pefll spec §4.2), as the paper and the authors'
code define it; FL-Bench's differs (it mixes the kNN probabilities with the model's raw logits and fixes k, λ and
the scale by its options: docs/papers/pefll_baselines.md).

Training is FedAvg's, message for message. At evaluation each client, seen or unseen, interpolates the global
model's prediction with a k-nearest-neighbour predictor over its own training data:

    p(y|x) = λ·p_kNN(y|x) + (1 − λ)·softmax(f(x))_y,
    p_kNN(y|x) = Σ_{j ∈ N_k(x), y_j = y} exp(−d_j/T) / Σ_{j ∈ N_k(x)} exp(−d_j/T),   T = dim·scale,

where the datastore holds the global model's penultimate features (the input of its last Linear layer, dim
wide) of every training sample of the client, d_j is the squared Euclidean distance to the j-th nearest one
and N_k its k nearest. The weights are normalized as a softmax over −d/T (the same ratio, never 0/0).

k ∈ ``k`` and λ ∈ ``weights`` are chosen per client by cross-validation (the spec's grids: {5, 10} and
{0, 0.1, …, 1}; scale 100 worked best): highest accuracy on the client's validation split when it has one,
else leave-one-out on its training split (each sample's neighbours are the other samples); ties go to the
first pair in grid order. Nothing of this travels: per-client bytes are FedAvg's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from mpifl.algorithms.base import RunContext, StepContext
from mpifl.algorithms.fedavg import FedAvgClient, FedAvgProtocol, FedAvgServer
from mpifl.models.norm import normalized_with
from mpifl.schema import ConfigError, limits
from mpifl.training.device import host_floats

EVAL_BATCH = 1024


@dataclass(frozen=True)
class KNNPerOptions:
    """kNN-Per: FedAvg training; at evaluation the global model mixed with a kNN over the client's own training
    features, k and λ chosen per client (classification only)."""

    scale: float = field(default=100.0, metadata=limits(gt=0))  # the kernel's temperature is dim·scale
    k: tuple[int, ...] = field(default=(5, 10), metadata=limits(ge=1))  # neighbours, searched per client
    weights: tuple[float, ...] = field(default=tuple(i / 10 for i in range(11)),  # λ, searched per client
                                       metadata=limits(ge=0, le=1))


class KNNPerProtocol(FedAvgProtocol):
    eval_kinds = ("personal", "global")

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        if ctx.layout.task != "classification":
            raise ConfigError("algorithm: knnper interpolates class probabilities; it needs a classification dataset")
        if not ctx.options.k or not ctx.options.weights:
            raise ConfigError("knnper: k and weights each need at least one value to search")


class KNNPerServer(FedAvgServer):
    """FedAvg's server with kNN-Per's protocol, so both sides agree on what is evaluated."""

    protocol_type: type[KNNPerProtocol] = KNNPerProtocol
    protocol: KNNPerProtocol


@torch.no_grad()
def features_and_logits(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The input of ``module``'s last Linear layer (float64) and the module's output, for every row of ``x``."""
    last = [m for m in module.modules() if isinstance(m, nn.Linear)][-1]
    features: list[torch.Tensor] = []
    handle = last.register_forward_pre_hook(lambda _, inputs: features.append(inputs[0].double()))
    try:
        logits = torch.cat([module(x[s : s + EVAL_BATCH]) for s in range(0, len(x), EVAL_BATCH)])
    finally:
        handle.remove()
    return torch.cat(features), logits


def knn_probabilities(distances: torch.Tensor, labels: torch.Tensor, k: int, temperature: float,
                      num_classes: int) -> torch.Tensor:
    """p_kNN per row of ``distances`` (squared, queries × datastore) to the datastore samples of ``labels``.

    The neighbours' weights are added to their classes one neighbour at a time, nearest first: within one
    addition no two weights meet in one cell, so a GPU's atomic adds cannot reorder a sum (run to run the
    same bits), and on the CPU it is the order of a single ``scatter_add_`` over all neighbours."""
    nearest, index = torch.topk(distances, min(k, distances.shape[1]), dim=1, largest=False)
    weights = torch.softmax(-nearest / temperature, dim=1)
    classes = labels[index]
    probabilities = torch.zeros(len(distances), num_classes, dtype=weights.dtype, device=weights.device)
    for j in range(index.shape[1]):
        probabilities.scatter_add_(1, classes[:, j : j + 1], weights[:, j : j + 1])
    return probabilities


def squared_distances(queries: torch.Tensor, store: torch.Tensor) -> torch.Tensor:
    return torch.cdist(queries, store, compute_mode="donot_use_mm_for_euclid_dist") ** 2


class KNNMixture(nn.Module):
    """λ·p_kNN + (1 − λ)·softmax(model), as log-probabilities: argmax and cross-entropy on them are the
    mixture's prediction and negative log-likelihood."""

    def __init__(self, model: nn.Module, store: torch.Tensor, labels: torch.Tensor, k: int, lam: float,
                 temperature: float, num_classes: int, statistics: np.ndarray | None):
        super().__init__()
        self.model = model
        self.store, self.labels, self.k, self.lam = store, labels, k, lam
        self.temperature, self.num_classes = temperature, num_classes
        self.statistics = statistics  # the BatchNorm statistics the datastore's features were computed with

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features, logits = features_and_logits(self.model, x)
        p_knn = knn_probabilities(squared_distances(features, self.store), self.labels, self.k, self.temperature,
                                  self.num_classes)
        mixed = self.lam * p_knn + (1 - self.lam) * torch.softmax(logits.double(), dim=1)
        return torch.log(mixed.clamp_min(torch.finfo(torch.float64).tiny)).float()


def select(distances: torch.Tensor, store_labels: torch.Tensor, logits: torch.Tensor, labels: torch.Tensor,
           opts: KNNPerOptions, temperature: float, num_classes: int) -> tuple[int, float]:
    """The (k, λ) of the grids with the highest accuracy on the queries (``distances`` to the datastore; the
    model's ``logits``; true ``labels``); ties go to the first in grid order. The accuracies of the whole grid
    are read from the device at once."""
    p_model = torch.softmax(logits.double(), dim=1)
    grid, correct = [], []
    for k in opts.k:
        p_knn = knn_probabilities(distances, store_labels, k, temperature, num_classes)
        for lam in opts.weights:
            grid.append((k, lam))
            correct.append(((lam * p_knn + (1 - lam) * p_model).argmax(1) == labels).sum())
    return grid[int(np.argmax(host_floats(correct)))]  # argmax: the first of the best


class KNNPerClient(FedAvgClient):
    protocol_type: type[KNNPerProtocol] = KNNPerProtocol
    protocol: KNNPerProtocol

    def eval_model(self, step: StepContext, client: int, kind: str) -> nn.Module:
        model = super().eval_model(step, client, kind)
        split = self.data[client]
        if kind != "personal" or not len(split.y_train):  # no datastore: the global model alone
            return model
        opts: KNNPerOptions = self.ctx.options
        stats = self.eval_norm_statistics(step, client, kind, model)
        with normalized_with(model, stats) if stats is not None else contextlib.nullcontext():
            store, store_logits = features_and_logits(model, split.x_train)
            if len(split.y_val):
                val_features, logits = features_and_logits(model, split.x_val)
                distances, labels = squared_distances(val_features, store), split.y_val
            else:  # leave one out: each training sample against the others
                distances = squared_distances(store, store).fill_diagonal_(float("inf"))
                labels, logits = split.y_train, store_logits
        temperature = store.shape[1] * opts.scale
        classes = self.ctx.layout.num_classes
        searchable = len(split.y_val) > 0 or len(split.y_train) > 1
        k, lam = select(distances, split.y_train, logits, labels, opts, temperature, classes) \
            if searchable else (opts.k[0], 0.0)
        return KNNMixture(model, store, split.y_train, k, lam, temperature, classes, stats)

    def eval_norm_statistics(self, step: StepContext, client: int, kind: str, model: nn.Module) -> np.ndarray | None:
        if isinstance(model, KNNMixture):
            return model.statistics
        return super().eval_norm_statistics(step, client, kind, model)
