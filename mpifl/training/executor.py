"""One executor for every algorithm's local SGD: the step is stated once, the executor chooses how to run it.

An algorithm says what its local step is (:mod:`mpifl.training.localstep`'s ``LocalStep``): the configuration,
learning rate and step count, and how it changes a gradient, as one operation on a block of client rows
(``GradTransform``: FedProx's μ(P − A), SCAFFOLD's correction and its running gradient sum, each a whole-block
tensor operation), with the per-client values that operation reads (``ClientStart``: SCAFFOLD's c − cᵢ, FedALS's
carried momentum). The executor (:class:`LocalSGD`) then runs every client's local SGD through one step function
(:func:`_step_block`: the transform, clipping, weight decay, momentum and the SGD update, elementwise on the
block), with one of two engines computing the block's gradients:

* the **loop** (``vectorized=False``): one row at a time on the shared workspace model with plain autograd, whose
  bits are the CPU's results of record (a row's block is ``[1, numel]``, the elementwise step the same bits as
  on a vector);
* the **vectorized path** (``vectorized=True``, ``client.vectorize``): clients whose batch sizes agree at every
  step as rows of one parameter matrix on the device, one gradient per call of rows (autograd over a
  ``torch.func.vmap``-ped forward pass); their data concatenated on the device, one index tensor for all their
  steps' batches (each client's batch order and augmentation drawn on the host from its own generator, in the
  loop's order, so schedules stay bitwise), the start copied up once however many clients share it, the losses
  summed on the device and the results left there (:class:`TrainedRows`), so nothing is read per client or per
  step.

A client's update must not depend on which clients share its rank, or results would change with the rank
count. So with the vectorized path on, every client goes through it, a group of one included, and on the CPU it
runs on one intra-op thread: a batched matrix product then computes each client's rows alone, the same for any number
of rows (tests check it at two threads). A batched convolution is different: vmap runs it as one grouped
convolution, whose algorithm, and rounding, may change with the number of groups (on this CPU it does for one or
two clients), and so may a GPU's batched kernels. For convolutional models, and for every model on a GPU, each
call therefore gets exactly :attr:`LocalSGD.chunk` rows, the last call padded with copies of one of its clients
whose results are dropped (tests check that a client's update is then the same in any company and at any
position). The chunk is fixed by the config
(:func:`~mpifl.training.vectorizing.auto_chunk`) so that padding stays small on any rank count.

The two engines agree bitwise for dense models of any width, on any CPU path (the vectorized path's linear layers
multiply in the loop's order: :mod:`mpifl.training.rounding`; tests check it), but round differently for convolutions:
``client.vectorize`` is a setting of the results, like ``threads_per_rank``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, vmap

from mpifl.models.flat import FlatModel
from mpifl.training.config import ClientConfig
from mpifl.training.localstep import ClientRun, ClientStart, LocalStep, Rows, Timer, TrainedRows, TrainStats
from mpifl.training.rounding import LoopRounding
from mpifl.training.sgd import BatchPlan, batch_plan, sgd_update, to_device
from mpifl.training.stepbuffers import StepBuffers, StepGraphs
from mpifl.training.vectorizing import call_slices, padded_rows

    # weight decay, is the row it leaves (FedSGD's full gradients, Karula's gradient queries)


class LocalSGD:
    """Runs :class:`LocalStep` for many clients on one flat model, through the loop or the vectorized path."""

    def __init__(self, model: FlatModel, loss_fn: nn.Module, vectorized: bool, chunk: int, cuda_graph: bool = False):
        """``vectorized``: the vectorized path, else the loop; ``chunk``: the rows of every call where their count
        matters;
        ``cuda_graph``: on CUDA, the vectorized path's step captured once per call and replayed
        (``client.cuda_graph``)."""
        self.model, self.loss_fn, self.vectorized = model, loss_fn, vectorized
        self.buffers = StepBuffers(model.device)
        self.cuda_graph = cuda_graph and model.device.type == "cuda"
        module, names, shapes = model.module, model.names, model.shapes
        sizes = model.segment_sizes()
        grouped = (nn.modules.conv._ConvNd, nn.modules.batchnorm._BatchNorm)
        count_matters = model.device.type != "cpu" or any(isinstance(m, grouped) for m in module.modules())
        self.chunk: int | None = chunk if count_matters else None  # rows of every call, if fixed

        def forward(flat: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            params = {name: part.view(shape) for name, part, shape in zip(names, flat.split(sizes), shapes)}
            out = functional_call(module, params, (x,))
            return loss_fn(out, y), out

        self._rows_forward: Callable = vmap(forward)

    def row_gradients(self, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor
               ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Each row's gradient of its loss on its batch (``params`` ``[rows, numel]``, ``x`` and ``y`` one batch
        per row), with each row's loss and outputs: plain autograd over the rows' vmapped forward pass. A row's loss
        depends on its own parameters alone, so the gradient of the losses' sum is every row's own gradient,
        without ``torch.func.grad``'s import of ``torch._dynamo`` on its first call: a second of CPU in every
        process that trains with the vectorized path (docs/how-to/tests.md). Linear layers run as
        :class:`~mpifl.training.rounding.LoopRounding` says, so their weight gradients round as the loop's on every
        CPU (autograd's batched product alone swaps their operands)."""
        # on the CPU, linear layers' products in the loop's order (MKL's rounding; a GPU's batched products are
        # another matter, not measured: there the vectorized path stays as it was)
        rounding = LoopRounding() if params.device.type == "cpu" else contextlib.nullcontext()
        with torch.enable_grad(), rounding:
            rows = params.detach().requires_grad_()
            losses, outputs = self._rows_forward(rows, x, y)
            (gradients,) = torch.autograd.grad(losses.sum(), rows)
        return gradients, (losses.detach(), outputs.detach())

    def train(self, runs: Sequence[ClientRun], step: LocalStep, cfg: ClientConfig) -> TrainedRows:
        """Local SGD of every run as ``step`` says (``cfg``: ``client.*``, unless ``step`` names its own)."""
        cfg = step.config or cfg
        plans = [_plan(run, step, cfg) for run in runs]
        timer = Timer(len(runs), self.model.device)
        pieces = []
        if self.vectorized:
            groups: dict[tuple[int, ...], list[int]] = {}
            for k, plan in enumerate(plans):
                groups.setdefault(plan.sizes, []).append(k)
            with self._threads():
                for members in groups.values():
                    began = timer.start()
                    pieces.append(self._train_vectorized(members, runs, plans, step, cfg))
                    timer.stop(members, began)
        else:
            for k in range(len(runs)):
                began = timer.start()
                pieces.append(self._train_alone(k, runs[k], plans[k], step, cfg))
                timer.stop([k], began)
        if not runs:
            return _nothing_trained(self.model, step, timer)
        return _assemble(pieces, len(runs), np.array([len(p) for p in plans], dtype=np.int64), timer)

    def _train_alone(self, k: int, run: ClientRun, plan: BatchPlan, step: LocalStep, cfg: ClientConfig) -> _Piece:
        """The loop: run ``k`` on the workspace model with plain autograd, its block one row."""
        model, device, start = self.model, self.model.device, run.start
        if start.params is not model.params:
            model.load(start.params)
        # a copy, made before the workspace trains (it may be the start), where the transform or the delta reads it
        kept = self._stacked([start.params]) if step.delta or step.transform is not None else None
        block = _Block(model.params[None], self._momentum([run], [0], step, cfg),
                       {name: self._stacked([value]) for name, value in start.values.items()},
                       {name: torch.zeros(1, model.numel, dtype=torch.float64, device=device) for name in step.sums},
                       lambda: kept)  # type: ignore[arg-type,return-value]
        lr = cfg.lr if step.lr is None else step.lr
        plain = (not step.gradient and step.transform is None and block.momentum is None and cfg.clip_norm is None
                 and not cfg.weight_decay and _part_size(step.part, model.numel) == model.numel)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        plan = plan.to(device)
        for index in range(len(plan)):
            xb, yb = plan.batch(run.x, run.y, index)
            loss = self.loss_fn(model.module(xb), yb)
            loss_sum += loss.detach()
            if plain:  # nothing needs the gradient as one vector: the update parameter by parameter (same bits)
                for param, grad in model.fresh_gradients(loss):
                    sgd_update(param[None], grad[None], None, lr, cfg)
                continue
            model.compute_gradient(loss)
            if step.gradient:
                block.params = _with_decay(model.grads[None], model.params[None], cfg)
            else:
                _step_block(block, model.grads[None], slice(0, 1), step, lr, cfg)
        if not step.delta:  # the workspace trains the next client: keep this one's rows apart
            block.params = block.params.clone()
        return _Piece.of([k], block, 1, step, loss_sum[None])

    def _train_vectorized(self, members: list[int], runs: Sequence[ClientRun], plans: Sequence[BatchPlan],
                     step: LocalStep, cfg: ClientConfig) -> _Piece:
        """The vectorized path: ``members`` (the same batch sizes at every step) as rows of one block, padded to whole
        calls. The block's parameters and momentum, and each call's sample indices, inputs and targets, live in
        :class:`StepBuffers` (the same storage step after step and round after round); with ``cuda_graph`` each
        call's step is captured once (per batch size) and replayed (:class:`StepGraphs`)."""
        device = self.model.device
        group = [runs[k] for k in members]
        order = padded_rows(len(members), self.chunk)  # the rows: the runs, then copies that pad the last call
        x = torch.cat([run.x for run in group]) if len(group) > 1 else group[0].x
        y = torch.cat([run.y for run in group]) if len(group) > 1 else group[0].y
        offsets = np.cumsum([0] + [len(run.x) for run in group])
        plan = BatchPlan.stacked([plans[members[k]] for k in order], [offsets[k] for k in order]).to(device)
        params, starts = self._stack_starts([run.start.params for run in group], order)
        values = {name: self._stacked([group[k].start.values[name] for k in order]) for name in group[0].start.values}
        sums = {name: torch.zeros(len(order), self.model.numel, dtype=torch.float64, device=device)
                for name in step.sums}
        block = _Block(params, self._momentum(group, order, step, cfg), values, sums, starts)
        loss_sums = torch.zeros(len(order), dtype=torch.float64, device=device)
        graphs = StepGraphs() if self.cuda_graph else None
        for index in range(len(plan)):
            for slot, call in enumerate(call_slices(len(order), self.chunk)):
                size = call.stop - call.start, plan.bounds[index + 1] - plan.bounds[index]
                into = (self.buffers.get("index", size, torch.int64),
                        self.buffers.get("x", (*size, *x.shape[1:]), x.dtype), self.buffers.get("y", size, y.dtype))
                xb, yb = plan.batch(x, y, index, call, into)
                one_step = functools.partial(self._call_step, block, call, xb, yb, loss_sums, len(group) - call.start,
                                             step, cfg)
                if graphs is None:
                    one_step()
                else:
                    graphs.run((slot, size), one_step)
        return _Piece.of(members, block, len(group), step, loss_sums[: len(group)])

    def _call_step(self, block: _Block, call: slice, xb: torch.Tensor, yb: torch.Tensor, loss_sums: torch.Tensor,
                   real: int, step: LocalStep, cfg: ClientConfig) -> None:
        """One call's step: its rows' gradients on their batches, their losses added to ``loss_sums``, then the
        step; nothing read (a CUDA graph captures it). The gradients are autograd's own tensor, which a captured
        graph keeps at one address of its private pool from replay to replay: no copy into a buffer of ours."""
        grads, (loss, outputs) = self.row_gradients(block.params[call], xb, yb)
        with torch.no_grad():
            loss_sums[call] += self._losses(loss, outputs, yb, real)
            if step.gradient:  # one step, each call its own rows: the gradient takes the start's place
                block.params[call] = _with_decay(grads, block.params[call], cfg)
            else:
                _step_block(block, grads, call, step, cfg.lr if step.lr is None else step.lr, cfg)

    def _losses(self, vmapped: torch.Tensor, outputs: torch.Tensor, yb: torch.Tensor, real: int) -> torch.Tensor:
        """Each row's loss: on a GPU the vmapped loss the gradient came from (one call for all rows); on the CPU
        each of the first ``real`` rows' computed alone, as the loop computes it, which keeps every CPU result's
        bits (a vmapped mean rounds differently), and the padding rows' left as they are (dropped)."""
        if self.model.device.type != "cpu" or real <= 0:
            return vmapped
        alone = [self.loss_fn(out, target) for out, target in zip(outputs[:real], yb[:real])]
        return torch.cat([torch.stack(alone), vmapped[real:]]) if real < len(vmapped) else torch.stack(alone)

    def _stacked(self, rows: Sequence[Rows]) -> torch.Tensor:
        """Per-client values as one block on the device (a new tensor): host arrays in one asynchronous copy,
        tensors (on the device already, or anywhere) stacked where they are, then moved if they are not there."""
        device = self.model.device
        if all(isinstance(row, np.ndarray) for row in rows):
            return to_device(torch.from_numpy(np.stack(rows)), device)  # type: ignore[arg-type]
        return torch.stack([torch.as_tensor(row).to(device, non_blocking=device.type != "cpu") for row in rows])

    def _momentum(self, runs: Sequence[ClientRun], order: Sequence[int], step: LocalStep, cfg: ClientConfig
                  ) -> torch.Tensor | None:
        """The rows' momentum buffers: carried in (FedALS) or zero; None without momentum."""
        if cfg.momentum == 0:
            return None
        momentum = self.buffers.get("momentum", (len(order), _part_size(step.part, self.model.numel)))
        if step.carries_momentum:
            return momentum.copy_(self._stacked([runs[k].start.momentum for k in order]))  # type: ignore[misc]
        return momentum.zero_()

    def _stack_starts(self, starts: Sequence[Rows], order: Sequence[int]
                      ) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
        """The rows' start parameters on the device ([len(order), numel]), and what gives the starts again (as a
        tensor that broadcasts against them): each distinct start copied up once (a broadcast model, which every
        client's start is a view of, once for all). A start is a host array or a tensor (a client state kept on
        the device), told apart from the others by the memory it views."""
        distinct: dict[tuple, int] = {}  # (device, data pointer, strides) -> index among the firsts
        firsts: list[int] = []  # the first run of each distinct start
        which = []
        for k in order:
            key = _memory(starts[k])
            if key not in distinct:
                distinct[key] = len(firsts)
                firsts.append(k)
            which.append(distinct[key])
        unique = self._stacked([starts[k] for k in firsts])
        params = self.buffers.get("params", (len(order), self.model.numel), unique.dtype)
        if len(firsts) == 1:
            return params.copy_(unique.expand(len(order), -1)), lambda: unique.expand(len(order), -1)
        index = to_device(torch.tensor(which), self.model.device)
        return torch.index_select(unique, 0, index, out=params), lambda: unique[index]

    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        """One intra-op thread on the CPU while the vectorized path runs (see the module's docstring)."""
        threads = torch.get_num_threads()
        if threads == 1 or self.model.device.type != "cpu":
            yield
            return
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


