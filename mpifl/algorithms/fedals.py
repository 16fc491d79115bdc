"""FedALS (Gholami & Seferoglu; spec fedals.md §1.3): the head h is averaged every τ local steps, the
representation extractor φ (the first L layer groups) every ατ.

A round is τ local steps. Each part (φ, h) has a period in rounds (α, 1) and moves as FedAvg does,
at its own frequency: the server's part goes down at the start of rounds r with (r − 1) % period = 0,
and the deltas since that download come up at the end of rounds with r % period = 0. Under full
participation this is exactly the paper's schedule with independent checks (spec §1.3, the `else if`
is a bug) and sync points (s + 1) % τ = 0 and (s + 1) % ατ = 0 of the local-step counter s. Per client
that is 2·[(T/τ)·P_h + (T/(ατ))·P_φ] parameters over T = Rτ steps (Table 2), α = 1 is FedAvg with
τ = ``tau`` element for element, and with ``scaffold`` each part carries its control variate
(Algorithm 4; α = 1 is SCAFFOLD). Clients keep their own model, momentum buffer (the paper's
optimizer state is never reset) and control variate between rounds; with partial participation a
client trains on the parts it last received and uploads its progress since then.

SCAFFOLD's cₖ⁺ of a part is the mean local gradient over the steps since the part's last reference (what
option II's (reference − θₖ)/(η·steps) − c + cₖ equals under plain SGD; see :mod:`.scaffold`), so it stays
right under momentum and ``lr_decay``.

The evaluated global model is the server's, except that φ is the average of all seen clients' current
φ (weighted as ``server.weighting`` weighs a sync) in rounds that did not sync it (the paper's "virtual
average"): before the evaluation every seen client uploads its φ (eval stage), chunk by chunk with
``eval_chunk``, and the server sums them in client-id order, so every client is scored on the same model.
BatchNorm keeps no running statistics during training (``mpifl.models.zoo.norm_layer``); γ and β are
parameters of their convolution's group. At
evaluation each seen client also uploads its BatchNorm statistics (its current model on its training
data: what its running statistics estimate), the server averages them by sample count as the authors
average running statistics, and every client evaluates the global model in inference mode with them
(``mpifl.models.norm``), never with its label-skewed test batch's statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Literal, cast

import numpy as np
import torch
from torch import nn

from mpifl.algorithms.base import Handler, Protocol, RunContext, ServerAlgorithm, StepContext
from mpifl.algorithms.fedavg import GlobalModel
from mpifl.algorithms.scaffold import corrected, population_weights, sample_shares, update_control
from mpifl.algorithms.state import ClientState, StateDict
from mpifl.algorithms.toolkit import ClientStart, ClientToolkit
from mpifl.comm.messages import LOCAL, Message, Step, require
from mpifl.models.flat import layer_groups
from mpifl.models.norm import norm_size, norm_statistics
from mpifl.schema import ConfigError, limits
from mpifl.training.localstep import LocalStep, Rows, TrainedRows, read_together
from mpifl.training.sgd import planned_samples, to_device


@dataclass(frozen=True)
class FedALSOptions:
    """FedALS: the head is averaged every round of τ local steps, the feature extractor every α rounds."""

    alpha: int = field(default=10, metadata=limits(ge=1))  # α: the extractor φ is averaged every α rounds
    tau: int = field(default=5, metadata=limits(ge=1))  # local steps per round (the head's period)
    # L: the extractor φ is the first L layer groups, the head h the rest; null: all groups but the last
    split_layer: int | None = field(default=None, metadata=limits(ge=0))
    scaffold: bool = False  # FedALS + SCAFFOLD (Algorithm 4)
    persistent_momentum: bool = True  # False: a fresh buffer every round, as FedAvg's clients
    # "authors": the authors' code's decaying rate lr_s = client.lr·10/(s/100 + 10) over the local-step
    # counter s (spec §3, "not_cte_lr"), held for a round at its first step's value; "none": client.lr
    lr_decay: Literal["none", "authors"] = "none"


def round_lr(lr: float, opts: FedALSOptions, round_: int) -> float:
    """``lr``, or with ``lr_decay: authors`` the authors' lr·10/(s/100 + 10) at the round's first local step
    s = (round − 1)·τ (within a round of τ = 5 steps the exact rate would change by < 0.5 %)."""
    if opts.lr_decay == "none":
        return lr
    return lr * 10.0 / ((round_ - 1) * opts.tau / 100.0 + 10.0)


Kind = Literal["params", "control"]


@dataclass(frozen=True)
class Part:
    """A contiguous span of the model synchronized every ``period`` rounds, and its messages: ``down`` and ``up``
    each hold the parameters' message, then (with ``scaffold``) the control variate's; ``spread`` carries each
    client's squared delta per layer group, for the consensus distance (simulator diagnostics, not logical)."""

    name: str
    span: slice
    period: int
    groups: tuple[int, ...]  # indices of its layer groups
    down: tuple[Message, ...]
    up: tuple[Message, ...]
    spread: Message

    @property
    def numel(self) -> int:
        return self.span.stop - self.span.start


