"""Local SGD of many clients as one batched program on the rank's device (``torch.func.vmap``).

Clients whose batches have the same sizes at every step (equally many samples, or ``client.steps``) are trained
together as rows of one parameter matrix, on the device from start to end:

* their training data concatenated on the device once per call, and one index tensor for all their steps'
  batches (each client's batch order and augmentation drawn on the host from its own generator, in the loop's
  order, so schedules stay bitwise), moved in one copy;
* the start model copied up once however many clients share it (FedAvg's broadcast), expanded on the device;
* each step one vmapped gradient per call of rows, then clipping, weight decay, momentum and the SGD step on the
  whole block (elementwise, so each row's bits are those of the step on that row alone); a client's gradient
  hook (FedProx's proximal term, SCAFFOLD's correction) on its own row;
* the losses summed on the device, read by the caller once for all clients; the final parameters left on the
  device (:class:`KernelResult`), so a GPU worker's deltas never visit the host one by one.

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
from mpifl.training.device import host_numpy
from mpifl.training.sgd import BatchPlan, GradHook, TrainStats, apply_crops, batch_plan, batched_sgd_step, to_device

CPU_CHUNK, GPU_CHUNK = 16, 64
"""``client.vectorize_chunk: auto``'s rows per call on the CPU and on a GPU."""
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
    """What :meth:`VectorizedSGD.train` leaves, on the training device: nothing here has been read."""

    params: torch.Tensor  # each run's final parameters, one row per run in the order given
    loss_sums: torch.Tensor  # float64 [runs]: each run's Σ of its steps' losses
    steps: np.ndarray  # int64 [runs]: the local steps each run took
    seconds: np.ndarray  # each run's equal share of its group's time

    @property
    def stats(self) -> list[TrainStats]:
        return [TrainStats(int(s), total) for s, total in zip(self.steps, self.loss_sums)]

    def mean_losses(self) -> np.ndarray:
        """Every run's mean training loss, in one device→host copy."""
        return host_numpy(self.loss_sums) / np.maximum(self.steps, 1)


