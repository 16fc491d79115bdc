"""Client-side arithmetic shared by algorithms: local SGD on a flat model, and evaluation.

A client's randomness comes only from (seed, round, client id), and every rank computes with one
thread, so a client's update is bitwise the same whichever rank hosts it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from mpifl.models.flat import FlatModel
from mpifl.schema import ConfigError
from mpifl.training.config import ClientConfig

GradHook = Callable[[torch.Tensor, torch.Tensor], None]
"""Called as ``hook(params, grads)`` after each backward pass; may modify ``grads`` in place
(FedProx's proximal term, SCAFFOLD's control variates, ...)."""

EVAL_FIELDS = ("n", "correct", "loss_sum", "y_sum", "y_sq_sum")


def client_generator(seed: int, round_: int, client: int, purpose: int = 0) -> torch.Generator:
    """A torch generator keyed by (seed, round, client, purpose) and nothing else."""
    state = np.random.SeedSequence([seed, round_, client, purpose]).generate_state(2, dtype=np.uint64)
    return torch.Generator().manual_seed(int(state[0] >> np.uint64(1)))


@dataclass(frozen=True)
class TrainStats:
    steps: int
    mean_loss: float


def local_sgd(
    model: FlatModel,
    x: torch.Tensor,
    y: torch.Tensor,
    loss_fn: nn.Module,
    cfg: ClientConfig,
    generator: torch.Generator,
    grad_hook: GradHook | None = None,
    lr: float | None = None,
    steps: int | None = None,
    momentum: torch.Tensor | None = None,
    part: slice = slice(None),
) -> TrainStats:
    """Mini-batch SGD (momentum, weight decay, clipping as torch.optim.SGD) on ``model`` in place.

    Runs ``steps`` (or ``cfg.steps``) batches if given, else ``cfg.epochs`` passes; each pass draws a
    fresh permutation from ``generator``. The momentum buffer starts at zero unless the caller passes
    its own ``momentum`` (updated in place, for algorithms whose optimizer state outlives a round).
    ``part``: only this span of the flat parameters trains (clipping, weight decay and momentum included),
    the rest stays frozen (FedRep's head and body).
    """
    lr = cfg.lr if lr is None else lr
    params, grads = model.params[part], model.grads[part]
    if cfg.momentum == 0:
        momentum = None
    elif momentum is None:
        momentum = torch.zeros_like(params)
    loss_sum = torch.zeros((), dtype=torch.float64, device=params.device)
    done = 0
    for xb, yb in training_batches(x, y, cfg, generator, steps):
        loss = loss_fn(model.module(xb), yb)
        model.compute_gradient(loss)
        loss_sum += loss.detach()
        if grad_hook is not None:
            grad_hook(model.params, model.grads)
        sgd_step(params, grads, momentum, lr, cfg)
        done += 1
    return TrainStats(done, float(loss_sum) / max(done, 1))


def training_batches(x: torch.Tensor, y: torch.Tensor, cfg: ClientConfig, generator: torch.Generator,
                     steps: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each local step's batch (:func:`batch_schedule`), augmented as ``cfg.augment`` says (shared by
    algorithms with their own loop)."""
    for idx in batch_schedule(len(x), cfg, generator, steps):
        xb = x[idx]
        if cfg.augment == "crop_flip":
            xb = crop_flip(xb, generator)
        yield xb, y[idx]


def crop_flip(x: torch.Tensor, generator: torch.Generator, pad: int = 4) -> torch.Tensor:
    """Random crop of each image from its ``pad``-zero-padded copy, then a horizontal flip with probability
    ½ (torchvision's RandomCrop(size, padding=4) and RandomHorizontalFlip, as the FedALS authors train on
    CIFAR and SVHN). mpifl's images are normalized when loaded, so the padding is the channel mean (0)
    rather than black."""
    b, _, h, w = x.shape
    padded = nn.functional.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (b,), generator=generator).to(x.device)
    dx = torch.randint(0, 2 * pad + 1, (b,), generator=generator).to(x.device)
    flip = (torch.rand(b, generator=generator) < 0.5).to(x.device)
    rows = dy[:, None] + torch.arange(h, device=x.device)
    cols = dx[:, None] + torch.arange(w, device=x.device)
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    batch = torch.arange(b, device=x.device)[:, None, None]
    return padded.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2).contiguous()


