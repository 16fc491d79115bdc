"""The algorithm interface: a protocol (declared messages and their order), a server side and a client side.

Both sides hold the same :class:`Protocol` (built from the same context), so they walk the same
plan. An algorithm never touches MPI. Each round the runtime walks the protocol's plan; for a down
message it asks the server for the payload and hands each participating client its row, for an
up message it asks each client for its row and hands the server all rows in client-id order,
and for :data:`~mpifl.comm.LOCAL` it lets each participating client compute. The runtime counts
every logical byte, so an algorithm's communication cost is exactly what its plan declares.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import numpy as np
import torch
from torch import nn

from mpifl.algorithms.state import ClientState
from mpifl.comm.exactsum import exact_sum
from mpifl.comm.messages import Message, Step, SumWeights
from mpifl.config import RunConfig
from mpifl.data import FederatedLayout
from mpifl.models import FlatModel, build_model, loss_function
from mpifl.models.norm import batch_norms, norm_statistics, normalized_with
from mpifl.schema import ConfigError, limits
from mpifl.training.config import ClientConfig
from mpifl.training.device import host_numpy
from mpifl.training.sgd import EVAL_FIELDS, GradHook, client_generator, evaluate, local_sgd, planned_samples
from mpifl.training.tensors import TensorSplit
from mpifl.training.vectorized import ClientRun, VectorizedSGD, kernel_wanted


@dataclass(frozen=True)
class NoOptions:
    """For algorithms without options of their own."""


@dataclass(frozen=True)
class RunContext:
    """What both sides know before training: the config, the data layout, the initial model; and where this
    rank's clients compute and the server's networks (the engine's choices from ``cfg.device`` and
    ``cfg.server.device``; the server's other state stays on the CPU)."""

    cfg: RunConfig
    layout: FederatedLayout
    device: torch.device = torch.device("cpu")
    server_device: torch.device = torch.device("cpu")

    @property
    def options(self):  # noqa: ANN201 - the algorithm's own frozen options dataclass
        return self.cfg.algorithm_options

    def new_model(self, device: torch.device | str = "cpu") -> FlatModel:
        """The initial model, identical on every rank (weights drawn on the CPU from the run's seed alone),
        on ``device``."""
        return FlatModel(build_model(self.cfg.model, self.layout, self.cfg.seed).to(device))

    def weights(self, clients: np.ndarray) -> np.ndarray:
        """Aggregation weights of ``clients``: by sample count (known to the server from the data layout), or
        equal (``server.weighting: uniform``); they sum to 1 except under DP's Poisson sampling."""
        return self.sum_weights("weighting", clients) / self.divisor(clients)

    def sum_weights(self, rule: SumWeights, clients: np.ndarray) -> np.ndarray:
        """What each of ``clients``' rows is multiplied by in a weighted sum (a :class:`Message`'s ``summed``):
        its training samples, or one (``uniform``; ``weighting``: as ``server.weighting`` says)."""
        if rule == "weighting":
            rule = "uniform" if self.cfg.server.weighting == "uniform" else "samples"
        if rule == "uniform":
            return np.ones(len(clients))
        return self.layout.train_sizes[clients].astype(np.float64)

    def divisor(self, clients: np.ndarray) -> float:
        """What a weighted sum over the accepted ``clients`` is divided by to be their mean: the sum of their
        weights; under DP's Poisson sampling with uniform weights, the expected cohort size instead (DP-FedAvg,
        McMahan et al. 2018: the cohort's size is random, and one client's influence must stay bounded by
        clip / expected size)."""
        poisson = self.cfg.privacy.mode != "off" and self.cfg.privacy.sampling == "poisson"
        if poisson and self.cfg.server.weighting == "uniform":
            return float(self.cfg.clients_per_round)
        return float(self.sum_weights("weighting", clients).sum())


Stage = Literal["setup", "train", "newcomer", "eval_prelude", "eval"]
T = TypeVar("T")


def require(value: T | None, what: str) -> T:
    """``value``, which an earlier step of the plan must have set; ``None`` means the steps came out of
    order (an algorithm bug, reported as such)."""
    if value is None:
        raise RuntimeError(f"{what} is missing: the plan's steps came out of order")
    return value


@dataclass(frozen=True)
class StepContext:
    """What the runtime tells an algorithm about the step it calls it for (built fresh for every step).

    ``round`` is the training round (1, 2, ...); 0 for the set-up plan; for the evaluation stages, the round
    just trained. ``stage`` is the plan being walked: ``setup`` (:meth:`Protocol.setup_plan`), ``train``,
    ``newcomer`` (new clients before an evaluation), ``eval_prelude`` and ``eval``. ``clients`` are the
    clients taking part in this step, ascending ids: for a down message the recipients, for an up message
    the senders whose rows the server accepted, for a local step the clients that compute (all of them on
    the server; on a worker, only the ones that worker hosts in ``compute_clients``)."""

    round: int
    stage: Stage
    clients: np.ndarray

    def with_clients(self, clients: np.ndarray) -> StepContext:
        return dataclasses.replace(self, clients=clients)


@dataclass(frozen=True)
class EvalLayout:
    """How one client's evaluation row is laid out: the :data:`~mpifl.training.sgd.EVAL_FIELDS` sums of every
    model kind (:attr:`Protocol.eval_kinds`) on every data split, kinds outermost. The one place that says so:
    the client writes its row in this order, the runtime sizes the message by it, the recorder reads it back."""

    kinds: tuple[str, ...]
    splits: tuple[str, ...]

    @property
    def pairs(self) -> list[tuple[str, str]]:
        return [(kind, split) for kind in self.kinds for split in self.splits]

    @property
    def width(self) -> int:
        return len(self.pairs) * len(EVAL_FIELDS)

    def blocks(self, rows: np.ndarray) -> list[tuple[tuple[str, str], np.ndarray]]:
        """Each (model kind, data split)'s :data:`EVAL_FIELDS` columns of evaluation ``rows``."""
        width = len(EVAL_FIELDS)
        return [(pair, rows[:, k * width : (k + 1) * width]) for k, pair in enumerate(self.pairs)]


class Protocol:
    """Message declarations and the order they move in; shared by both sides of an algorithm."""

    eval_kinds: tuple[str, ...] = ("global",)
    # True: a round's clients take the train plan one after another, each walk seeing the server state the
    # previous client's left (pFedHN's reference code); False: all of them walk it together.
    turns: bool = False
    setup_includes_unseen: bool = False  # walk the set-up plan among every client, not only the seen ones

    def __init__(self, ctx: RunContext):
        self.ctx = ctx

    def samples_per_round(self) -> np.ndarray:
        """Training samples each client passes forward and backward in one round (int64, per client id): what
        dynamic placement balances and ``network.seconds_per_sample`` charges before a deadline. The
        configured local SGD by default; an algorithm with its own step count or extra passes says so."""
        return planned_samples(self.ctx.layout.train_sizes, self.ctx.cfg.client)

    def train_plan(self, round_: int) -> Sequence[Step]:
        raise NotImplementedError

    def messages(self) -> list[Message]:
        """Every message this protocol declares (its attributes that are messages, or tuples, lists, dicts and
        dataclasses holding them at any depth): what the wire format checks its per-message settings against."""
        found: list[Message] = []

        def collect(value: object) -> None:
            if isinstance(value, Message):
                if value not in found:
                    found.append(value)
            elif isinstance(value, (tuple, list)):
                for item in value:
                    collect(item)
            elif isinstance(value, dict):
                collect(list(value.values()))
            elif dataclasses.is_dataclass(value) and not isinstance(value, type):
                collect(list(vars(value).values()))

        collect(list(vars(self).values()))
        return found

    def eval_prelude(self) -> Sequence[Step]:
        """Messages among every seen client that the server needs before any client's evaluation model is
        known (e.g. FedALS's virtual average of φ), walked chunk by chunk before :meth:`eval_plan`."""
        return ()

    def eval_plan(self) -> Sequence[Step]:
        """Messages that must move before clients can be evaluated (all clients take part)."""
        return ()

    def newcomer_plan(self) -> Sequence[Step]:
        """Messages that let clients never seen in training obtain their model (e.g. pFedHN's embedding
        optimization), walked among the unseen clients only, before :meth:`eval_plan` (ledger stage "eval")."""
        return ()

    def setup_plan(self) -> Sequence[Step]:
        """Messages that move once, before round 1, among all seen clients (e.g. Karula's reference set
        and embeddings). The runtime walks it as round 0 and records it under ledger stage "setup"."""
        return ()


Handler = Callable[..., Any]
"""A method that handles one declared message (see :meth:`ServerAlgorithm.handlers`,
:meth:`ClientAlgorithm.handlers`)."""


class _Handles:
    """Dispatch by declaration: each side of an algorithm maps every message of its protocol to the method that
    handles it (:meth:`handlers`), and the runtime finds the method by the message, never by comparing names.
    A protocol message without a handler is refused at set-up (:meth:`unhandled`)."""

    protocol: Protocol
    side = "side"

    def handlers(self) -> Mapping[Message, Handler]:
        return {}

    def unhandled(self) -> list[str]:
        """The protocol's messages this side has no handler for (the runtime refuses the algorithm then)."""
        table = self._table()
        return [msg.name for msg in self.protocol.messages() if msg.name not in table]

    def handler(self, msg: Message) -> Handler:
        table = self._table()
        if msg.name not in table:
            raise RuntimeError(f"{type(self).__name__} has no handler for message {msg.name!r}")
        return table[msg.name]

    def _table(self) -> dict[str, Handler]:
        table = self.__dict__.get("handler_table")  # built once, on first use (handlers may use late attributes)
        if table is None:
            table = self.__dict__["handler_table"] = {msg.name: fn for msg, fn in self.handlers().items()}
        return table


def send_from(outbox: dict[int, np.ndarray]) -> Handler:
    """A client's send handler that hands over what its local step left in ``outbox`` (client id -> row)."""
    return lambda step, client: outbox.pop(client)


def check_handlers(*sides: _Handles | None) -> None:
    """Refuse an algorithm whose protocol declares a message that one of its sides does not handle."""
    for side in sides:
        missing = side.unhandled() if side is not None else []
        if side is not None and missing:
            raise ConfigError(f"algorithm {type(side).__name__}: no {side.side} handler for message(s) "
                              f"{', '.join(missing)} (declare them in its handlers())")


class ServerAlgorithm(_Handles):
    """Lives on rank 0: global state and the server's step for each message.

    :meth:`handlers` maps each message to its method: for a down message ``fn(step) -> payload`` (one row if
    broadcast, else one row per client of ``step.clients``), for an up message ``fn(step, rows)`` with the
    accepted clients' rows in client-id order, or for a summed one ``fn(step, total)`` with their weighted sum
    (``RunContext.sum_weights``; ``RunContext.divisor`` makes it a mean)."""

    protocol_type: type[Protocol] = Protocol
    side = "server"
    # True: the server steps a global model from an averaged update through ``server.optimizer``
    # (:class:`~mpifl.algorithms.fedavg.GlobalModel`); False: any other optimizer than sgd is refused
    server_optimizer: bool = False
    networks: bool = False  # True: torch networks of its own, which compute on ``server.device`` (PeFLL, pFedHN)

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        self.protocol = self.protocol_type(ctx)

    def payload(self, msg: Message, step: StepContext) -> np.ndarray:
        return self.handler(msg)(step)

    def consume(self, msg: Message, step: StepContext, rows: np.ndarray) -> None:
        """The accepted clients' rows of ``msg``; a summed message's handler gets their exact weighted sum (what
        the runtime reduces across ranks), worked out here from the rows (one group only)."""
        if msg.summed is None:
            self.handler(msg)(step, rows)
            return
        if msg.groups > 1:
            raise ValueError(f"message {msg.name}: its {msg.groups} sums need each client's group, not rows")
        self.consume_sum(msg, step, exact_sum(rows, self.ctx.sum_weights(msg.summed, step.clients))[None])

    def consume_sum(self, msg: Message, step: StepContext, totals: np.ndarray) -> None:
        """A summed message: Σ weightᵢ·rowᵢ over the accepted ``step.clients`` (float64, one row per group),
        handed to its handler as the sum (one group) or the groups' sums."""
        self.handler(msg)(step, totals[0] if msg.groups == 1 else totals)

    def round_metrics(self) -> dict[str, float]:
        """Extra per-round scalars an algorithm wants logged (e.g. solver iterations)."""
        return {}

    def eval_metrics(self) -> dict[str, float]:
        """Extra scalars for the evaluation row, computed from what the eval plan brought the server
        (e.g. PeFLL's descriptor rank correlation)."""
        return {}

    def end_evaluation(self) -> None:
        """Forget what only the evaluation that just ended needed (e.g. its evaluated model)."""

    def final_state(self) -> dict[str, np.ndarray]:
        """Server arrays stored in the results file at the end (e.g. the global model)."""
        return {}


@dataclass(frozen=True)
class AsynchronousOptions:
    """The options every asynchronous algorithm has."""

    concurrency: int = field(default=0, metadata=limits(ge=0))  # clients training at once; 0: clients_per_round


class AsynchronousProtocol(Protocol):
    """One round is one server step of an event-driven protocol: clients are dispatched and arrive one event at a
    time on the simulated clock (:mod:`mpifl.runtime.asynchronous` walks it; FedBuff, FedAsync). Its options
    extend :class:`AsynchronousOptions`."""

    @property
    def concurrency(self) -> int:
        """How many clients train at once."""
        return int(self.ctx.options.concurrency) or self.ctx.cfg.clients_per_round


class EventDrivenServer(ServerAlgorithm):
    """The server of an :class:`AsynchronousProtocol`. It alone knows who is in flight and when each arrives (the
    runtime dispatches, moves the messages and asks for arrivals), so its state, checkpointed with it, carries the
    events in flight. An upload is held (:meth:`hold`) until its client's simulated arrival; a subclass says what
    an arrival does (:meth:`on_arrival`)."""

    protocol_type: type[AsynchronousProtocol] = AsynchronousProtocol
    protocol: AsynchronousProtocol

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        self.now_s = 0.0  # the simulated clock: the last event's time
        self.version = 0  # server steps taken
        self.dispatches = 0  # dispatch events so far (what keys the choice of clients)
        self.free_slots = self.protocol.concurrency
        self.arrival_s: dict[int, float] = {}  # in flight: client -> simulated arrival time
        self.downloaded: dict[int, int] = {}  # in flight: client -> the version it trains from
        self.uploads: dict[int, np.ndarray] = {}  # in flight, upload received: client -> its row

    def in_flight(self) -> np.ndarray:
        return np.array(sorted(self.arrival_s), dtype=np.int64)

    def dispatch(self, clients: np.ndarray, arrival_s: np.ndarray) -> None:
        """``clients`` download the current model now and will be back at ``arrival_s``."""
        for client, t in zip(clients.tolist(), arrival_s.tolist()):
            self.arrival_s[client], self.downloaded[client] = t, self.version
        self.free_slots -= len(clients)
        self.dispatches += 1

    def hold(self, step: StepContext, rows: np.ndarray) -> None:
        """Keep each upload until its client's simulated arrival (a handler of the upload message)."""
        for client, row in zip(step.clients.tolist(), rows):
            self.uploads[client] = np.array(row)

    def next_arrival(self) -> tuple[int, float] | None:
        """The in-flight client that arrives first (ties: the lower id) and when; ``None`` if nobody is in flight."""
        if not self.arrival_s:
            return None
        client = min(self.arrival_s, key=lambda c: (self.arrival_s[c], c))
        return client, self.arrival_s[client]

    def arrive(self) -> bool:
        """Advance the clock to the next arrival and hand it to :meth:`on_arrival`; True once a server step is
        complete."""
        client, self.now_s = require(self.next_arrival(), "a client in flight")
        del self.arrival_s[client]
        version = self.downloaded.pop(client)
        self.free_slots += 1
        return self.on_arrival(client, self.uploads.pop(client, None), self.version - version)

    def on_arrival(self, client: int, upload: np.ndarray | None, staleness: int) -> bool:
        """``client``'s upload (``None``: it never came: the client dropped out or its upload was rejected),
        ``staleness`` server steps after the version it trained from; True once a server step is complete
        (every arrival must eventually complete one, uploads or not, so that a round always ends)."""
        raise NotImplementedError


class ClientAlgorithm(_Handles):
    """Lives on each worker rank: the clients it hosts, their data, and their state in :attr:`state`.

    :meth:`handlers` maps each message to its method: for a down message ``fn(step, client, row)`` (a client
    receives its row), for an up message ``fn(step, client) -> row`` (a client's row to send).

    Anything about a client that must outlive its round lives in ``state`` (the runtime's
    :class:`ClientState`: committed or rolled back with the server's verdict, checkpointed by client id).
    What moves between the phases of one round lives in the dict attributes named in :attr:`scratch`,
    which the runtime empties after every training round and every evaluation.
    """

    protocol_type: type[Protocol] = Protocol
    side = "client"
    scratch: tuple[str, ...] = ()  # per-round dict attributes (client id -> value), emptied by end_round

    def __init__(self, ctx: RunContext, data: Mapping[int, TensorSplit], state: ClientState | None = None):
        self.ctx = ctx
        self.protocol = self.protocol_type(ctx)
        self.workspace = ctx.new_model(ctx.device)
        self.loss_fn = loss_function(ctx.layout)
        self.data = data  # the clients this rank hosts, by id (a ClientStore; any mapping in tests)
        self.state = ClientState() if state is None else state
        self.round_losses: dict[int, float] = {}
        self.trained_together = 0  # clients trained through the vectorized kernel (:meth:`train_together`)

    def end_round(self) -> None:
        """Forget this round's in-flight values (also those of clients whose updates were rejected)."""
        for name in self.scratch:
            getattr(self, name).clear()

    @property
    def device(self) -> torch.device:
        """Where this rank's clients compute: their data, the workspace and the tensors of a round."""
        return self.workspace.device

    def receive(self, msg: Message, step: StepContext, client: int, row: np.ndarray) -> None:
        self.handler(msg)(step, client, row)

    def send(self, msg: Message, step: StepContext, client: int) -> np.ndarray:
        return self.handler(msg)(step, client)

    def compute(self, step: StepContext, client: int) -> None:
        """Local computation between messages (the :data:`~mpifl.comm.LOCAL` step)."""

    def sum_group(self, msg: Message, client: int) -> int:
        """Which of a summed message's ``groups`` sums ``client``'s row goes into (IFCA: its cluster)."""
        return 0

    def compute_clients(self, step: StepContext, clients: np.ndarray) -> np.ndarray:
        """The :data:`~mpifl.comm.LOCAL` step of several clients; returns each one's seconds. One client
        at a time here; an algorithm may compute them together (see FedAvg's vectorized training)."""
        seconds = np.empty(len(clients))
        for i, client in enumerate(clients):
            start = time.perf_counter()
            self.compute(step, int(client))
            seconds[i] = time.perf_counter() - start
        return seconds

    def rank_stats(self) -> dict[str, float]:
        """Counters this rank reports once, at the end (results table /ranks)."""
        return {"clients_trained_vectorized": self.trained_together}

    def eval_model(self, step: StepContext, client: int, kind: str) -> nn.Module:
        """The model to evaluate ``client`` with for ``kind`` (one of :attr:`eval_kinds`); it is used
        before the next call, so it may live in the shared workspace."""
        raise NotImplementedError

    def evaluate(self, step: StepContext, client: int, layout: EvalLayout) -> np.ndarray:
        """``client``'s evaluation row as ``layout`` orders it (every model kind on every split), for the
        runtime to pool. Which model, which BatchNorm statistics and which loss are the algorithm's business."""
        data = self.data[client]
        rows = []
        for kind in layout.kinds:
            model = self.eval_model(step, client, kind)
            stats = self.eval_norm_statistics(step, client, kind, model)
            with normalized_with(model, stats) if stats is not None else contextlib.nullcontext():
                for split in layout.splits:
                    rows.append(evaluate(model, getattr(data, f"x_{split}"), getattr(data, f"y_{split}"),
                                         self.loss_fn))
        return np.concatenate(rows)

    def take_train_loss(self, client: int) -> float:
        """``client``'s mean training loss of this round (NaN if it reported none), forgotten once taken."""
        return self.round_losses.pop(client, float("nan"))

    def eval_norm_statistics(self, step: StepContext, client: int, kind: str, model: nn.Module) -> np.ndarray | None:
        """The BatchNorm statistics ``model`` evaluates with (:mod:`mpifl.models.norm`); ``None`` without
        BatchNorm. By default estimated on the client's own training split (never its test batch)."""
        if not batch_norms(model):
            return None
        return norm_statistics(model, self.data[client].x_train, self.ctx.cfg.client.batch_size)

    def gradient_at(self, client: int, params: np.ndarray, rows: torch.Tensor | None = None) -> np.ndarray:
        """∇ at ``params`` of ``client``'s mean loss over ``rows`` of its training split, plus the configured
        weight decay; all rows (the default) give the full-batch gradient ("clients return full gradients")."""
        split = self.data[client]
        x, y = (split.x_train, split.y_train) if rows is None else (split.x_train[rows], split.y_train[rows])
        self.workspace.load(params)
        loss = self.loss_fn(self.workspace.module(x), y)
        self.workspace.compute_gradient(loss)
        self.round_losses[client] = float(loss.detach())
        grads = host_numpy(self.workspace.grads).copy()
        if self.ctx.cfg.client.weight_decay:
            grads += self.ctx.cfg.client.weight_decay * self.workspace.numpy()
        return grads

    def train_workspace(self, step: StepContext, client: int, grad_hook: GradHook | None = None,
                        steps: int | None = None, momentum: torch.Tensor | None = None,
                        lr: float | None = None, config: ClientConfig | None = None) -> int:
        """Run local SGD (``config``, by default ``client.*``) on the workspace model with ``client``'s
        training data (``steps``, ``momentum`` and ``lr`` as in :func:`local_sgd`); returns the steps taken."""
        split = self.data[client]
        gen = client_generator(self.ctx.cfg.seed, step.round, client)
        stats = local_sgd(self.workspace, split.x_train, split.y_train, self.loss_fn, config or self.ctx.cfg.client,
                          gen, grad_hook, lr=lr, steps=steps, momentum=momentum)
        self.round_losses[client] = stats.mean_loss
        return stats.steps

    def vectorizer_if(self, cpu_default: bool) -> VectorizedSGD | None:
        """The kernel for :meth:`train_together` if ``client.vectorize`` wants it for this model and device
        (``cpu_default``: the kernel under ``auto`` on the CPU; see ``kernel_wanted``), else None."""
        cfg = self.ctx.cfg
        if not kernel_wanted(cfg.client, cfg.model.name, self.device, cpu_default):
            return None
        return VectorizedSGD(self.workspace, self.loss_fn, cfg.client)

    def train_together(self, vectorizer: VectorizedSGD, step: StepContext, starts: Mapping[int, np.ndarray],
                       hooks: Mapping[int, GradHook | None] | None = None, config: ClientConfig | None = None,
                       purpose: int = 0) -> tuple[dict[int, np.ndarray], np.ndarray]:
        """Local SGD of several clients from ``starts`` through the kernel, each as :meth:`train_workspace` trains
        it alone (its generator keyed by ``purpose``, its gradient hook, its mean loss in :attr:`round_losses`);
        their final parameters in host memory (views on the CPU), and each one's seconds."""
        seed, clients = self.ctx.cfg.seed, list(starts)
        runs = [ClientRun(starts[c], self.data[c].x_train, self.data[c].y_train,
                          client_generator(seed, step.round, c, purpose), None if hooks is None else hooks[c])
                for c in clients]
        result = vectorizer.train(runs, config or self.ctx.cfg.client)
        for k, client in enumerate(clients):
            self.round_losses[client] = result.stats[k].mean_loss
        self.trained_together += len(clients)
        rows = host_numpy(result.params)  # one copy from a GPU
        return {c: rows[k] for k, c in enumerate(clients)}, result.seconds


def weighted_sum(rows: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Σ wᵢ·rowᵢ accumulated in float64 in row (client-id) order: the result never depends on
    how clients were spread over ranks."""
    acc = np.zeros(rows.shape[1], dtype=np.float64)
    for w, row in zip(weights, rows):
        acc += w * row
    return acc
