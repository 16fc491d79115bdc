"""Client-side arithmetic shared by algorithms: batch schedules, the SGD update, and evaluation (local SGD itself
runs in :mod:`mpifl.training.executor`).

A client's randomness comes only from (seed, round, client id), and every rank computes with one
thread, so a client's update is bitwise the same whichever rank hosts it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from mpifl.models.reductions import l2_norm
from mpifl.schema import ConfigError
from mpifl.training.config import ClientConfig
from mpifl.training.device import host_numpy

EVAL_FIELDS = ("n", "correct", "loss_sum", "y_sum", "y_sq_sum")


def client_generator(seed: int, round_: int, client: int, purpose: int = 0) -> torch.Generator:
    """A torch generator keyed by (seed, round, client, purpose) and nothing else."""
    state = np.random.SeedSequence([seed, round_, client, purpose]).generate_state(2, dtype=np.uint64)
    return torch.Generator().manual_seed(int(state[0] >> np.uint64(1)))


@dataclass(frozen=True)
class BatchPlan:
    """A client's batches for one round, drawn on the host: sample indices of every step end to end (step k's
    are ``rows[bounds[k] : bounds[k + 1]]``), and with ``crop_flip`` each sample's crop offsets and flip."""

    rows: torch.Tensor
    bounds: list[int]
    crops: torch.Tensor | None  # int64 [samples, 3]: dy, dx, flip (0/1)

    def __len__(self) -> int:
        return len(self.bounds) - 1

    @property
    def sizes(self) -> tuple[int, ...]:
        """Each step's batch size: clients with equal sizes can share every step's batched call."""
        return tuple(b - a for a, b in zip(self.bounds, self.bounds[1:]))

    def to(self, device: torch.device | str) -> BatchPlan:
        """The plan on ``device`` in one copy (pinned and asynchronous on a GPU)."""
        if torch.device(device).type == "cpu":
            return self
        rows = self.rows[..., None]
        packed = to_device(rows if self.crops is None else torch.cat([rows, self.crops], dim=-1), device)
        return BatchPlan(packed[..., 0], self.bounds, packed[..., 1:] if self.crops is not None else None)

    @classmethod
    def stacked(cls, plans: Sequence[BatchPlan], offsets: Sequence[int]) -> BatchPlan:
        """Plans of equal step sizes as one, a row of sample indices per plan (``rows`` ``[plans, samples]``), each
        plan's indices moved by its ``offsets`` (where its client's samples start in the clients' data end to
        end)."""
        rows = torch.stack([plan.rows + int(offset) for plan, offset in zip(plans, offsets)])
        crops = None if plans[0].crops is None else torch.stack([plan.crops for plan in plans])  # type: ignore[misc]
        return cls(rows, plans[0].bounds, crops)

    @classmethod
    def whole(cls, n: int) -> BatchPlan:
        """One step on all ``n`` samples in their order (a full-batch gradient)."""
        return cls(torch.arange(n), [0, n], None)

    def batch(self, x: torch.Tensor, y: torch.Tensor, step: int, clients: slice = slice(None),
              into: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``step``'s inputs and targets (augmented as the plan says): one batch, or for a :meth:`stacked`
        plan a batch per row of ``clients``. The one way from a plan to a batch. ``into``: the buffers (sample
        indices, inputs, targets) it is written into, the same storage step after step (a captured step reads
        them there), else new tensors."""
        first, last = self.bounds[step], self.bounds[step + 1]
        rows = self.rows[..., first:last]
        crops = None if self.crops is None else self.crops[..., first:last, :]
        if rows.dim() == 2:
            rows, crops = rows[clients], None if crops is None else crops[clients]
        if into is None:
            xb, yb = x[rows], y[rows]
        else:
            index, xb, yb = into
            flat = index.copy_(rows).view(-1)
            torch.index_select(x, 0, flat, out=xb.view(-1, *x.shape[1:]))
            torch.index_select(y, 0, flat, out=yb.view(-1))
        if crops is not None:  # each sample's crop, whatever the batch's leading dimensions
            cropped = apply_crops(xb.flatten(0, rows.dim() - 1), crops.flatten(0, rows.dim() - 1)).view_as(xb)
            xb = cropped if into is None else xb.copy_(cropped)
        return xb, yb


def batch_plan(n: int, cfg: ClientConfig, generator: torch.Generator, steps: int | None = None) -> BatchPlan:
    """The round's :func:`batch_schedule` and ``crop_flip`` draws on the host, in the order the step loop used to
    draw them (a pass's permutation, then each of its batches' crops), so a client's batches are bitwise what
    they were."""
    batches, crops = [], []
    for idx in batch_schedule(n, cfg, generator, steps):
        batches.append(idx)
        if cfg.augment == "crop_flip":
            crops.append(draw_crops(len(idx), generator))
    bounds = np.cumsum([0] + [len(b) for b in batches]).tolist()
    rows = torch.cat(batches) if batches else torch.zeros(0, dtype=torch.int64)
    return BatchPlan(rows, bounds, torch.cat(crops) if crops else None)


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device``: itself on the CPU, else one pinned asynchronous copy (no wait for the GPU)."""
    if torch.device(device).type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def training_batches(x: torch.Tensor, y: torch.Tensor, cfg: ClientConfig, generator: torch.Generator,
                     steps: int | None = None) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Each local step's batch (:func:`batch_plan`), augmented as ``cfg.augment`` says (shared by
    algorithms with their own loop). The plan is drawn at the first batch asked for."""
    plan = batch_plan(len(x), cfg, generator, steps).to(x.device)
    for step in range(len(plan)):
        yield plan.batch(x, y, step)


def draw_crops(b: int, generator: torch.Generator, pad: int = 4) -> torch.Tensor:
    """``crop_flip``'s random draws for ``b`` images (int64 [b, 3]: row offset, column offset, flip)."""
    dy = torch.randint(0, 2 * pad + 1, (b,), generator=generator)
    dx = torch.randint(0, 2 * pad + 1, (b,), generator=generator)
    flip = torch.rand(b, generator=generator) < 0.5
    return torch.stack([dy, dx, flip.long()], dim=1)


