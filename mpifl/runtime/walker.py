"""Walking a plan: each declared message moved between the server and the clients taking part, local steps
run, training uploads screened, and the clients' state edits committed or rolled back.

Every rank walks the same plan in the same order (the plan and the clients taking part are functions of
(seed, round) alone), so every collective matches. The server's algorithm only ever sees clients whose rows
it accepted, and never an empty set: the walk ends where no client is left.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from mpifl.algorithms.base import Stage, StepContext
from mpifl.comm import LocalCompute, Message, Step, Transport
from mpifl.comm.exactsum.distributed import DistributedSum
from mpifl.comm.messages import SumWeights, require
from mpifl.comm.wire import BROADCAST
from mpifl.runtime.faults import FaultModel
from mpifl.runtime.rank import RankContext
from mpifl.training.device import host_numpy

LEDGER_STAGES: dict[Stage, str] = {"setup": "setup", "train": "train", "newcomer": "eval", "eval_prelude": "eval",
                                   "eval": "eval"}
"""The ledger's stage of each plan: what the protocol costs (train), once (setup), and to evaluate (eval)."""
READ_BYTES = 1 << 28
"""The most bytes of device rows read to the host in one copy (:meth:`PlanWalker._read_together`): the copy is
stacked on the device and lands in pinned host memory, both its size, so 1,000 clients' rows come in a few."""


@dataclass(frozen=True)
class Walk:
    """The outcome of one walk on this rank."""

    local: np.ndarray  # this rank's clients still taking part at the end (ascending ids)
    seconds: np.ndarray  # their compute seconds during the walk
    clients: np.ndarray  # every client still taking part at the end
    rejected: int = 0  # training uploads rejected as non-finite (every rank learns the verdicts)


@dataclass
class _Progress:
    """Who is still taking part while a plan is walked, shrinking as uploads are rejected."""

    clients: np.ndarray  # every participant
    local: np.ndarray  # this rank's participants
    audience: np.ndarray  # who ``everyone`` steps reach (a superset of ``clients``)
    reached: np.ndarray  # this rank's part of the audience
    seconds: np.ndarray  # the local participants' compute seconds so far
    corrupt: np.ndarray  # which local participants' training uploads arrive broken (faults.corrupt)
    rejected: int = 0

    def targets(self, step: Step) -> tuple[np.ndarray, np.ndarray]:
        """Whom ``step`` reaches: every participant, or for an ``everyone`` step the audience; and this rank's."""
        return (self.audience, self.reached) if step.everyone else (self.clients, self.local)

    def keep(self, accepted: np.ndarray) -> None:
        """Only the clients whose upload the server accepted go on."""
        keep = np.isin(self.local, self.clients[accepted])
        self.audience = np.setdiff1d(self.audience, self.clients[~accepted])
        self.reached = self.reached[np.isin(self.reached, self.audience)]
        self.clients, self.local = self.clients[accepted], self.local[keep]
        self.seconds, self.corrupt = self.seconds[keep], self.corrupt[keep]
        self.rejected += int((~accepted).sum())


@dataclass(frozen=True)
class _Unread:
    """A client's row still on its device, to be read to the host with the other clients' of its step."""

    tensor: torch.Tensor


