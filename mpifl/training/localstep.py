"""What an algorithm states of its local SGD and what it gets back (the executor, :mod:`mpifl.training.executor`, runs
it): the step (:class:`LocalStep`), each client's start (:class:`ClientStart`, one type for the loop and the
vectorized path) and run (:class:`ClientRun`), and the trained rows (:class:`TrainedRows`), left on the device."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from mpifl.training.config import ClientConfig
from mpifl.training.device import host_numpy

GradTransform = Callable[[torch.Tensor, torch.Tensor, Mapping[str, torch.Tensor]], None]
"""``transform(params, grads, rows)``: an algorithm's change of a block's gradients before the SGD step, in place,
as whole-block tensor operations. ``params`` and ``grads`` are ``[rows, numel]``; ``rows`` maps each per-client
value (:attr:`ClientStart.values`), each accumulator (:attr:`LocalStep.sums`) and ``"start"`` (the rows' start
parameters) to the block's rows of it. An accumulator is a view: adding to it in place accumulates."""


@dataclass(frozen=True)
class LocalStep:
    """An algorithm's local SGD, stated once for the loop and the vectorized path (see the module's docstring)."""

    transform: GradTransform | None = None  # the gradient's change before each step; None: plain gradients
    sums: tuple[str, ...] = ()  # float64 accumulators, one row per client, zero at the start (SCAFFOLD's Σ gₖ)
    carries_momentum: bool = False  # each client brings its momentum and takes it back (FedALS), else it starts at 0
    config: ClientConfig | None = None  # the client's SGD settings; None: ``client.*``
    lr: float | None = None  # None: the config's
    steps: int | None = None  # local steps; None: the config's steps or epochs
    part: slice = field(default_factory=lambda: slice(None))  # only this span trains, the rest stays frozen
    delta: bool = False  # give final − start (computed where the rows are: same float32 bits anywhere)
    gradient: bool = False  # no SGD: each run's gradient of its mean loss over all its samples at its start, plus


Rows = np.ndarray | torch.Tensor
"""A client's row: a host array (read-only views of received rows are fine) or a tensor (a state kept on the
device, copied nowhere)."""


@dataclass(frozen=True)
class ClientStart:
    """Where one client's local SGD starts and what its step reads: the one start of the loop and the vectorized
    path."""

    params: Rows  # the workspace's own parameters are trained in place (:func:`local_sgd`)
    values: Mapping[str, Rows] = field(default_factory=dict)  # per-client values the transform reads
    momentum: Rows | None = None  # the carried momentum, with ``LocalStep.carries_momentum``
    purpose: int = 0  # the client's generator is keyed by (seed, round, client, purpose)


@dataclass(frozen=True)
class ClientRun:
    """One client's local SGD: its start, its training data and the generator of its batches (none for
    :attr:`LocalStep.gradient`, which draws nothing)."""

    start: ClientStart
    x: torch.Tensor
    y: torch.Tensor
    generator: torch.Generator | None = None


@dataclass(frozen=True)
class TrainedRows:
    """What :meth:`LocalSGD.train` leaves, on the training device, one row per run in the order given: nothing here
    has been read."""

    params: torch.Tensor  # final parameters, or final − start with ``LocalStep.delta``
    loss_sums: torch.Tensor  # float64: each run's Σ of its steps' losses
    steps: np.ndarray  # int64: the local steps each run took
    sums: dict[str, torch.Tensor]  # float64 accumulators of ``LocalStep.sums``
    momentum: torch.Tensor | None  # the momentum each run ends with (``LocalStep.carries_momentum``)
    timer: Timer

    @property
    def seconds(self) -> np.ndarray:
        """Each run's compute seconds: its own in the loop, an equal share of its group's in the vectorized path; on a
        GPU measured by device events (read after :meth:`mean_losses`, when the work is done)."""
        return self.timer.seconds()

    def mean_losses(self) -> np.ndarray:
        """Every run's mean training loss, in one device→host copy."""
        return host_numpy(self.loss_sums) / np.maximum(self.steps, 1)

    def host(self, *names: str) -> list[np.ndarray]:
        """The named results (``params``, ``momentum`` or an accumulator) in host memory, in one device→host copy
        where they live on a GPU (views on the CPU)."""
        tensors = [getattr(self, name) if name in ("params", "momentum") else self.sums[name] for name in names]
        return read_together(tensors)


def read_together(tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """``tensors`` in host memory with one device→host copy for all of them (their bytes packed on the device
    first); on the CPU their own memory."""
    if not tensors or tensors[0].device.type == "cpu":
        return [host_numpy(t) for t in tensors]
    packed = host_numpy(torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors]))
    out, offset = [], 0
    for t in tensors:
        size = t.numel() * t.element_size()
        dtype = torch.empty(0, dtype=t.dtype).numpy().dtype
        out.append(packed[offset : offset + size].view(dtype).reshape(t.shape))
        offset += size
    return out


class Timer:
    """Compute seconds of groups of runs: wall time on the CPU, device events on a GPU (asynchronous launches make
    the host's clock measure only their enqueueing)."""

    def __init__(self, runs: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self.spans: list[tuple[list[int], object, object]] = []
        self.runs = runs

    def start(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, members: list[int], began: object) -> None:
        self.spans.append((members, began, self.start()))

    def seconds(self) -> np.ndarray:
        seconds = np.zeros(self.runs)
        for members, began, ended in self.spans:
            if self.cuda:
                ended.synchronize()  # type: ignore[attr-defined]  # done already once the losses were read
                span = began.elapsed_time(ended) / 1e3  # type: ignore[attr-defined]
            else:
                span = ended - began  # type: ignore[operator]
            seconds[members] += span / len(members)  # a run in several spans (phases) takes each share
        return seconds


@dataclass(frozen=True)
class TrainStats:
    """What one client's :func:`local_sgd` reports. The loss stays on the device until :attr:`mean_loss` reads it:
    one device→host copy per client, never one per step."""

    steps: int
    loss_sum: torch.Tensor  # Σ of the steps' losses, a float64 scalar on the training device

    @property
    def mean_loss(self) -> float:
        return float(self.loss_sum) / max(self.steps, 1)
