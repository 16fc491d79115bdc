"""Exact accounting of logical bytes (per round, client, message) and physical MPI traffic."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mpifl.comm.messages import Message
from mpifl.results import Results, read_column_chunks

STAGES = ("train", "eval", "setup")
DIRECTIONS = ("down", "up")


@dataclass
class Ledger:
    """Logical bytes: one row per (round, client, message) a real deployment would transmit.

    Memory stays bounded however long the run: the per-client rows wait only until rank 0's next results
    write (:meth:`drain`), which appends them to the file; what the runtime needs later (the running training
    total) is kept as a number, and per-round totals are written beside the rows."""

    message_names: list[str] = field(default_factory=list)
    directions: list[str] = field(default_factory=list)
    _rounds: list[np.ndarray] = field(default_factory=list)
    _clients: list[np.ndarray] = field(default_factory=list)
    _messages: list[np.ndarray] = field(default_factory=list)
    _stages: list[np.ndarray] = field(default_factory=list)
    _bytes: list[np.ndarray] = field(default_factory=list)
    train_bytes: int = 0  # running total of stage "train" (what evaluations report as cumulative bytes)
    source: tuple[Path, int] | None = None  # resumed: the results file and the round its rows run up to

    def _message_id(self, msg: Message) -> int:
        if msg.name not in self.message_names:
            self.message_names.append(msg.name)
            self.directions.append(msg.direction)
        return self.message_names.index(msg.name)

    def record(self, round_: int, stage: str, msg: Message, clients: np.ndarray,
               nbytes: np.ndarray | int | None = None) -> None:
        """``clients`` each moved ``msg`` this round: ``nbytes`` per client (an array, or one size for all),
        ``msg.nbytes`` by default (an encoded message has its own size per client)."""
        if not msg.logical or len(clients) == 0:
            return
        n = len(clients)
        sizes = np.broadcast_to(np.asarray(msg.nbytes if nbytes is None else nbytes, dtype=np.int64), (n,))
        self._rounds.append(np.full(n, round_, dtype=np.int64))
        self._clients.append(np.asarray(clients, dtype=np.int64))
        self._messages.append(np.full(n, self._message_id(msg), dtype=np.int32))
        self._stages.append(np.full(n, STAGES.index(stage), dtype=np.int8))
        self._bytes.append(sizes.copy())
        if stage == "train":
            self.train_bytes += int(sizes.sum())

    def resume(self, saved: Results, source: Path, round_: int) -> None:
        """Continue from the per-round totals up to ``round_`` of ``saved``, the results file ``source`` (resuming
        a run); the per-client rows stay in the file, read again only by :meth:`participants`."""
        totals, attrs = saved.table("ledger_totals"), saved.table_attrs["ledger_totals"]
        self.message_names, self.directions = list(attrs["message_names"]), list(attrs["directions"])
        keep = totals["round"] <= round_
        self.train_bytes = int(totals["bytes"][keep & (totals["stage"] == STAGES.index("train"))].sum())
        self.source = (Path(source), round_)

    def drain(self) -> dict[str, np.ndarray]:
        """The rows recorded since the last drain (for the results file), forgotten here."""
        def cat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
            return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)

        columns = {"round": cat(self._rounds, np.int64), "client": cat(self._clients, np.int64),
                   "message": cat(self._messages, np.int32), "stage": cat(self._stages, np.int8),
                   "bytes": cat(self._bytes, np.int64)}
        for parts in (self._rounds, self._clients, self._messages, self._stages, self._bytes):
            parts.clear()
        return columns

    def client_round_bytes(self, round_: int, clients: np.ndarray, stage: str = "train"
                           ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """Per direction, each of ``clients``' logical bytes and messages in the current round (cheap: the newest
        rows only), for the network model: ``{"down": (bytes, messages), "up": (bytes, messages)}``."""
        up = np.array([d == "up" for d in self.directions], dtype=bool)
        out = {d: (np.zeros(len(clients), np.int64), np.zeros(len(clients), np.int64)) for d in DIRECTIONS}
        for r, c, m, s, b in zip(reversed(self._rounds), reversed(self._clients), reversed(self._messages),
                                 reversed(self._stages), reversed(self._bytes)):
            if r.max() < round_:
                break
            rows = (r == round_) & (s == STAGES.index(stage)) & np.isin(c, clients)
            where = np.searchsorted(clients, c[rows])
            for direction, mask in (("up", up[m[rows]]), ("down", ~up[m[rows]])):
                np.add.at(out[direction][0], where[mask], b[rows][mask])
                np.add.at(out[direction][1], where[mask], 1)
        return out

    def participants(self, stage: int, direction: str) -> dict[int, np.ndarray]:
        """The clients that sent (``up``) or received (``down``) anything in ``stage`` (an index of
        :data:`STAGES`), by round, in the rows of the results file this ledger was resumed from (:meth:`load`)
        and those recorded since: who took part in each round, e.g. to replay a privacy accountant. Reads the
        file's rows a chunk at a time."""
        wanted = np.array([d == direction for d in self.directions], dtype=bool)
        found: dict[int, list[np.ndarray]] = {}

        def add(rounds: np.ndarray, clients: np.ndarray, stages: np.ndarray, messages: np.ndarray) -> None:
            rows = (stages == stage) & wanted[messages] if len(wanted) else np.zeros(len(rounds), bool)
            for r in np.unique(rounds[rows]):
                found.setdefault(int(r), []).append(clients[rows][rounds[rows] == r])

        if self.source is not None:
            path, upto = self.source
            for chunk in read_column_chunks(path, "ledger", ("round", "client", "stage", "message")):
                keep = chunk["round"] <= upto
                add(*(chunk[k][keep] for k in ("round", "client", "stage", "message")))
        for r, c, s, m in zip(self._rounds, self._clients, self._stages, self._messages):
            add(r, c, s, m)
        return {r: np.unique(np.concatenate(parts)) for r, parts in sorted(found.items())}

    def round_totals(self, round_: int, stage: str = "train") -> dict[str, int]:
        """Logical bytes of one round (not yet written to the results file) by direction."""
        totals = {"up": 0, "down": 0}
        up = np.array([d == "up" for d in self.directions])
        for r, m, s, b in zip(
            reversed(self._rounds), reversed(self._messages), reversed(self._stages), reversed(self._bytes)
        ):
            if r.max() < round_:
                break
            rows = (r == round_) & (s == STAGES.index(stage))
            totals["up"] += int(b[rows & up[m]].sum())
            totals["down"] += int(b[rows & ~up[m]].sum())
        return totals