def _copies(unread: list[int], waiting: dict[int, list[Any]], j: int) -> list[list[int]]:
    """The clients of ``unread`` whose ``j``-th rows (:class:`_Unread`) come to the host in one copy: those on one
    device with one dtype, :data:`READ_BYTES` at most (a cohort's rows may be many)."""
    alike: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i in unread:
        alike.setdefault((waiting[i][j].tensor.dtype, waiting[i][j].tensor.device), []).append(i)
    pieces = []
    for same in alike.values():
        row_bytes = waiting[same[0]][j].tensor.numel() * waiting[same[0]][j].tensor.element_size()
        at_once = max(READ_BYTES // max(row_bytes, 1), 1)
        pieces += [same[first : first + at_once] for first in range(0, len(same), at_once)]
    return pieces


@dataclass
class _Outbox:
    """One update's outgoing side on this rank, filled client by client."""

    rows: list[np.ndarray | None]  # a raw rows message: its local clients' rows
    blobs: list[list[np.ndarray | None]]  # an encoded rows message: each local client's encoding, by local index
    sums: list[DistributedSum | None]  # a summed message: this rank's part of it
    finite: np.ndarray  # local clients × messages: the row came through finite (or was not screened)

    @classmethod
    def of(cls, group: list[Message], n_local: int, transport: Transport) -> _Outbox:
        return cls(rows=[np.empty((n_local, m.numel), dtype=m.dtype) if m.summed is None else None for m in group],
                   blobs=[[None] * n_local for _ in group],
                   sums=[DistributedSum(m, transport) if m.summed else None for m in group],
                   finite=np.ones((n_local, len(group)), dtype=bool))


def _uploads(plan: Sequence[Step], position: int) -> bool:
    """Whether the plan's step at ``position`` is an up message."""
    return position < len(plan) and isinstance(step := plan[position], Message) and step.direction == "up"


class PlanWalker:
    """Moves a plan's messages for one rank: the server's side on rank 0, the hosted clients' side on
    workers (both when the job has one rank)."""

    def __init__(self, rank: RankContext, faults: FaultModel,
                 sum_weights: Callable[[SumWeights, np.ndarray], np.ndarray] | None = None):
        self.transport, self.ledger, self.wire, self.times = rank.transport, rank.ledger, rank.wire, rank.times
        self.server, self.client, self.store = rank.server, rank.client, rank.store
        self.faults = faults
        # what a summed message weighs each client's row by (RunContext.sum_weights; one each by default)
        self.sum_weights = sum_weights or (lambda rule, clients: np.ones(len(clients)))

    def walk(self, round_: int, stage: Stage, plan: Sequence[Step], clients: np.ndarray,
             audience: np.ndarray | None = None) -> Walk:
        """Move every step of ``plan`` among ``clients`` (its ``everyone`` steps among ``audience``, a superset).
        Training drops a client whose upload is not finite; the plan ends where no client is left. The state
        edits of the clients still in are committed (of the whole audience), those of dropped ones discarded."""
        audience = clients if audience is None else audience
        local, reached = self._hosted(clients), self._hosted(audience)
        if len(reached) and self.store is not None:
            start = time.perf_counter()
            self.store.stage(reached)
            self.times.data += time.perf_counter() - start
        corrupt = self.faults.corrupted(round_, local) if stage == "train" else np.zeros(len(local), dtype=bool)
        now = _Progress(clients, local, audience, reached, np.zeros(len(local)), corrupt)
        context = StepContext(round_, stage, clients)
        position = 0
        while position < len(plan) and len(now.clients):
            step = plan[position]
            # a local step right before an update runs with it, a few clients at a time (clients_per_upload)
            fused = isinstance(step, LocalCompute) and not step.everyone and _uploads(plan, position + 1)
            if fused or _uploads(plan, position):  # an update: the up messages in a row
                start = end = position + 1 if fused else position
                while _uploads(plan, end):
                    end += 1
                group = [m for m in plan[start:end] if isinstance(m, Message)]
                self._upload(round_, stage, group, context.with_clients(now.clients), now, fused)
                position = end
            else:
                self._move_down_or_compute(round_, stage, step, context, now)
                position += 1
        if self.client is not None:
            self.client.state.commit(now.reached)
            self.client.state.discard(np.setdiff1d(reached, now.reached))
        return Walk(now.local, now.seconds, now.clients, now.rejected)

    def _move_down_or_compute(self, round_: int, stage: Stage, step: Step, context: StepContext,
                              now: _Progress) -> None:
        """A local step (the hosted targets compute) or a down message (the server's payload to its targets)."""
        server, client = self.server, self.client
        targets, hosted = now.targets(step)
        mine = np.searchsorted(hosted, now.local)  # where each local participant sits among ``hosted``
        if isinstance(step, LocalCompute):
            if client is not None and len(hosted):
                start = time.perf_counter()
                now.seconds += client.compute_clients(context.with_clients(hosted), hosted)[mine]
                self._charge_compute(start)
            return
        here = context.with_clients(targets)
        payload = self._server(server.payload, step, here) if server is not None else None
        rows = self._down(round_, stage, step, payload, targets, len(hosted))
        if client is not None and len(hosted):
            spent = np.array([self._client(client.receive, step, here, int(c), rows[i])
                              for i, c in enumerate(hosted)])
            now.seconds += spent[mine]

    def _upload(self, round_: int, stage: Stage, group: list[Message], step: StepContext, now: _Progress,
                compute: bool) -> None:
        """Move one update (``group``'s messages) of ``step.clients`` to the server (with ``compute``, after
        each client's local step). Each worker screens its clients' rows as the server would see them, rank 0
        learns and shares the verdict, rows messages are gathered and summed ones reduced, and the server's
        handlers get the accepted clients' rows or sums; only the accepted clients go on."""
        server, clients = self.server, step.clients
        outbox = self._produce(round_, stage, group, step, now, compute)
        gathered = self._gather(round_, group, outbox, clients)
        self._count(round_, stage, group, clients)  # each client sent its rows, whatever the server accepts
        accepted = np.ones(len(clients), dtype=bool)
        if stage == "train":  # every rank learns the verdict: it decides whose state edits survive
            accepted = self._verdict(round_, group, clients, outbox.finite)
        if not accepted.any():  # nothing for the server; every rank knows it
            now.keep(accepted)
            return
        step = step.with_clients(clients[accepted])
        keep = slice(None) if accepted.all() else accepted  # no copy of the rows when everyone is in
        for msg, rows, sums in zip(group, gathered, outbox.sums):
            if sums is not None:
                totals = sums.total(round_)
                if server is not None:
                    totals = self.wire.server_noise_total(msg, round_, require(totals, "the reduced sums"))
                    self._server(server.consume_sum, msg, step, totals)
            elif server is not None:
                rows = self.wire.server_noise(msg, round_, require(rows, "the gathered rows")[keep])
                self._server(server.consume, msg, step, rows)
        if stage == "train":
            now.keep(accepted)

    def _produce(self, round_: int, stage: Stage, group: list[Message], step: StepContext, now: _Progress,
                 compute: bool) -> _Outbox:
        """This rank's side of an update: each hosted client's rows (after its local step, ``compute``), through
        the wire format, screened, and a summed message's folded into its exact total right away."""
        outbox = _Outbox.of(group, len(now.local), self.transport)
        client = self.client
        if client is None:
            return outbox
        weights = [self.sum_weights(msg.summed, now.local) if msg.summed else None for msg in group]
        chunk = client.clients_per_upload() if compute else max(len(now.local), 1)
        for first in range(0, len(now.local), chunk):
            hosted = now.local[first : first + chunk]
            if compute:
                start = time.perf_counter()
                now.seconds[first : first + len(hosted)] += client.compute_clients(step.with_clients(hosted), hosted)
                self._charge_compute(start)
            waiting: dict[int, list[Any]] = {}  # clients with device rows: read, screened and folded as one batch
            for i in range(first, first + len(hosted)):
                seen = self._client_rows(round_, stage, group, step, now, i, outbox)
                if any(isinstance(row, torch.Tensor | _Unread) for row in seen):  # a host row may be a reused
                    waiting[i] = [row if isinstance(row, torch.Tensor | _Unread) else np.array(row)  # buffer:
                                  for row in seen]  # copied
                elif outbox.finite[i].all():
                    self._fold(group, now.local, {i: seen}, weights, outbox)
            if waiting:
                self._read_together(round_, stage, group, now, waiting, outbox)
                self._screen_on_devices(stage, waiting, outbox)
                self._fold(group, now.local, {i: rows for i, rows in waiting.items() if outbox.finite[i].all()},
                           weights, outbox)
        return outbox

    def _client_rows(self, round_: int, stage: Stage, group: list[Message], step: StepContext, now: _Progress,
                     i: int, outbox: _Outbox) -> list[Any]:
        """The ``i``-th local client's rows of ``group`` as they leave it: a summed row that the wire leaves as it
        is stays a tensor on its device (a GPU worker folds it there and moves one total per round); another
        device row waits, :class:`_Unread`, to come to the host with the other clients' (:meth:`_read_together`:
        one wait for the device a step, not one a client); a host row arrives at once (:meth:`_arrive`)."""
        client, c = require(self.client, "the client side"), int(now.local[i])
        seen: list[Any] = []
        for j, msg in enumerate(group):
            start = time.perf_counter()
            sent = client.send(msg, step, c)
            now.seconds[i] += self._charge_compute(start)
            if not isinstance(sent, torch.Tensor):
                seen.append(self._arrive(round_, stage, msg, j, now, i, outbox, sent))
            elif (msg.summed is not None and self.wire.codec(msg) is None and not self.wire.changes_uploads(msg)
                  and not (now.corrupt[i] and sent.is_floating_point())):
                seen.append(sent.detach().reshape(msg.numel))
            else:  # copied where it is (no wait): a client may reuse its tensor for the next client's row
                seen.append(_Unread(sent.detach().clone()))
        return seen

    def _read_together(self, round_: int, stage: Stage, group: list[Message], now: _Progress,
                       waiting: dict[int, list[Any]], outbox: _Outbox) -> None:
        """The :class:`_Unread` rows of ``waiting`` clients (local index -> rows), each message's in one copy to
        the host (:func:`_copies`), then each arrives (:meth:`_arrive`); a copy's seconds are shared among the
        clients it read."""
        for j, msg in enumerate(group):
            for where in _copies([i for i, rows in waiting.items() if isinstance(rows[j], _Unread)], waiting, j):
                start = time.perf_counter()
                host = host_numpy(torch.stack([waiting[i][j].tensor.reshape(-1) for i in where]))
                share = self._charge_compute(start) / len(where)
                for i, row in zip(where, host):
                    now.seconds[i] += share
                    waiting[i][j] = self._arrive(round_, stage, msg, j, now, i, outbox, row)

    def _arrive(self, round_: int, stage: Stage, msg: Message, j: int, now: _Progress, i: int, outbox: _Outbox,
                sent: np.ndarray) -> np.ndarray:
        """The ``i``-th local client's host row of ``msg`` (the ``j``-th of its update) as the server will read it:
        through the wire (clipped, noised, encoded and decoded), kept in ``outbox`` as it travels (a summed
        message's only until it is folded), and screened (``outbox.finite``)."""
        c = int(now.local[i])
        start = time.perf_counter()
        row = np.asarray(self.wire.client_upload(msg, round_, c, sent), dtype=msg.dtype)
        now.seconds[i] += self._charge_compute(start)
        if now.corrupt[i] and row.dtype.kind == "f":
            row = np.full(msg.numel, np.nan, dtype=msg.dtype)  # faults.corrupt: this upload arrives broken
        read = row.reshape(msg.numel)
        if self.wire.codec(msg) is not None:
            start = time.perf_counter()
            blob = self._encode_upload(msg, round_, c, read)
            if stage == "train" or msg.summed:
                read = self.wire.decode(msg, blob)
            if msg.summed is None:
                outbox.blobs[j][i] = blob
            self.times.serialization += time.perf_counter() - start
        elif msg.summed is None:
            require(outbox.rows[j], "the rows block")[i] = read
        screened = stage == "train" and read.dtype.kind == "f"
        outbox.finite[i, j] = not screened or bool(np.isfinite(read).all())
        return read

    def _screen_on_devices(self, stage: Stage, waiting: dict[int, list[Any]], outbox: _Outbox) -> None:
        """Screen the device rows of ``waiting`` clients (local index -> rows) for training, all of them with one
        read from the device (host rows were screened as they left)."""
        where = [(i, j) for i, rows in waiting.items() for j, row in enumerate(rows) if isinstance(row, torch.Tensor)]
        if stage != "train" or not where:
            return
        flags = torch.stack([torch.isfinite(waiting[i][j]).all() for i, j in where])
        for (i, j), finite in zip(where, host_numpy(flags).tolist()):
            outbox.finite[i, j] = finite

    def _fold(self, group: list[Message], local: np.ndarray, accepted: dict[int, list[Any]],
              weights: list[np.ndarray | None], outbox: _Outbox) -> None:
        """Add the ``accepted`` clients' rows (local index -> rows of ``group``) of the summed messages to this
        rank's exact totals: host rows one by one, device rows of one message together (one wait for them all)."""
        client = require(self.client, "the client side")
        start = time.perf_counter()
        for j, (msg, sums, weight) in enumerate(zip(group, outbox.sums, weights)):
            if sums is None or weight is None:
                continue
            on_device = [i for i, rows in accepted.items() if isinstance(rows[j], torch.Tensor)]
            for i, rows in accepted.items():
                if not isinstance(rows[j], torch.Tensor):  # host rows one by one
                    sums.add(rows[j], weight[i], client.sum_group(msg, int(local[i])))
            if on_device:
                sums.add_rows(torch.stack([accepted[i][j] for i in on_device]), weight[on_device],
                              np.array([client.sum_group(msg, int(local[i])) for i in on_device]))
        self.times.serialization += time.perf_counter() - start

    def _down(self, round_: int, stage: Stage, msg: Message, payload: np.ndarray | None, targets: np.ndarray,
              hosted: int) -> np.ndarray:
        """Move a down message: its raw rows, or (with a codec) each client's encoding, decoded on arrival.
        Returns one row per hosted target."""
        self._count(round_, stage, [msg], targets)
        if self.wire.codec(msg) is None:
            return self.transport.down(round_, msg, payload, targets)
        start = time.perf_counter()
        blobs = None
        if payload is not None:
            payload = Transport.check_payload(msg, payload, 1 if msg.broadcast else len(targets))
            keys = [BROADCAST] if msg.broadcast else [int(c) for c in targets]
            blobs = [self.wire.encode(msg, round_, key, row, None)[0]
                     for key, row in zip(keys, payload.reshape(len(keys), msg.numel))]
        self.times.serialization += time.perf_counter() - start
        arrived = self.transport.down_blobs(round_, msg, blobs, targets)
        start = time.perf_counter()
        if msg.broadcast:  # one encoding for everyone: decoded once
            row = self.wire.decode(msg, arrived[0]) if arrived else np.zeros(msg.numel, msg.dtype)
            rows = np.broadcast_to(row, (hosted, msg.numel))
        else:
            rows = np.array([self.wire.decode(msg, blob) for blob in arrived], dtype=msg.dtype).reshape(-1, msg.numel)
        self.times.serialization += time.perf_counter() - start
        return rows

    def _gather(self, round_: int, group: list[Message], outbox: _Outbox, clients: np.ndarray
                ) -> list[np.ndarray | None]:
        """An update's rows messages on the server in client order, in one transport call: the raw ones as rows,
        each encoded one as every client's encoding, decoded there. ``None`` for a summed message (its rows were
        folded into its :class:`DistributedSum`) and everywhere on a worker."""
        rows = [j for j, msg in enumerate(group) if msg.summed is None]
        outgoing = [[require(blob, "an encoding") for blob in outbox.blobs[j]] if self.wire.codec(group[j]) is not None
                    else require(outbox.rows[j], "the rows") for j in rows]
        arrived = self.transport.upload(round_, [group[j] for j in rows], outgoing, clients)
        out: list[np.ndarray | None] = [None] * len(group)
        for j, moved in zip(rows, arrived):
            if isinstance(moved, list):
                start = time.perf_counter()
                moved = np.array([self.wire.decode(group[j], blob) for blob in moved],
                                 dtype=group[j].dtype).reshape(-1, group[j].numel)
                self.times.serialization += time.perf_counter() - start
            out[j] = moved
        return out

    def _encode_upload(self, msg: Message, round_: int, client: int, row: np.ndarray) -> np.ndarray:
        """One client's encoding of ``row``; with error feedback, the residual it carries is client state (kept
        when the server accepts this round's update, rolled back with the rest of its state otherwise)."""
        residual_name = f"wire_residual:{msg.name}"
        state = require(self.client, "the client side").state
        blob, residual = self.wire.encode(msg, round_, client, row, state.get(client, residual_name))
        if residual is not None:
            state.edit(client)[residual_name] = residual
        return blob

    def _hosted(self, clients: np.ndarray) -> np.ndarray:
        return self.transport.local_clients(clients) if self.client is not None else clients[:0]

    def _verdict(self, round_: int, group: list[Message], clients: np.ndarray, finite: np.ndarray) -> np.ndarray:
        """Which clients' updates the server accepts, on every rank: the workers' screening gathered on rank 0
        (simulator bookkeeping), where a training update with NaN/Inf in any of its messages is rejected
        (``faults.nonfinite: skip``, with a warning) or stops the job (``abort``); then shared with every rank."""
        flags_msg = Message("screened", "up", len(group), "uint8", logical=False)
        flags = self.transport.up(round_, flags_msg, finite.astype(np.uint8), clients)
        accepted = None
        if flags is not None:
            ok = flags.astype(bool)
            for j, msg in enumerate(group):
                bad = clients[~ok[:, j]]
                if len(bad) and self.faults.cfg.nonfinite == "abort":
                    raise FloatingPointError(f"round {round_}: {msg.name} of client(s) {bad.tolist()} is not finite")
                if len(bad):
                    print(f"mpifl: warning: round {round_}: rejected non-finite {msg.name} of client(s) "
                          f"{bad.tolist()}", file=sys.stderr, flush=True)
            accepted = np.asarray(ok.all(axis=1))
        return self._share_acceptance(round_, accepted, len(clients))

    def _share_acceptance(self, round_: int, accepted: np.ndarray | None, count: int) -> np.ndarray:
        """Tell every rank which clients go on (simulator bookkeeping, not logical traffic)."""
        msg = Message("accepted", "down", count, "uint8", broadcast=True, logical=False)
        payload = accepted.astype(np.uint8) if accepted is not None else None
        return self.transport.broadcast(round_, msg, payload).astype(bool)

    def record_secure_aggregation(self, round_: int, plan: Sequence[Step], participants: np.ndarray,
                                  survivors: np.ndarray) -> None:
        """The secure-aggregation protocol's own messages of a round in the ledger (a deployment sends them; the
        simulator does not): key advertisement and shares for every participant, the unmasking for those whose
        masked input arrived. The masked inputs are the update messages, already counted at their masked size."""
        numel = sum(m.numel for m in plan if isinstance(m, Message) and m.update)
        for msg, unmasking in self.wire.secagg_round(len(participants), len(survivors), numel):
            self._count(round_, "train", [msg], survivors if unmasking else participants)

    def _count(self, round_: int, stage: Stage, msgs: Sequence[Message], clients: np.ndarray) -> None:
        """The ledger's one door (rank 0): each of ``clients`` moved each of ``msgs``, at its size on the wire
        (:meth:`WireFormat.nbytes`, what the simulated clock charges too)."""
        if self.transport.is_server:
            for msg in msgs:
                self.ledger.record(round_, LEDGER_STAGES[stage], msg, clients, self.wire.nbytes(msg))

    def _charge_compute(self, start: float) -> float:
        elapsed = time.perf_counter() - start
        self.times.compute += elapsed
        return elapsed

    def _client(self, fn: Callable[..., Any], *args: Any) -> float:
        start = time.perf_counter()
        fn(*args)
        return self._charge_compute(start)

    def _server(self, fn: Callable[..., Any], *args: Any) -> Any:
        start = time.perf_counter()
        result = fn(*args)
        self.times.server += time.perf_counter() - start
        return result