class FedALSProtocol(Protocol):
    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        opts = ctx.options
        model = ctx.new_model()
        self.groups = layer_groups(model)
        split = len(self.groups) - 1 if opts.split_layer is None else opts.split_layer
        if split > len(self.groups):
            raise ConfigError(f"fedals.split_layer: {split} exceeds the {len(self.groups)} layer groups of the model")
        boundary = self.groups[split - 1].stop if split else 0
        parts = []
        for name, span, period, groups in (("extractor", slice(0, boundary), opts.alpha, range(split)),
                                           ("head", slice(boundary, model.numel), 1, range(split, len(self.groups)))):
            if span.stop == span.start:
                continue
            kinds: tuple[Kind, ...] = ("params", "control") if opts.scaffold else ("params",)
            names = {"params": name, "control": f"{name}_control"}
            down = tuple(Message(names[k], "down", span.stop - span.start, broadcast=True) for k in kinds)
            up = tuple(Message(f"{names[k]}_delta", "up", span.stop - span.start, update=True, summed="weighting")
                       for k in kinds)
            spread = Message(f"{name}_spread", "up", len(groups), "float64", logical=False, summed="weighting")
            part = Part(name, span, period, tuple(groups), down, up, spread)
            parts.append(part)
        self.parts = tuple(parts)
        self.extractor = next((p for p in self.parts if p.name == "extractor"), None)
        self.extractor_eval = Message("extractor_eval", "up", boundary) if self.extractor else None
        self.eval_msg = Message("eval_model", "down", model.numel, broadcast=True)
        stats = norm_size(model.module)
        self.norm_msg = Message("norm_statistics", "up", stats, "float64") if stats else None
        self.eval_norm_msg = Message("eval_norm_statistics", "down", stats, "float64", broadcast=True)

    def train_plan(self, round_: int) -> Sequence[Step]:
        down = [m for p in self.parts if (round_ - 1) % p.period == 0 for m in p.down]
        up = [m for p in self.uploads(round_) for m in (*p.up, p.spread)]
        return (*down, LOCAL, *up)

    def uploads(self, round_: int) -> tuple[Part, ...]:
        """The parts whose deltas come up at the end of ``round_`` (every ``period``-th round)."""
        return tuple(p for p in self.parts if round_ % p.period == 0)

    def eval_prelude(self) -> Sequence[Step]:
        return tuple(m for m in (self.extractor_eval, self.norm_msg) if m is not None)

    def eval_plan(self) -> Sequence[Step]:
        return (self.eval_msg, self.eval_norm_msg) if self.norm_msg else (self.eval_msg,)

    def samples_per_round(self) -> np.ndarray:
        return planned_samples(self.ctx.layout.train_sizes, self.ctx.cfg.client, self.ctx.options.tau)

    def client_state(self) -> dict[str, int]:
        """What a FedALS client keeps (float32 models, int64 step counts, a float64 gradient sum): the same bytes
        on a GPU, where all but the step counts are tensors."""
        opts, numel = self.ctx.options, 4 * self.eval_msg.numel
        state = {"model": numel, "reference": numel, "steps": 8 * len(self.parts)}
        if opts.persistent_momentum and self.ctx.cfg.client.momentum > 0:
            state["momentum"] = numel
        if opts.scaffold:
            state.update(control=numel, global_control=numel, gradient_sum=2 * numel)
        return state