@dataclass
class PhysicalLog:
    """What MPI really moved from this rank's point of view: bytes and seconds per collective. Totals are kept
    as numbers; the rows themselves only where ``keep_rows`` (rank 0, whose results file lists its collectives),
    and only until the next results write takes them (:meth:`drain`), so memory does not grow with the run."""

    rows: list[tuple[int, str, str, int, float]] = field(default_factory=list)
    keep_rows: bool = True
    total_seconds: float = 0.0  # running sums over every collective (the seconds are read every round by the profile)
    total_bytes: int = 0
    per_message: dict[str, tuple[int, float]] = field(default_factory=dict)  # name -> (bytes, seconds)

    def record(self, round_: int, message: str, op: str, nbytes: int, seconds: float) -> None:
        if self.keep_rows:
            self.rows.append((round_, message, op, nbytes, seconds))
        self.total_seconds += seconds
        self.total_bytes += nbytes
        moved, spent = self.per_message.get(message, (0, 0.0))
        self.per_message[message] = (moved + nbytes, spent + seconds)

    def drain(self) -> list[tuple[int, str, str, int, float]]:
        """The rows recorded since the last drain, forgotten here."""
        rows, self.rows = self.rows, []
        return rows

    def by_message(self, names: tuple[str, ...]) -> tuple[int, float]:
        """Bytes and seconds of the collectives that moved these messages."""
        totals = [self.per_message.get(name, (0, 0.0)) for name in names]
        return sum(t[0] for t in totals), sum(t[1] for t in totals)