class VectorizedSGD:
    """Trains groups of clients of one flat model together."""

    def __init__(self, model: FlatModel, loss_fn: nn.Module, cfg: ClientConfig):
        self.model, self.loss_fn = model, loss_fn
        module, names, shapes = model.module, model.names, model.shapes
        sizes = model.segment_sizes()
        batched = (nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm)
        count_matters = model.device.type != "cpu" or any(isinstance(m, batched) for m in module.modules())
        chunk = cfg.vectorize_chunk
        if chunk == "auto":
            chunk = CPU_CHUNK if model.device.type == "cpu" else GPU_CHUNK
        self.chunk: int | None = chunk if count_matters else None  # rows of every call, if fixed

        def loss(flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor
                 ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
            params = {name: part.view(shape) for name, part, shape in zip(names, flat.split(sizes), shapes)}
            out = functional_call(module, params, (x,))
            value = loss_fn(out, y)
            return value, (value.detach(), out.detach())

        self.kernel: Callable = vmap(grad(loss, has_aux=True))

    def train(self, runs: Sequence[ClientRun], cfg: ClientConfig, steps: int | None = None, delta: bool = False
              ) -> KernelResult:
        """Local SGD of every run (``steps`` batches if given, else ``cfg``'s, as :func:`local_sgd`): runs whose
        batch sizes agree at every step together. With ``delta`` each row is final − start (computed on the
        device: a float32 difference has the same bits wherever it is computed)."""
        device = self.model.device
        plans = [batch_plan(len(run.x), cfg, run.generator, steps) for run in runs]  # each from its own generator
        groups: dict[tuple[int, ...], list[int]] = {}
        for k, plan in enumerate(plans):
            groups.setdefault(plan.sizes, []).append(k)
        params = torch.empty(len(runs), self.model.numel, device=device)
        loss_sums = torch.zeros(len(runs), dtype=torch.float64, device=device)
        seconds = np.empty(len(runs))
        with self._threads():
            for members in groups.values():
                began = time.perf_counter()
                rows, sums = self._train_group([runs[k] for k in members], [plans[k] for k in members], cfg, delta)
                if len(members) == len(runs):  # one group: its rows are the result, no copy
                    params, loss_sums = rows, sums
                else:
                    where = to_device(torch.tensor(members), device)
                    params.index_copy_(0, where, rows)
                    loss_sums.index_copy_(0, where, sums)
                seconds[members] = (time.perf_counter() - began) / len(members)
        return KernelResult(params, loss_sums, np.array([len(plan) for plan in plans], dtype=np.int64), seconds)

    def full_gradients(self, starts: Sequence[np.ndarray], xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor]
                       ) -> tuple[torch.Tensor, list[float]]:
        """Each client's gradient of its mean loss over all of ``x`` at its start (rows), and that loss (FedSGD):
        clients with equally many samples in calls of their own."""
        params, _ = self._stack_starts(starts, list(range(len(starts))))
        grads = torch.empty_like(params)
        losses = torch.empty(len(starts), dtype=torch.float64, device=params.device)
        sizes: dict[int, list[int]] = {}
        for k, x in enumerate(xs):
            sizes.setdefault(len(x), []).append(k)
        with self._threads():
            for members in sizes.values():
                order = self._padded(len(members))
                rows = [members[j] for j in order]
                for call in self._calls(len(rows)):
                    block = [rows[j] for j in range(call.start, call.stop)]
                    targets = torch.stack([ys[k] for k in block])
                    g, (loss, outputs) = self.kernel(params[block], torch.stack([xs[k] for k in block]), targets)
                    losses[block] = self._losses(loss, outputs, targets, len(block)).double()
                    grads[block] = g
        return grads, host_numpy(losses).tolist()

    def _train_group(self, runs: Sequence[ClientRun], plans: Sequence[BatchPlan], cfg: ClientConfig, delta: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Local SGD of ``runs`` (the same batch sizes at every step): their final parameters (or, with ``delta``,
        final − start) and loss sums."""
        device = self.model.device
        order = self._padded(len(runs))  # the rows: the runs, then copies that pad the last call
        x = torch.cat([run.x for run in runs]) if len(runs) > 1 else runs[0].x
        y = torch.cat([run.y for run in runs]) if len(runs) > 1 else runs[0].y
        offsets = np.cumsum([0] + [len(run.x) for run in runs])
        samples = to_device(torch.stack([plans[k].rows + int(offsets[k]) for k in order]), device)
        crops = None
        if plans[0].crops is not None:
            crops = to_device(torch.stack([plans[k].crops for k in order]), device)  # type: ignore[misc]
        params, starts = self._stack_starts([run.start for run in runs], order)
        momentum = torch.zeros_like(params) if cfg.momentum else None
        loss_sums = torch.zeros(len(order), dtype=torch.float64, device=device)
        bounds = plans[0].bounds
        for first, last in zip(bounds, bounds[1:]):
            for call in self._calls(len(order)):
                rows = samples[call, first:last]
                xb = x[rows]
                if crops is not None:
                    xb = apply_crops(xb.flatten(0, 1), crops[call, first:last].flatten(0, 1)).view_as(xb)
                yb = y[rows]
                g, (loss, outputs) = self.kernel(params[call], xb, yb)
                with torch.no_grad():
                    loss_sums[call] += self._losses(loss, outputs, yb, len(runs) - call.start)
                    for j in range(call.start, min(call.stop, len(runs))):
                        hook = runs[order[j]].hook
                        if hook is not None:
                            hook(params[j], g[j - call.start])
                    batched_sgd_step(params[call], g, None if momentum is None else momentum[call], cfg.lr, cfg)
        if delta:
            params.sub_(starts())
        return params[: len(runs)], loss_sums[: len(runs)]

    def _losses(self, vmapped: torch.Tensor, outputs: torch.Tensor, yb: torch.Tensor, real: int) -> torch.Tensor:
        """Each row's loss: on a GPU the vmapped loss the gradient came from (one call for all rows); on the CPU
        each of the first ``real`` rows' computed alone, as the loop computes it, which keeps every CPU result's
        bits (a vmapped mean rounds differently), and the padding rows' left as they are (dropped)."""
        if self.model.device.type != "cpu" or real <= 0:
            return vmapped
        alone = [self.loss_fn(out, target) for out, target in zip(outputs[:real], yb[:real])]
        return torch.cat([torch.stack(alone), vmapped[real:]]) if real < len(vmapped) else torch.stack(alone)

    def _stack_starts(self, starts: Sequence[np.ndarray], order: Sequence[int]
                      ) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
        """The rows' start parameters on the device ([len(order), numel]), and what gives the starts again (as a
        tensor that broadcasts against them): each distinct start copied up once (a broadcast model, which every
        client's start is a view of, once for all)."""
        distinct: dict[tuple[int, tuple[int, ...]], int] = {}  # (data pointer, strides) -> index among the firsts
        firsts: list[int] = []  # the first run of each distinct start
        which = []
        for k in order:
            key = (starts[k].ctypes.data, starts[k].strides)
            if key not in distinct:
                distinct[key] = len(firsts)
                firsts.append(k)
            which.append(distinct[key])
        unique = to_device(torch.from_numpy(np.stack([starts[k] for k in firsts])), self.model.device)
        if len(firsts) == 1:
            return unique.expand(len(order), -1).clone(), lambda: unique
        index = to_device(torch.tensor(which), self.model.device)
        return unique[index], lambda: unique[index]

    def _padded(self, count: int) -> list[int]:
        """Which run each row trains: every run once, then, with a fixed chunk, copies of the last call's first
        run up to a whole number of chunks (their results are dropped)."""
        if self.chunk is None or count % self.chunk == 0:
            return list(range(count))
        last = count - count % self.chunk
        return list(range(count)) + [last] * (self.chunk - count % self.chunk)

    def _calls(self, rows: int) -> list[slice]:
        """The rows of each call: all at once, or consecutive blocks of exactly ``self.chunk``."""
        step = self.chunk or rows
        return [slice(start, start + step) for start in range(0, rows, step)]

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