@dataclass
class _Block:
    """The rows being trained: parameters, momentum (None without), per-client values, accumulators, starts."""

    params: torch.Tensor
    momentum: torch.Tensor | None
    values: dict[str, torch.Tensor]
    sums: dict[str, torch.Tensor]
    starts: Callable[[], torch.Tensor]

    def rows(self, call: slice) -> dict[str, torch.Tensor]:
        """What a transform reads for the rows ``call``: values, accumulators (views) and starts."""
        return {**{k: v[call] for k, v in self.values.items()}, **{k: v[call] for k, v in self.sums.items()},
                "start": self.starts()[call]}


@torch.no_grad()
def _step_block(block: _Block, grads: torch.Tensor, call: slice, step: LocalStep, lr: float, cfg: ClientConfig
                ) -> None:
    """The local step on rows ``call`` of ``block`` given their gradients: the algorithm's transform, then
    clipping, weight decay, momentum and params −= lr·update on ``step.part`` (elementwise, so each row's bits are
    those of the step on that row alone). The one step function of the loop and the vectorized path."""
    params = block.params[call]
    if step.transform is not None:
        step.transform(params, grads, block.rows(call))
    momentum = None if block.momentum is None else block.momentum[call]
    sgd_update(params[:, step.part], grads[:, step.part], momentum, lr, cfg)