def batch_schedule(n: int, cfg: ClientConfig, generator: torch.Generator, steps: int | None = None
                   ) -> Iterator[torch.Tensor]:
    """The sample indices of each local step: ``steps`` (or ``cfg.steps``) batches, else ``cfg.epochs``
    passes. ``cfg.batch_sampling: epochs`` walks passes over the data, each a fresh permutation from
    ``generator``; ``fresh`` draws every step's batch as the first ``batch_size`` of a new permutation
    (full batches, sampled without replacement within a batch and with replacement across steps: the
    PeFLL/pFedHN reference code's ``next(iter(loader))``)."""
    batch = min(cfg.batch_size, n)
    per_epoch = n // batch if cfg.drop_last else math.ceil(n / batch)
    total = planned_steps(n, cfg, steps)
    if cfg.batch_sampling == "fresh":
        for _ in range(total):
            yield torch.randperm(n, generator=generator)[:batch]
        return
    done = 0
    while done < total:
        order = torch.randperm(n, generator=generator)
        for start in range(0, per_epoch * batch, batch):
            if done == total:
                return
            yield order[start : start + batch]
            done += 1


def planned_steps(n: int, cfg: ClientConfig, steps: int | None = None) -> int:
    """How many local steps :func:`batch_schedule` yields for ``n`` training samples."""
    return steps or int(planned_step_counts(np.array([n]), cfg)[0])


def planned_step_counts(sizes: np.ndarray, cfg: ClientConfig) -> np.ndarray:
    """How many local steps :func:`batch_schedule` yields for clients of ``sizes`` training samples."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if cfg.steps:
        return np.full(len(sizes), cfg.steps, dtype=np.int64)
    batch = np.minimum(cfg.batch_size, np.maximum(sizes, 1))
    per_epoch = sizes // batch if cfg.drop_last else -(-sizes // batch)
    _check_count(cfg.epochs * per_epoch.astype(np.float64), "local steps")
    return cfg.epochs * per_epoch


def planned_samples(sizes: np.ndarray, cfg: ClientConfig, steps: int | np.ndarray | None = None) -> np.ndarray:
    """How many samples :func:`batch_schedule` yields in total for clients of ``sizes`` training samples
    (``steps``: one count for all, or one per client): whole passes, then the first batches (always full) of
    one more."""
    sizes = np.asarray(sizes, dtype=np.int64)
    batch = np.minimum(cfg.batch_size, np.maximum(sizes, 1))
    per_epoch = sizes // batch if cfg.drop_last else -(-sizes // batch)
    total = planned_step_counts(sizes, cfg) if steps is None else np.broadcast_to(steps, sizes.shape)
    per_pass = per_epoch * batch if cfg.drop_last else sizes
    if cfg.batch_sampling == "fresh":
        _check_count(total * batch.astype(np.float64), "training samples")
        return (total * batch).astype(np.int64)
    passes, rest = np.divmod(total, np.maximum(per_epoch, 1))
    _check_count(passes * per_pass.astype(np.float64) + rest * batch.astype(np.float64), "training samples")
    return (passes * per_pass + rest * batch).astype(np.int64)


def _check_count(counts: np.ndarray, what: str) -> None:
    """One line, not a silently wrapped int64, for planned local work (``counts``, computed in float64) beyond
    what a 64-bit count holds."""
    if len(counts) and counts.max() >= 2.0**63:
        raise ConfigError(f"client: a client's {what} per round ({counts.max():.3g}) are more than a 64-bit count "
                          "holds; lower client.steps, client.epochs or client.batch_size (or the algorithm's epochs)")


@torch.no_grad()
def sgd_step(
    params: torch.Tensor, grads: torch.Tensor, momentum: torch.Tensor | None, lr: float, cfg: ClientConfig
) -> None:
    if cfg.clip_norm is not None:
        norm = torch.linalg.vector_norm(grads)
        if norm > cfg.clip_norm:
            grads.mul_(cfg.clip_norm / (norm + 1e-6))
    if cfg.weight_decay:
        grads.add_(params, alpha=cfg.weight_decay)
    if momentum is not None:
        momentum.mul_(cfg.momentum).add_(grads)
        grads = momentum
    params.add_(grads, alpha=-lr)


@torch.no_grad()
def evaluate(module: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: nn.Module, batch: int = 1024) -> np.ndarray:
    """One row of :data:`EVAL_FIELDS` sums (so clients can be pooled exactly on the server)."""
    row = np.zeros(len(EVAL_FIELDS))
    row[0] = len(x)
    for start in range(0, len(x), batch):
        xb, yb = x[start : start + batch], y[start : start + batch]
        out = module(xb)
        if yb.is_floating_point():
            row[2] += float(((out - yb) ** 2).sum())
            row[3] += float(yb.sum())
            row[4] += float((yb.double() ** 2).sum())
        else:
            row[1] += float((out.argmax(1) == yb).sum())
            row[2] += float(loss_fn(out, yb)) * len(xb)
    return row
