"""The algorithm interface: a protocol (declared messages and their order), a server side and a client side.

Both sides hold the same :class:`Protocol` (built from the same context), so they walk the same plan. An
algorithm never touches MPI. Each round the runtime walks the protocol's plan: for a down message it asks the server
for the payload and hands each participating client its row, for an up message it asks each client for its row and
hands the server all rows in client-id order (or their sum), and for :data:`~mpifl.comm.LOCAL` it lets each client
compute. The runtime counts every logical byte: an algorithm's communication cost is what its plan declares.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np

from mpifl.algorithms.context import EvalLayout, RunContext, Stage, StepContext
from mpifl.algorithms.state import ClientState
from mpifl.comm.messages import Message, Step
from mpifl.schema import ConfigError
from mpifl.training.sgd import planned_samples
from mpifl.training.tensors import TensorSplit

CLIENTS_PER_UPLOAD = 16
"""The clients a worker computes and uploads at a time by default (:meth:`ClientAlgorithm.clients_per_upload`)."""

__all__ = ["AsynchronousProtocol", "ClientAlgorithm", "EvalLayout", "EventDrivenServer", "Protocol", "RunContext",
           "ServerAlgorithm", "Stage", "StepContext", "check_handlers",
           "stale_overrides"]  # the interface, with what it is told


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

    def client_state(self) -> dict[str, int]:
        """The arrays one client keeps between rounds once it has trained (its committed state: name → bytes),
        which every checkpoint saves: what the estimate of a run's checkpoints counts per client
        (:mod:`mpifl.runtime.footprint`). None by default."""
        return {}


Handler = Callable[..., Any]
"""A method that handles one declared message (see :meth:`ServerAlgorithm.handlers`,
:meth:`ClientAlgorithm.handlers`)."""


class _Handles:
    """Dispatch by declaration: each side of an algorithm maps every message of its protocol to the method that
    handles it (:meth:`handlers`), and the runtime finds the method by the message, never by comparing names.
    A protocol message without a handler is refused at set-up (:meth:`unhandled`)."""

    protocol: Protocol
    side = "side"
    retired: ClassVar[Mapping[str, str]] = {}
    """Methods this class once had that mpifl no longer calls, each with what to override instead: a subclass that
    still defines one (a plug-in written for an older mpifl) would change nothing, so it is refused
    (:func:`stale_overrides`)."""

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


def check_handlers(*sides: _Handles | None) -> None:
    """Refuse an algorithm whose protocol declares a message that one of its sides does not handle."""
    for side in sides:
        missing = side.unhandled() if side is not None else []
        if side is not None and missing:
            raise ConfigError(f"algorithm {type(side).__name__}: no {side.side} handler for message(s) "
                              f"{', '.join(missing)} (declare them in its handlers())")


def stale_overrides(cls: type) -> list[str]:
    """Why ``cls`` (a plug-in's side) would be silently wrong: each method it defines under a name that an ancestor
    retired (``retired``), as the cause of one line. An override is honoured or refused, never ignored."""
    return [f"{next(k for k in cls.__mro__ if name in vars(k)).__name__}.{name} overrides {klass.__name__}.{name}, "
            f"which mpifl no longer calls; override {instead} instead (docs/tutorials/own-algorithm.md)"
            for klass in cls.__mro__ for name, instead in vars(klass).get("retired", {}).items()
            if any(name in vars(k) for k in cls.__mro__)]


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
        """The accepted clients' rows of a rows message (a summed one arrives as its sum: :meth:`consume_sum`)."""
        self.handler(msg)(step, rows)

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


class AsynchronousProtocol(Protocol):
    """One round is one server step of an event-driven protocol: clients are dispatched and arrive one event at a
    time on the simulated clock (:mod:`mpifl.runtime.asynchronous` walks it; FedBuff, FedAsync). Its options
    extend :class:`AsynchronousOptions`."""

    @property
    def concurrency(self) -> int:
        """How many clients train at once."""
        return int(self.ctx.options.concurrency) or self.ctx.cfg.clients_per_round

    @property
    def arrivals_per_step(self) -> int:
        """How many clients arrive (and are dispatched again) per server step."""
        return 1


class EventDrivenServer(ServerAlgorithm):
    """The server of an :class:`AsynchronousProtocol`. The runtime keeps the events (who is in flight, when each
    arrives, the simulated clock: :mod:`mpifl.runtime.asynchronous`, checkpointed with the run) and tells the server
    who leaves (:meth:`dispatch`) and who arrives (:meth:`arrive`); the server keeps what its step needs, the version
    each client trained from and its upload, held (:meth:`hold`) until the client arrives. A subclass says what an
    arrival does (:meth:`on_arrival`)."""

    protocol_type: type[AsynchronousProtocol] = AsynchronousProtocol
    protocol: AsynchronousProtocol

    def __init__(self, ctx: RunContext):
        super().__init__(ctx)
        self.version = 0  # server steps taken
        self.downloaded: dict[int, int] = {}  # in flight: client -> the version it trains from
        self.uploads: dict[int, np.ndarray] = {}  # in flight, upload received: client -> its row

    def dispatch(self, clients: np.ndarray) -> None:
        """``clients`` download the current model now."""
        for client in clients.tolist():
            self.downloaded[client] = self.version

    def hold(self, step: StepContext, rows: np.ndarray) -> None:
        """Keep each upload until its client's simulated arrival (a handler of the upload message)."""
        for client, row in zip(step.clients.tolist(), rows):
            self.uploads[client] = np.array(row)

    def arrive(self, client: int) -> bool:
        """``client`` is back: its upload (if any) to :meth:`on_arrival`; True once a server step is complete."""
        version = self.downloaded.pop(client)
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
    which the runtime empties after every training round and every evaluation. Training and evaluating on a
    shared workspace model: :class:`~mpifl.algorithms.toolkit.ClientToolkit`.
    """

    protocol_type: type[Protocol] = Protocol
    side = "client"
    scratch: tuple[str, ...] = ()  # per-round dict attributes (client id -> value), emptied by end_round

    def __init__(self, ctx: RunContext, data: Mapping[int, TensorSplit], state: ClientState | None = None):
        self.ctx = ctx
        self.protocol = self.protocol_type(ctx)
        self.data = data  # the clients this rank hosts, by id (a ClientStore; any mapping in tests)
        self.state = ClientState() if state is None else state

    def end_round(self) -> None:
        """Forget this round's in-flight values (also those of clients whose updates were rejected)."""
        for name in self.scratch:
            getattr(self, name).clear()

    def receive(self, msg: Message, step: StepContext, client: int, row: np.ndarray) -> None:
        self.handler(msg)(step, client, row)

    def send(self, msg: Message, step: StepContext, client: int) -> np.ndarray:
        return self.handler(msg)(step, client)

    def compute(self, step: StepContext, client: int) -> None:
        """Local computation between messages (the :data:`~mpifl.comm.LOCAL` step)."""

    def clients_per_upload(self) -> int:
        """How many clients a local step followed by an upload computes at a time, their rows sent (and a summed
        message's folded) right after: a worker holds at most this many clients' updates, whatever its cohort."""
        return CLIENTS_PER_UPLOAD

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
        return {}

    def evaluate(self, step: StepContext, client: int, layout: EvalLayout) -> np.ndarray:
        """``client``'s evaluation row as ``layout`` orders it (every model kind on every split), for the
        runtime to pool. Which model, which BatchNorm statistics and which loss are the algorithm's business."""
        raise NotImplementedError

    def take_train_loss(self, client: int) -> float:
        """``client``'s mean training loss of this round (NaN if it reported none), forgotten once taken."""
        return float("nan")