def _with_decay(grads: torch.Tensor, params: torch.Tensor, cfg: ClientConfig) -> torch.Tensor:
    """A :attr:`LocalStep.gradient` row: the loss's gradient plus the configured weight decay at ``params``."""
    return grads + params * cfg.weight_decay if cfg.weight_decay else grads


def _plan(run: ClientRun, step: LocalStep, cfg: ClientConfig) -> BatchPlan:
    """``run``'s batches for ``step``: all its samples in order for a gradient, else drawn from its own generator."""
    if step.gradient:
        return BatchPlan.whole(len(run.x))
    if run.generator is None:
        raise ValueError("local SGD draws its batches from the run's generator: give ClientRun one")
    return batch_plan(len(run.x), cfg, run.generator, step.steps)


def _memory(start: Rows) -> tuple:
    """Which memory ``start`` views: two starts with the same are the same start."""
    if isinstance(start, torch.Tensor):
        return str(start.device), start.data_ptr(), start.stride()
    return "host", start.ctypes.data, start.strides


def _part_size(part: slice, numel: int) -> int:
    """How many of ``numel`` parameters the span ``part`` trains."""
    return len(range(numel)[part])


@dataclass(frozen=True)
class _Piece:
    """One group's results: the rows of its real runs, and which runs they are."""

    members: list[int]
    params: torch.Tensor
    loss_sums: torch.Tensor
    sums: dict[str, torch.Tensor]
    momentum: torch.Tensor | None

    @classmethod
    def of(cls, members: list[int], block: _Block, real: int, step: LocalStep, loss_sums: torch.Tensor) -> _Piece:
        """The real rows of ``block``, copied out of :class:`StepBuffers` (the next group trains there)."""
        params = block.params[:real]
        return cls(members, params - block.starts()[:real] if step.delta else params.clone(), loss_sums,
                   {name: total[:real] for name, total in block.sums.items()},
                   None if block.momentum is None or not step.carries_momentum else block.momentum[:real].clone())


