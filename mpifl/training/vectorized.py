"""Local SGD of several clients as one computation (``torch.func.vmap``).

Clients that take equally many local steps are trained together: their parameters stacked as rows, one
vmapped gradient per step for the rows whose batches have the same shape (only a pass's short last batch
differs). Everything else stays per client: where it starts, its batch order and augmentation (drawn from its
own generator), its reported loss, its gradient hook (FedProx's proximal term, SCAFFOLD's correction),
clipping and the optimizer step on its row.

A client's update must not depend on which clients share its rank, or results would change with the rank
count. So with the kernel on, every client of the algorithm goes through it, a group of one included, and on
the CPU the kernel runs on one intra-op thread: a batched matrix product then computes each client's rows
alone, the same for any number of rows (tests check it at two threads). A batched convolution is different:
vmap runs it as one grouped convolution, whose algorithm, and rounding, may change with the number of groups
(on this CPU it does for one or two clients), and so may a GPU's batched kernels. For convolutional models,
and for every model on a GPU, each call therefore gets exactly ``client.vectorize_chunk`` rows, the last call
padded with copies of one of its clients whose results are dropped (tests check that a client's update is
then the same in any company and at any position).

The kernel and the one-at-a-time loop agree bitwise for narrow dense layers (tests check it) but round
differently for convolutions and wide layers: ``client.vectorize`` is a setting of the results, like
``threads_per_rank``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from mpifl.models.flat import FlatModel
from mpifl.training.config import ClientConfig
from mpifl.training.sgd import GradHook, TrainStats, planned_steps, sgd_step, training_batches

DENSE_MODELS = ("linear", "logistic", "mlp")
# no buffers (BatchNorm keeps no running statistics) and no randomness in the forward pass
VECTORIZABLE_MODELS = (*DENSE_MODELS, "cnn", "lenet", "convnet", "resnet20", "simple_cnn")


def kernel_wanted(cfg: ClientConfig, model_name: str, device: torch.device, cpu_default: bool) -> bool:
    """Whether a rank's clients train through the kernel. ``client.vectorize`` true or false decides for every
    vectorizable model. ``auto`` is the kernel on a GPU, where one launch for many clients should beat one per
    client; that default awaits a measurement on a GPU (benchmarks/bench_w2.py --device cuda). On the CPU
    ``auto`` keeps what was measured faster and was the default before, so CPU results stay as they were: the
    kernel for dense models when the caller's step is FedAvg's without a gradient hook (``cpu_default``;
    0.5–0.9× the loop's time, bench_vectorize.py), the loop for convolutional models (the kernel took 1.2–1.3×
    the loop's time for B1 unpadded, 1.5–2.4× padded, 2.0–2.9× for W2: RESULTS.md) and for the other
    algorithms."""
    if model_name not in VECTORIZABLE_MODELS or cfg.vectorize is False:
        return False
    if cfg.vectorize is True or device.type != "cpu":
        return True
    return cpu_default and model_name in DENSE_MODELS


@dataclass(frozen=True)
class ClientRun:
    """One client's local SGD for the kernel: its start, training data, generator and gradient hook."""

    start: np.ndarray
    x: torch.Tensor
    y: torch.Tensor
    generator: torch.Generator
    hook: GradHook | None = None


@dataclass(frozen=True)
class KernelResult:
    params: torch.Tensor  # each run's final parameters, one row per run in the order given
    stats: list[TrainStats]
    seconds: np.ndarray  # each run's equal share of its group's time


class VectorizedSGD:
    """Trains groups of clients of one flat model together."""

    def __init__(self, model: FlatModel, loss_fn: nn.Module, cfg: ClientConfig):
        self.model, self.loss_fn = model, loss_fn
        module, names, shapes = model.module, model.names, model.shapes
        sizes = model.segment_sizes()
        batched = (nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm)
        count_matters = model.device.type != "cpu" or any(isinstance(m, batched) for m in module.modules())
        self.chunk: int | None = cfg.vectorize_chunk if count_matters else None  # rows of every call, if fixed

        def loss(flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            params = {name: part.view(shape) for name, part, shape in zip(names, flat.split(sizes), shapes)}
            out = functional_call(module, params, (x,))
            return loss_fn(out, y), out.detach()

        self.kernel: Callable = vmap(grad(loss, has_aux=True))

    def train(self, runs: Sequence[ClientRun], cfg: ClientConfig, steps: int | None = None) -> KernelResult:
        """Local SGD of every run (``steps`` batches if given, else ``cfg``'s, as :func:`local_sgd`): runs with
        equally many steps together."""
        if not runs:
            return KernelResult(torch.empty(0, self.model.numel, device=self.model.device), [], np.empty(0))
        counts = [planned_steps(len(run.x), cfg, steps) for run in runs]
        params = torch.from_numpy(np.stack([run.start for run in runs])).to(self.model.device)
        stats: list[TrainStats] = [TrainStats(0, torch.zeros((), dtype=torch.float64))] * len(runs)
        seconds = np.empty(len(runs))
        with self._threads():
            for count in dict.fromkeys(counts):
                members = [k for k, c in enumerate(counts) if c == count]
                began = time.perf_counter()
                rows = params[members] if len(members) < len(runs) else params
                group_stats = self._train_group(rows, [runs[k] for k in members], cfg, steps)
                if rows is not params:
                    params[members] = rows
                for k, s in zip(members, group_stats):
                    stats[k] = s
                seconds[members] = (time.perf_counter() - began) / len(members)
        return KernelResult(params, stats, seconds)

    def full_gradients(self, starts: Sequence[np.ndarray], xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]
                       ) -> tuple[torch.Tensor, list[float]]:
        """Each client's gradient of its mean loss over all of ``x`` at its start (rows), and that loss (FedSGD)."""
        params = torch.from_numpy(np.stack(starts)).to(self.model.device)
        with self._threads():
            grads, losses = self._gradients(params, list(zip(xs, ys)))
        return grads, [float(loss) for loss in losses]

    def _train_group(self, params: torch.Tensor, runs: Sequence[ClientRun], cfg: ClientConfig,
                     steps: int | None) -> list[TrainStats]:
        """Local SGD of ``runs`` (equally many steps) on the rows of ``params``, in place."""
        momentum = torch.zeros_like(params) if cfg.momentum else None
        loss_sums = torch.zeros(len(runs), dtype=torch.float64, device=params.device)
        clients = [training_batches(run.x, run.y, cfg, run.generator, steps) for run in runs]
        done = 0
        for batches in zip(*clients):  # each client draws its batches (and augmentation) from its own generator
            grads, losses = self._gradients(params, batches)
            with torch.no_grad():
                loss_sums += torch.stack(losses)
            for k, run in enumerate(runs):
                if run.hook is not None:
                    run.hook(params[k], grads[k])
                sgd_step(params[k], grads[k], None if momentum is None else momentum[k], cfg.lr, cfg)
            done += 1
        return [TrainStats(done, s) for s in loss_sums]  # each loss read once, when the client reports it

    def _gradients(self, params: torch.Tensor, batches: Sequence[tuple[torch.Tensor, torch.Tensor]]
                   ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Each row's gradient at its batch and its loss (computed alone: a vmapped mean may round differently).
        Rows whose batches have one shape share calls; with a fixed chunk every call has exactly that many rows."""
        shapes: dict[tuple[int, ...], list[int]] = {}
        for k, (xb, _) in enumerate(batches):
            shapes.setdefault(tuple(xb.shape), []).append(k)
        grads: torch.Tensor | None = None
        losses: list[torch.Tensor] = [torch.empty(0)] * len(batches)
        for rows in shapes.values():
            for call in self._calls(rows):
                whole = call == list(range(len(batches)))
                xb = torch.stack([batches[k][0] for k in call])
                yb = torch.stack([batches[k][1] for k in call])
                g, outputs = self.kernel(params if whole else params[call], xb, yb)
                with torch.no_grad():
                    for j, k in enumerate(dict.fromkeys(call)):  # padding repeats a member: its first row counts
                        losses[k] = self.loss_fn(outputs[j], yb[j])
                if whole:
                    return g, losses
                if grads is None:
                    grads = torch.empty_like(params)
                real = list(dict.fromkeys(call))
                grads[real] = g[: len(real)]
        assert grads is not None
        return grads, losses

    def _calls(self, rows: list[int]) -> Iterator[list[int]]:
        """The rows of each call: all at once, or chunks of exactly ``self.chunk`` (the last padded by repeating
        its first row)."""
        if self.chunk is None:
            yield rows
            return
        for start in range(0, len(rows), self.chunk):
            part = rows[start : start + self.chunk]
            yield part + [part[0]] * (self.chunk - len(part))

    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        """One intra-op thread on the CPU while the kernel runs (see the module's docstring)."""
        threads = torch.get_num_threads()
        if threads == 1 or self.model.device.type != "cpu":
            yield
            return
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)