class FedALSServer(ServerAlgorithm):
    protocol_type: type[FedALSProtocol] = FedALSProtocol
    protocol: FedALSProtocol
    server_optimizer = True

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        self.model = GlobalModel(ctx)
        self.control = np.zeros_like(self.params)
        self.synced: dict[str, int] = {}  # part → last round it was averaged
        self.metrics: dict[str, float] = {}
        self.eval_params: np.ndarray | None = None
        # the evaluation's running sums over the seen clients by message (φ, BatchNorm statistics), chunk after
        # chunk in client-id order
        self.sums: dict[str, np.ndarray] = {}
        self.means: dict[str, np.ndarray] = {}  # a part's mean delta this round, until its consensus is worked out

    def handlers(self) -> Mapping[Message, Handler]:
        p = self.protocol
        table: dict[Message, Handler] = {p.eval_msg: self.evaluated_model, p.eval_norm_msg: self.norm_statistics}
        for part in p.parts:
            table.update({part.down[0]: partial(self.part_params, part), part.up[0]: partial(self.average_part, part),
                          part.spread: partial(self.consensus, part)})
            if len(part.down) > 1:  # with scaffold: the part's control variate
                table.update({part.down[1]: partial(self.part_control, part),
                              part.up[1]: partial(self.update_part_control, part)})
        if p.extractor_eval is not None:
            table[p.extractor_eval] = partial(self.accumulate, p.extractor_eval, population_weights)
        if p.norm_msg is not None:
            table[p.norm_msg] = partial(self.accumulate, p.norm_msg, sample_shares)
        return table

    def part_params(self, part: Part, step: StepContext) -> np.ndarray:
        return self.params[part.span]

    def part_control(self, part: Part, step: StepContext) -> np.ndarray:
        return self.control[part.span]

    def update_part_control(self, part: Part, step: StepContext, total: np.ndarray) -> None:
        control = self.control.copy()
        control[part.span] = update_control(self.ctx, self.control[part.span], total)
        self.control = control

    def average_part(self, part: Part, step: StepContext, total: np.ndarray) -> None:
        mean = total / self.ctx.divisor(step.clients)
        self.means[part.name] = mean
        self.model.step(mean, part.span)
        self.synced[part.name] = step.round

    def consensus(self, part: Part, step: StepContext, squares: np.ndarray) -> None:
        """Per-layer consensus distance Σₖ wₖ‖θₖ − θ̄‖²/n_ℓ just before averaging (paper Fig. 1; the clients share
        the part's reference point, so θₖ − θ̄ is the spread of their deltas), from the sums of the clients'
        squared deltas per layer (``squares``) and the mean μ: Σₖ wₖ‖Δₖ‖² − (2 − Σₖ wₖ)‖μ‖²."""
        mean, shares = self.means.pop(part.name), self.ctx.weights(step.clients).sum()
        starts = [self.protocol.groups[g].start - part.span.start for g in part.groups]
        sizes = np.array([self.protocol.groups[g].stop - self.protocol.groups[g].start for g in part.groups])
        spread = squares / self.ctx.divisor(step.clients) - (2 - shares) * np.add.reduceat(mean**2, starts)
        self.metrics.update({f"consensus_layer{g + 1:02d}": float(d) for g, d in zip(part.groups, spread / sizes)})

    def accumulate(self, msg: Message, shares: Callable[[RunContext, np.ndarray], np.ndarray], step: StepContext,
                   rows: np.ndarray) -> None:
        """Add a chunk's φ (or BatchNorm statistics) to the evaluation's weighted sum over all seen clients: φ
        weighted as ``server.weighting`` weighs a sync, the statistics by sample count (they pool the clients'
        samples); the same ordered float64 sum whatever the chunks."""
        total = self.sums.setdefault(msg.name, np.zeros(msg.numel, dtype=np.float64))
        for w, row in zip(shares(self.ctx, step.clients), rows):
            total += w * row

    def norm_statistics(self, step: StepContext) -> np.ndarray:
        norm = require(self.protocol.norm_msg, "the BatchNorm statistics message")
        return require(self.sums.get(norm.name), "the clients' BatchNorm statistics")

    def evaluated_model(self, step: StepContext) -> np.ndarray:
        """The evaluated model: φ averaged over the seen clients unless this round already synced it (the
        paper's virtual average); worked out once per evaluation, after every chunk's φ came in."""
        extractor, message = self.protocol.extractor, self.protocol.extractor_eval
        average = self.sums.pop(message.name, None) if message is not None else None
        if extractor is not None and average is not None:
            self.eval_params = self.params
            if self.synced.get("extractor") != step.round:
                self.eval_params = self.params.copy()
                self.eval_params[extractor.span] = average.astype(np.float32)
        return self.params if self.eval_params is None else self.eval_params

    def end_evaluation(self) -> None:
        self.eval_params = None
        self.sums = {}

    @property
    def params(self) -> np.ndarray:
        return self.model.params

    def final_state(self) -> dict[str, np.ndarray]:
        control = {"control": self.control} if self.ctx.options.scaffold else {}
        return {"global_model": self.params, **control}

    def round_metrics(self) -> dict[str, float]:
        metrics, self.metrics = self.metrics, {}
        return metrics


