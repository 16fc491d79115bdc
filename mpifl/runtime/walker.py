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
from mpifl.comm.wire import BROADCAST, WireFormat
from mpifl.runtime.clock import RankClock
from mpifl.runtime.faults import FaultModel
from mpifl.runtime.store import ClientStore

LEDGER_STAGES: dict[Stage, str] = {"setup": "setup", "train": "train", "newcomer": "eval", "eval_prelude": "eval",
                                   "eval": "eval"}
"""The ledger's stage of each plan: what the protocol costs (train), once (setup), and to evaluate (eval)."""


@dataclass(frozen=True)
class Walk:
    """The outcome of one walk on this rank."""

    local: np.ndarray  # this rank's clients still taking part at the end (ascending ids)
    seconds: np.ndarray  # their compute seconds during the walk
    clients: np.ndarray  # every client still taking part at the end


class PlanWalker:
    """Moves a plan's messages for one rank: the server's side on rank 0, the hosted clients' side on
    workers (both when the job has one rank)."""

    def __init__(self, transport: Transport, server: ServerAlgorithm | None, client: ClientAlgorithm | None,
                 store: ClientStore | None, faults: FaultModel, clock: RankClock, wire: WireFormat | None = None):
        self.transport, self.server, self.client, self.store = transport, server, client, store
        self.wire = wire or WireFormat()
        self.faults, self.clock = faults, clock
        self.rejected = 0  # training uploads rejected as non-finite since the counter was last reset

    def walk(self, round_: int, stage: Stage, plan: Sequence[Step], clients: np.ndarray,
             audience: np.ndarray | None = None) -> Walk:
        """Move every step of ``plan`` among ``clients`` (its ``everyone`` steps among ``audience``, a superset).
        Training drops a client whose upload is not finite; the plan ends where no client is left. The state
        edits of the clients still in are committed (of the whole audience), those of dropped ones discarded."""
        server, client = self.server, self.client
        audience = clients if audience is None else audience
        local = self._hosted(clients)
        reached = self._hosted(audience)
        started = reached
        seconds = np.zeros(len(local))
        if len(reached) and self.store is not None:
            start = time.perf_counter()
            self.store.stage(reached)
            self.clock.data += time.perf_counter() - start
        corrupt = self.faults.corrupted(round_, local) if stage == "train" else np.zeros(len(local), dtype=bool)
        context = StepContext(round_, stage, clients)
        position = 0
        while position < len(plan) and len(clients):
            step = plan[position]
            position += 1
            targets, hosted = (audience, reached) if step.everyone else (clients, local)
            mine = np.searchsorted(hosted, local)  # where each local participant sits among ``hosted``
            here = context.with_clients(targets)
            if isinstance(step, LocalCompute):
                if client is not None and len(hosted):
                    start = time.perf_counter()
                    seconds += client.compute_clients(context.with_clients(hosted), hosted)[mine]
                    self._charge_compute(start)
            elif step.direction == "down":
                payload = self._server(server.payload, step, here) if server is not None else None
                rows = self._down(round_, stage, step, payload, targets, len(hosted))
                if client is not None and len(hosted):
                    spent = np.array([self._client(client.receive, step, here, int(c), rows[i])
                                      for i, c in enumerate(hosted)])
                    seconds += spent[mine]
            else:  # a client's update: this and the up messages right after it, accepted or rejected as a whole
                group = [step]
                while position < len(plan) and isinstance(nxt := plan[position], Message) and nxt.direction == "up":
                    group.append(nxt)
                    position += 1
                accepted = self._upload(round_, stage, group, here, local, seconds, corrupt)
                if stage == "train" and accepted is not None:
                    keep = np.isin(local, clients[accepted])
                    audience = np.setdiff1d(audience, clients[~accepted])
                    reached = reached[np.isin(reached, audience)]
                    clients, local, seconds, corrupt = clients[accepted], local[keep], seconds[keep], corrupt[keep]
        if client is not None:
            client.state.commit(reached)
            client.state.discard(np.setdiff1d(started, reached))
        return Walk(local, seconds, clients)

    def _upload(self, round_: int, stage: Stage, group: list[Message], step: StepContext, local: np.ndarray,
                seconds: np.ndarray, corrupt: np.ndarray) -> np.ndarray | None:
        """Move one update (``group``'s messages) of ``step.clients`` to the server, which screens it and, in
        training, tells every rank its verdict before consuming the accepted rows. Adds the local clients'
        send times to ``seconds``; returns which clients were accepted (``None`` on a worker outside training)."""
        server, client, clients = self.server, self.client, step.clients
        blocks = []
        for msg in group:
            rows = np.empty((len(local), msg.numel), dtype=msg.dtype)
            if client is not None:
                for i, c in enumerate(local):
                    start = time.perf_counter()
                    rows[i] = self.wire.client_upload(msg, round_, int(c), client.send(msg, step, int(c)))
                    seconds[i] += self._charge_compute(start)
            if rows.dtype.kind == "f":
                rows[corrupt] = np.nan  # faults.corrupt: these clients' uploads arrive broken
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
        return accepted

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
        self.clock.serialization += time.perf_counter() - start
        arrived = self.transport.down_blobs(round_, LEDGER_STAGES[stage], msg, blobs, targets)
        start = time.perf_counter()
        if msg.broadcast:  # one encoding for everyone: decoded once
            row = self.wire.decode(msg, arrived[0]) if arrived else np.zeros(msg.numel, msg.dtype)
            rows = np.broadcast_to(row, (hosted, msg.numel))
        else:
            rows = np.array([self.wire.decode(msg, blob) for blob in arrived], dtype=msg.dtype).reshape(-1, msg.numel)
        self.clock.serialization += time.perf_counter() - start
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
            self.clock.serialization += time.perf_counter() - start
            arrived = self.transport.up_blobs(round_, stage, msg, blobs, clients)
            if arrived is not None:
                start = time.perf_counter()
                out[i] = np.array([self.wire.decode(msg, blob) for blob in arrived],
                                  dtype=msg.dtype).reshape(-1, msg.numel)
                self.clock.serialization += time.perf_counter() - start
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
        self.rejected += int((~accepted).sum())
        return accepted

    def _share_acceptance(self, round_: int, accepted: np.ndarray | None, count: int) -> np.ndarray:
        """Tell every rank which clients go on (simulator bookkeeping, not logical traffic)."""
        msg = Message("accepted", "down", count, "uint8", broadcast=True, logical=False)
        payload = accepted.astype(np.uint8) if accepted is not None else None
        return self.transport.broadcast(round_, msg, payload).astype(bool)

    def _charge_compute(self, start: float) -> float:
        elapsed = time.perf_counter() - start
        self.clock.compute += elapsed
        return elapsed

    def _client(self, fn: Callable[..., Any], *args: Any) -> float:
        start = time.perf_counter()
        fn(*args)
        return self._charge_compute(start)

    def _server(self, fn: Callable[..., Any], *args: Any) -> Any:
        start = time.perf_counter()
        result = fn(*args)
        self.clock.server += time.perf_counter() - start
        return result