def crop_flip(x: torch.Tensor, generator: torch.Generator, pad: int = 4) -> torch.Tensor:
    """Random crop of each image from its ``pad``-zero-padded copy, then a horizontal flip with probability
    ½ (torchvision's RandomCrop(size, padding=4) and RandomHorizontalFlip, as the FedALS authors train on
    CIFAR and SVHN). mpifl's images are normalized when loaded, so the padding is the channel mean (0)
    rather than black."""
    return apply_crops(x, draw_crops(len(x), generator, pad).to(x.device), pad)


def apply_crops(x: torch.Tensor, crops: torch.Tensor, pad: int = 4) -> torch.Tensor:
    """The crops and flips of :func:`draw_crops` (on ``x``'s device) applied to the images ``x``."""
    b, _, h, w = x.shape
    padded = nn.functional.pad(x, (pad, pad, pad, pad))
    rows = crops[:, 0, None] + torch.arange(h, device=x.device)
    cols = crops[:, 1, None] + torch.arange(w, device=x.device)
    cols = torch.where(crops[:, 2, None] != 0, cols.flip(1), cols)
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
def sgd_update(params: torch.Tensor, grads: torch.Tensor, momentum: torch.Tensor | None, lr: float,
               cfg: ClientConfig) -> None:
    """The one SGD update, on a block of rows (``[rows, numel]``; a client alone is one row): each row's gradient
    clipped to ``cfg.clip_norm`` by its own norm, weight decay, momentum, then params −= lr·update, in place.
    Elementwise apart from each row's norm, so a row's bits are those of the update on that row alone, and without
    clipping the update on any span of a row is the update of that span (the executor's loop steps parameter by
    parameter on autograd's own gradients where nothing needs them as one vector)."""
    if cfg.clip_norm is not None:
        factors = torch.stack([clip_factor(l2_norm(row), cfg.clip_norm) for row in grads])
        grads.mul_(factors.to(grads.dtype)[:, None])
    if cfg.weight_decay:
        grads.add_(params, alpha=cfg.weight_decay)
    if momentum is not None:
        momentum.mul_(cfg.momentum).add_(grads)
        grads = momentum
    params.add_(grads, alpha=-lr)


def clip_factor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What scales a gradient of ``norm`` to norm ≤ ``max_norm`` (as ``clip_grad_norm_``), decided on the
    device: exactly 1.0 when no clipping is needed (so multiplying by it changes no bit), never a host branch
    on the norm (which would wait for the device every step)."""
    return torch.where(norm > max_norm, max_norm / (norm + 1e-6), 1.0)


@torch.no_grad()
def evaluate(module: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: nn.Module, batch: int = 1024) -> np.ndarray:
    """One row of :data:`EVAL_FIELDS` sums (so clients can be pooled exactly on the server); the batches'
    sums are read from the device once, then added in float64 in batch order."""
    row = np.zeros(len(EVAL_FIELDS))
    row[0] = len(x)
    sums = host_numpy(evaluation_sums(module, x, y, loss_fn, batch))
    sizes = [min(batch, len(x) - start) for start in range(0, len(x), batch)]
    for size, values in zip(sizes, sums, strict=True):
        if y.is_floating_point():
            row[2] += values[0]
            row[3] += values[1]
            row[4] += values[2]
        else:
            row[1] += values[0]
            row[2] += values[1] * size
    return row


@torch.no_grad()
def evaluation_sums(module: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: nn.Module, batch: int = 1024
                    ) -> torch.Tensor:
    """Per batch of ``batch`` samples, on the device, float64 [batches, 3]: for regression the squared error,
    Σy and Σy² (as float32, float32 and float64 sums), for classification the correct count, the mean
    loss (float32) and 0."""
    rows = []
    for start in range(0, len(x), batch):
        xb, yb = x[start : start + batch], y[start : start + batch]
        out = module(xb)
        if yb.is_floating_point():
            parts = [((out - yb) ** 2).sum(), yb.sum(), (yb.double() ** 2).sum()]
        else:
            parts = [(out.argmax(1) == yb).sum(), loss_fn(out, yb), torch.zeros((), device=yb.device)]
        rows.append(torch.stack([p.double() for p in parts]))
    return torch.stack(rows) if rows else torch.zeros((0, 3), dtype=torch.float64, device=x.device)