class FedALSClient(ClientToolkit):
    """Client state: ``model`` θₖ, ``reference`` (each part as last received), ``steps`` (local steps since
    each part's reference), and as configured ``momentum``, ``control`` cₖ, ``global_control`` (c as last
    received) and ``gradient_sum`` (float64: the local gradients since each part's reference, for cₖ⁺).

    The vectors are tensors where the clients train (as SCAFFOLD keeps cᵢ): on a GPU they stay there within
    ``state_device_gb`` (beyond it the least recently used clients' come to the host, and go up again when they
    next train), so a round moves no client's model between host and device, only the received parts (up once
    for all the clients) and the deltas that go up (down in one copy for the clients trained together). On the
    CPU they are kept as arrays, the same bits. ``steps`` stays on the host, where cₖ⁺'s divisor is read."""

    protocol_type: type[FedALSProtocol] = FedALSProtocol
    protocol: FedALSProtocol
    scratch: tuple[str, ...] = ("deltas",)

    def __init__(self, ctx: RunContext, data, state: ClientState | None = None):  # noqa: ANN001
        super().__init__(ctx, data, state)
        self.initial = self.workspace.numpy().copy()  # a client's model before its first round, on the host
        self.initial_tensor = self.workspace.params.detach().clone()  # where new states are made from, on the device
        self.deltas: dict[tuple[str, int], np.ndarray] = {}  # (part, client) → this round's delta, on the host
        self.eval_params: np.ndarray | None = None
        self.eval_norm: np.ndarray | None = None

    def working(self, client: int) -> dict[str, torch.Tensor]:
        """This round's vectors of ``client`` (tensors on the training device, changed in place), created at its
        first participation; those kept on the host (on the CPU all, on a GPU a client's beyond ``state_device_gb``)
        become tensors of their working copies here: views on the CPU, copied up on a GPU."""
        st = self.state.edit(client)
        if not st:
            st.update(self.new_state())
        for name, value in list(st.items()):
            if isinstance(value, np.ndarray) and value.dtype.kind == "f":
                st[name] = to_device(torch.from_numpy(value), self.device)
        return {name: value for name, value in st.items() if isinstance(value, torch.Tensor)}

    def steps(self, client: int) -> np.ndarray:
        """``client``'s local steps since each part's reference (int64, on the host), once :meth:`working` made its
        state."""
        return cast(np.ndarray, self.state.edit(client)["steps"])

    def new_state(self) -> StateDict:
        """A client's state before its first round: its model and reference the initial model, the rest zero, made
        on the training device."""
        opts, cfg, initial = self.ctx.options, self.ctx.cfg.client, self.initial_tensor
        st: StateDict = {"model": initial.clone(), "reference": initial.clone(),
                         "steps": np.zeros(len(self.protocol.parts), dtype=np.int64)}
        if opts.persistent_momentum and cfg.momentum > 0:
            st["momentum"] = torch.zeros_like(initial)
        if opts.scaffold:
            st.update(control=torch.zeros_like(initial), global_control=torch.zeros_like(initial),
                      gradient_sum=torch.zeros_like(initial, dtype=torch.float64))
        return st

    def handlers(self) -> Mapping[Message, Handler]:
        p = self.protocol
        table: dict[Message, Handler] = {p.eval_msg: self.receive_evaluated, p.eval_norm_msg: self.receive_norm}
        for part in p.parts:
            table.update({part.down[0]: partial(self.receive_part, part), part.up[0]: partial(self.send_part, part),
                          part.spread: partial(self.send_spread, part)})
            if len(part.down) > 1:  # with scaffold: the part's control variate
                table.update({part.down[1]: partial(self.receive_part_control, part),
                              part.up[1]: partial(self.send_part_control, part)})
        if p.extractor_eval is not None:
            table[p.extractor_eval] = self.send_extractor
        if p.norm_msg is not None:
            table[p.norm_msg] = self.send_norm_statistics
        return table

    def receive_evaluated(self, step: StepContext, client: int, row: np.ndarray) -> None:
        self.eval_params = row

    def receive_norm(self, step: StepContext, client: int, row: np.ndarray) -> None:
        self.eval_norm = row

    def receive_part_control(self, part: Part, step: StepContext, client: int, row: np.ndarray) -> None:
        self.working(client)["global_control"][part.span] = self.on_device(step, row)

    def receive_part(self, part: Part, step: StepContext, client: int, row: np.ndarray) -> None:
        st, received = self.working(client), self.on_device(step, row)
        st["model"][part.span] = received
        st["reference"][part.span] = received
        self.steps(client)[self.protocol.parts.index(part)] = 0
        if "gradient_sum" in st:
            st["gradient_sum"][part.span] = 0.0

    def local_step(self, step: StepContext) -> LocalStep | None:
        """τ steps at the round's rate; the momentum carried over rounds (``persistent_momentum``); with
        ``scaffold`` each gradient corrected by c − cₖ and summed for cₖ⁺."""
        opts, cfg = self.ctx.options, self.ctx.cfg.client
        return LocalStep(corrected(cfg.weight_decay) if opts.scaffold else None,
                         sums=("gradient_sum",) if opts.scaffold else (),
                         carries_momentum=opts.persistent_momentum and cfg.momentum > 0,
                         lr=round_lr(cfg.lr, opts, step.round), steps=opts.tau)

    def local_start(self, step: StepContext, client: int) -> ClientStart:
        st = self.working(client)
        values = {"shift": st["global_control"] - st["control"]} if "control" in st else {}
        return ClientStart(st["model"], values, st.get("momentum"))

    def local_end(self, step: StepContext, clients: list[int], trained: TrainedRows) -> None:
        """θₖ and its momentum copied into each client's state and its gradient sum grown, where they were trained
        (nothing read; copies, not views, which would keep the whole trained block alive as long as one client's
        state holds its row); the deltas that go up this round come to the host (:meth:`host_deltas`)."""
        for k, client in enumerate(clients):
            st = self.working(client)
            st["model"].copy_(trained.params[k])
            if trained.momentum is not None:
                st["momentum"].copy_(trained.momentum[k])
            if "gradient_sum" in st:
                st["gradient_sum"] += trained.sums["gradient_sum"][k]
            steps = self.steps(client)
            steps += trained.steps[k]
        self.deltas.update(self.host_deltas(step, clients, trained))

    def host_deltas(self, step: StepContext, clients: list[int], trained: TrainedRows
                    ) -> dict[tuple[str, int], np.ndarray]:
        """θₖ − reference of each part that goes up this round, for each of ``clients`` (just trained), in host
        memory in one copy for all: it goes up from there, and :meth:`send_spread` sums its squares there."""
        parts = self.protocol.uploads(step.round)
        if not parts or not clients:
            return {}
        blocks = [trained.params[:, p.span] - torch.stack([self.working(c)["reference"][p.span] for c in clients])
                  for p in parts]
        return {(p.name, c): rows[k] for p, rows in zip(parts, read_together(blocks)) for k, c in enumerate(clients)}

    def send_extractor(self, step: StepContext, client: int) -> Rows:
        return self.current_model(client)[require(self.protocol.extractor, "the extractor part").span]

    def send_norm_statistics(self, step: StepContext, client: int) -> np.ndarray:
        self.workspace.load(self.current_model(client))
        split = self.data[client]
        return norm_statistics(self.workspace.module, split.x_train, self.ctx.cfg.client.batch_size)

    def send_part(self, part: Part, step: StepContext, client: int) -> np.ndarray:
        return self.deltas[part.name, client]

    def send_spread(self, part: Part, step: StepContext, client: int) -> np.ndarray:
        """‖Δ‖² of each of the part's layer groups (float64), for the server's consensus distance: numpy's sums of
        the delta that went up, on the host whatever the device."""
        delta = self.deltas.pop((part.name, client)).astype(np.float64)
        starts = [self.protocol.groups[g].start - part.span.start for g in part.groups]
        return np.add.reduceat(delta * delta, starts)

    def send_part_control(self, part: Part, step: StepContext, client: int) -> torch.Tensor:
        """Option II: cₖ⁺ = the mean local gradient since the part's reference, where the state is (the Δcₖ row
        stays there: a GPU folds it there). The divisor is a device scalar: CUDA would multiply by a host one's
        reciprocal, not divide."""
        st, span = self.working(client), part.span
        own = st["control"][span].clone()
        steps = max(int(self.steps(client)[self.protocol.parts.index(part)]), 1)
        divisor = torch.full((), steps, dtype=torch.float64, device=self.device)
        st["control"][span] = (st["gradient_sum"][span] / divisor).float()
        return st["control"][span] - own

    def current_model(self, client: int) -> Rows:
        """θₖ as its last round left it, where it is kept (a tensor on the device, or an array), or the initial
        model before its first participation."""
        return self.state.read(client).get("model", self.initial)

    def eval_model(self, step: StepContext, client: int, kind: str) -> nn.Module:
        self.workspace.load(require(self.eval_params, "the evaluated model"))
        return self.workspace.module

    def eval_norm_statistics(self, step: StepContext, client: int, kind: str, model: nn.Module) -> np.ndarray | None:
        return self.eval_norm