def _nothing_trained(model: FlatModel, step: LocalStep, timer: Timer) -> TrainedRows:
    empty = torch.zeros(0, model.numel, device=model.device)
    return TrainedRows(empty, torch.zeros(0, dtype=torch.float64, device=model.device), np.zeros(0, np.int64),
                       {name: empty.double() for name in step.sums}, empty if step.carries_momentum else None, timer)


def _assemble(pieces: list[_Piece], count: int, steps: np.ndarray, timer: Timer) -> TrainedRows:
    """The groups' rows in the runs' order: one group's own tensors as they are (no copy, and no fresh buffer
    that deterministic mode would fill with NaN first), else gathered into new ones."""

    def joined(parts: list[torch.Tensor]) -> torch.Tensor:
        if len(parts) == 1 and pieces[0].members == list(range(count)):
            return parts[0]
        into = parts[0].new_empty((count, *parts[0].shape[1:]))
        for piece, part in zip(pieces, parts):
            _scatter(into, piece.members, part)
        return into

    momenta = [p.momentum for p in pieces]
    return TrainedRows(joined([p.params for p in pieces]), joined([p.loss_sums for p in pieces]), steps,
                       {name: joined([p.sums[name] for p in pieces]) for name in pieces[0].sums},
                       None if momenta[0] is None else joined(momenta),  # type: ignore[arg-type]
                       timer)


def _scatter(into: torch.Tensor, members: list[int], rows: torch.Tensor) -> None:
    """``into[members] = rows`` without an index upload where ``members`` are consecutive (the common case)."""
    if members == list(range(members[0], members[0] + len(members))):
        into[members[0] : members[0] + len(members)] = rows
    else:
        into.index_copy_(0, to_device(torch.tensor(members), into.device), rows)


def local_sgd(model: FlatModel, x: torch.Tensor, y: torch.Tensor, loss_fn: nn.Module, cfg: ClientConfig,
              generator: torch.Generator, steps: int | None = None, part: slice = slice(None)) -> TrainStats:
    """One client's local SGD on ``model`` in place, through the executor's loop (the one step): for an
    algorithm's own phases (FedRep's head then body, with one generator; a personalization before evaluation)."""
    executor = LocalSGD(model, loss_fn, vectorized=False, chunk=1)
    trained = executor.train([ClientRun(ClientStart(model.params), x, y, generator)], LocalStep(steps=steps, part=part),
                             cfg)
    return TrainStats(int(trained.steps[0]), trained.loss_sums[0])
