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

from mpifl.algorithms.base import ClientAlgorithm, ServerAlgorithm, Stage, StepContext, require
from mpifl.comm import LocalCompute, Message, Step, Transport
from mpifl.comm.secagg import UNMASKING_ROUND
from mpifl.comm.wire import BROADCAST, WireFormat
from mpifl.runtime.faults import FaultModel
from mpifl.runtime.store import ClientStore
from mpifl.runtime.timing import RankTimes

LEDGER_STAGES: dict[Stage, str] = {"setup": "setup", "train": "train", "newcomer": "eval", "eval_prelude": "eval",
                                   "eval": "eval"}
"""The ledger's stage of each plan: what the protocol costs (train), once (setup), and to evaluate (eval)."""


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


class PlanWalker:
    """Moves a plan's messages for one rank: the server's side on rank 0, the hosted clients' side on
    workers (both when the job has one rank)."""

    def __init__(self, transport: Transport, server: ServerAlgorithm | None, client: ClientAlgorithm | None,
                 store: ClientStore | None, faults: FaultModel, times: RankTimes, wire: WireFormat | None = None):
        self.transport, self.server, self.client, self.store = transport, server, client, store
        self.wire = wire or WireFormat()
        self.faults, self.times = faults, times

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
            position += 1
            if isinstance(step, Message) and step.direction == "up":  # an update: the up messages in a row
                group = [step]
                while position < len(plan) and isinstance(nxt := plan[position], Message) and nxt.direction == "up":
                    group.append(nxt)
                    position += 1
                self._upload(round_, stage, group, context.with_clients(now.clients), now)
            else:
                self._move_down_or_compute(round_, stage, step, context, now)
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

    def _upload(self, round_: int, stage: Stage, group: list[Message], step: StepContext, now: _Progress) -> None:
        """Move one update (``group``'s messages) of ``step.clients`` to the server, which screens it and, in
        training, tells every rank its verdict before consuming the accepted rows; only the accepted clients go
        on. Adds the local clients' send times to their seconds."""
        server, client, clients, local = self.server, self.client, step.clients, now.local
        blocks = []
        for msg in group:
            rows = np.empty((len(local), msg.numel), dtype=msg.dtype)
            if client is not None:
                for i, c in enumerate(local):
                    start = time.perf_counter()
                    rows[i] = self.wire.client_upload(msg, round_, int(c), client.send(msg, step, int(c)))
                    now.seconds[i] += self._charge_compute(start)
            if rows.dtype.kind == "f":
                rows[now.corrupt] = np.nan  # faults.corrupt: these clients' uploads arrive broken
            blocks.append(rows)
        gathered = self._up(round_, LEDGER_STAGES[stage], group, blocks, clients, local)
        accepted = self._screen(round_, stage, group, clients, gathered) if server is not None else None
        if stage == "train":  # every rank learns the verdict: it decides whose state edits survive.
            # Before the server's steps, so the workers go on while the server computes.
            accepted = self._share_acceptance(round_, accepted, len(clients))
        if server is not None and accepted is not None and accepted.any():
            keep = slice(None) if accepted.all() else accepted  # no copy of the rows when everyone is in
            for msg, rows_in in zip(group, gathered):
                rows_in = self.wire.server_noise(msg, round_, require(rows_in, "the gathered rows")[keep])
                self._server(server.consume, msg, step.with_clients(clients[accepted]), rows_in)
        if stage == "train" and accepted is not None:
            now.keep(accepted)

    def _down(self, round_: int, stage: Stage, msg: Message, payload: np.ndarray | None, targets: np.ndarray,
              hosted: int) -> np.ndarray:
        """Move a down message: its raw rows, or (with a codec) each client's encoding, decoded on arrival.
        Returns one row per hosted target."""
        if self.wire.codec(msg) is None:
            return self.transport.down(round_, LEDGER_STAGES[stage], msg, payload, targets)
        start = time.perf_counter()
        blobs = None
        if payload is not None:
            payload = Transport.check_payload(msg, payload, 1 if msg.broadcast else len(targets))
            keys = [BROADCAST] if msg.broadcast else [int(c) for c in targets]
            blobs = [self.wire.encode(msg, round_, key, row, None)[0]
                     for key, row in zip(keys, payload.reshape(len(keys), msg.numel))]
        self.times.serialization += time.perf_counter() - start
        arrived = self.transport.down_blobs(round_, LEDGER_STAGES[stage], msg, blobs, targets)
        start = time.perf_counter()
        if msg.broadcast:  # one encoding for everyone: decoded once
            row = self.wire.decode(msg, arrived[0]) if arrived else np.zeros(msg.numel, msg.dtype)
            rows = np.broadcast_to(row, (hosted, msg.numel))
        else:
            rows = np.array([self.wire.decode(msg, blob) for blob in arrived], dtype=msg.dtype).reshape(-1, msg.numel)
        self.times.serialization += time.perf_counter() - start
        return rows

    def _up(self, round_: int, stage: str, group: list[Message], blocks: list[np.ndarray], clients: np.ndarray,
            local: np.ndarray) -> list[np.ndarray | None]:
        """Move an update's messages: the raw ones together (``up_many``), each encoded one as every local
        client's encoding (its error feedback kept in the client's state), decoded on the server."""
        raw = [i for i, msg in enumerate(group) if self.wire.codec(msg) is None]
        out: list[np.ndarray | None] = [None] * len(group)
        for i, rows in zip(raw, self.transport.up_many(round_, stage, [group[i] for i in raw],
                                                       [blocks[i] for i in raw], clients)):
            out[i] = rows
        for i, msg in enumerate(group):
            if i in raw:
                continue
            start = time.perf_counter()
            blobs = [self._encode_upload(msg, round_, int(c), row) for c, row in zip(local, blocks[i])]
            self.times.serialization += time.perf_counter() - start
            arrived = self.transport.up_blobs(round_, stage, msg, blobs, clients)
            if arrived is not None:
                start = time.perf_counter()
                out[i] = np.array([self.wire.decode(msg, blob) for blob in arrived],
                                  dtype=msg.dtype).reshape(-1, msg.numel)
                self.times.serialization += time.perf_counter() - start
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

    def _screen(self, round_: int, stage: Stage, group: list[Message], clients: np.ndarray,
                gathered: list[np.ndarray | None]) -> np.ndarray:
        """Which clients' updates the server accepts: a training update with NaN/Inf in any of its messages
        never reaches the algorithm (``faults.nonfinite: skip``) or stops the job (``abort``)."""
        accepted = np.ones(len(clients), dtype=bool)
        if stage != "train":
            return accepted
        for msg, rows in zip(group, gathered):
            rows = require(rows, "the gathered rows")
            if rows.dtype.kind != "f":
                continue
            finite = np.isfinite(rows).all(axis=1)  # NaN/Inf anywhere in a row
            bad = clients[~finite]
            if len(bad) and self.faults.cfg.nonfinite == "abort":
                raise FloatingPointError(f"round {round_}: {msg.name} of client(s) {bad.tolist()} is not finite")
            if len(bad):
                print(f"mpifl: warning: round {round_}: rejected non-finite {msg.name} of client(s) "
                      f"{bad.tolist()}", file=sys.stderr, flush=True)
            accepted &= finite
        return accepted

    def _share_acceptance(self, round_: int, accepted: np.ndarray | None, count: int) -> np.ndarray:
        """Tell every rank which clients go on (simulator bookkeeping, not logical traffic)."""
        msg = Message("accepted", "down", count, "uint8", broadcast=True, logical=False)
        payload = accepted.astype(np.uint8) if accepted is not None else None
        return self.transport.broadcast(round_, msg, payload).astype(bool)

    def record_secure_aggregation(self, round_: int, plan: Sequence[Step], participants: np.ndarray,
                                  survivors: np.ndarray) -> None:
        """Rank 0: the secure-aggregation protocol's own messages of a round in the ledger (a deployment sends them;
        the simulator does not): key advertisement and shares for every participant, the unmasking for those whose
        masked input arrived. The masked inputs are the update messages, already counted at their masked size."""
        numel = sum(m.numel for m in plan if isinstance(m, Message) and m.update)
        for sent in self.wire.secagg_round(len(participants), len(survivors), numel):
            who = survivors if sent.name in UNMASKING_ROUND else participants
            self.transport.ledger.record(round_, "train", Message(sent.name, sent.direction, sent.nbytes, "uint8"),
                                         who)

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

