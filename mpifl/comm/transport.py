"""Moving declared messages between the server (rank 0) and the worker ranks.

Every call is a collective on flat contiguous numpy buffers (mpi4py's uppercase API): broadcast
payloads go by ``Ibcast``, per-client payloads by ``Iscatterv``/``Igatherv`` with counts and
displacements. Rows for a set of clients are always presented in client-id order, whichever rank
holds which client, so everything downstream is independent of the rank count.

Waiting is non-blocking with a growing sleep: Open MPI's blocking calls poll a full core, which
on an oversubscribed node steals cycles from the training ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpifl.comm.exactsum import ExactSum, Window, round_sum, words
from mpifl.comm.ledger import Ledger, PhysicalLog
from mpifl.comm.messages import Message
from mpifl.comm.placement import Placement

KEEP_BYTES_PER_ENTRY = 32
"""A worker keeps its accepted clients' rows of a summed message beside its exact totals while they take at most
this many bytes per entry (8 float32 rows). When every worker's kept rows are fewer bytes than the totals' wire
words (24 per entry for a typical float32 update), the rows travel instead and rank 0 folds them itself: the same
bits, as the sum is exact, and a deployment's own traffic where a worker hosts a client or two of the round."""


@dataclass(frozen=True)
class Term:
    """One accepted client's contribution to a summed message: ``weight``·``row`` into group ``group``."""

    row: np.ndarray
    weight: float
    group: int


_UNKEPT = 1 << 40  # the kept-terms count of a rank that stopped keeping: more than any words would pay for


@dataclass
class PartialSum:
    """This rank's part of a summed message: an exact total of its accepted clients' weighted rows per group and,
    while they are few (:data:`KEEP_BYTES_PER_ENTRY`), copies of those terms, which may travel instead."""

    totals: list[ExactSum]
    kept: list[Term] | None  # None once too many to keep
    itemsize: int  # of the message's dtype, the size a kept row travels at

    def add(self, row: np.ndarray, weight: float, group: int) -> None:
        """Fold one accepted client's ``weight``·``row`` into ``group``'s total (and keep it while few)."""
        self.totals[group].add(row, weight)
        if self.kept is not None:
            self.kept.append(Term(row.copy(), weight, group))
            if len(self.kept) * self.itemsize > KEEP_BYTES_PER_ENTRY:
                self.kept = None

_MIN_SLEEP_S = 20e-6
_MAX_SLEEP_S = 5e-4


def wait_without_spinning(request) -> None:  # noqa: ANN001 - an MPI.Request
    """Complete ``request`` while yielding the core: test, then sleep with exponential back-off."""
    delay = _MIN_SLEEP_S
    while not request.Test():
        time.sleep(delay)
        delay = min(delay * 2.0, _MAX_SLEEP_S)


@dataclass
class Transport:
    """Collectives for one communicator; rank 0 is the server, and also hosts every client if alone."""

    comm: Any  # mpi4py.MPI.Comm, or None when running without MPI in one process
    placement: Placement
    ledger: Ledger = field(default_factory=Ledger)
    physical: PhysicalLog = field(default_factory=PhysicalLog)
    pack_seconds: float = 0.0  # copying rows into and out of the flat, rank-ordered MPI buffers; exact sums' words
    # what one client's raw (unencoded) message costs a real deployment: its own bytes, unless the wire format
    # says otherwise (secure aggregation sends an update as masked field elements; the simulator moves the rows)
    logical_nbytes: Callable[[Message], int] = field(default=lambda msg: msg.nbytes)

    def __post_init__(self) -> None:
        self.physical.keep_rows = self.is_server  # only the server's collectives are listed in the results file

    @property
    def rank(self) -> int:
        return 0 if self.comm is None else self.comm.Get_rank()

    @property
    def size(self) -> int:
        return 1 if self.comm is None else self.comm.Get_size()

    @property
    def is_server(self) -> bool:
        return self.rank == 0

    @contextmanager
    def placed(self, placement: Placement) -> Iterator[None]:
        """Move messages under ``placement`` (one round's) instead of the static one for a while."""
        static, self.placement = self.placement, placement
        try:
            yield
        finally:
            self.placement = static

    def local_clients(self, clients: np.ndarray) -> np.ndarray:
        return self.placement.local(clients, self.rank)

    def down(
        self, round_: int, stage: str, msg: Message, payload: np.ndarray | None, clients: np.ndarray
    ) -> np.ndarray:
        """Server → clients. ``payload`` (server only): shape [numel] if broadcast, else [len(clients), numel].

        Returns this rank's rows, one per local client in ``clients`` (a read-only view for broadcasts).
        """
        if self.is_server:
            payload = self.check_payload(msg, payload, 1 if msg.broadcast else len(clients))
            self.ledger.record(round_, stage, msg, clients)
        local = self.local_clients(clients)
        if self.size == 1:  # the server alone: its payload, checked above
            rows = np.asarray(payload).reshape(-1, msg.numel)
        elif msg.broadcast:
            rows = self._bcast(round_, msg, payload)
        else:
            rows = self._scatter(round_, msg, payload, clients, len(local))
        if msg.broadcast:
            rows = np.broadcast_to(rows.reshape(1, msg.numel), (len(local), msg.numel))
        return rows

    def broadcast(self, round_: int, msg: Message, payload: np.ndarray | None) -> np.ndarray:
        """The server's ``payload`` on every rank (for the simulator's own bookkeeping: not per client,
        so nothing enters the ledger)."""
        if self.size == 1:
            return self.check_payload(msg, payload, 1)
        return self._bcast(round_, msg, payload)

    def up(self, round_: int, stage: str, msg: Message, rows: np.ndarray, clients: np.ndarray) -> np.ndarray | None:
        """Clients → server. ``rows``: this rank's local clients' rows. Returns all rows in ``clients`` order
        on the server, ``None`` elsewhere."""
        return self.up_many(round_, stage, [msg], [rows], clients)[0]

    def up_many(self, round_: int, stage: str, msgs: list[Message], rows: list[np.ndarray], clients: np.ndarray
                ) -> list[np.ndarray | None]:
        """Several up messages of the same clients at once: every ``Igatherv`` is started before the first is
        waited for, so they overlap. One result per message, as :meth:`up`."""
        local = self.local_clients(clients)
        for msg, block in zip(msgs, rows):
            self.check_payload(msg, block, len(local))
            if self.is_server:
                self.ledger.record(round_, stage, msg, clients, self.logical_nbytes(msg))
        if self.size == 1:
            return list(rows)
        order = self.placement.rank_order(clients) if self.is_server else None
        started = [self._start_gather(msg, block, order) for msg, block in zip(msgs, rows)]
        return [self._finish_gather(round_, msg, order, *flight) for msg, flight in zip(msgs, started)]

    def record_uploads(self, round_: int, stage: str, msg: Message, clients: np.ndarray) -> None:
        """The ledger's rows of an upload that travels as a sum: every client of ``clients`` sent its row (at its
        size on the wire), whatever the server then accepted."""
        if self.is_server:
            self.ledger.record(round_, stage, msg, clients, self.logical_nbytes(msg))

    def partial_sum(self, msg: Message) -> PartialSum:
        """An empty part of summed message ``msg`` for this rank to fold its clients into (terms are kept only
        where they could travel: with more than one rank)."""
        return PartialSum([ExactSum(msg.numel) for _ in range(msg.groups)], [] if self.size > 1 else None,
                          np.dtype(msg.dtype).itemsize)

    def reduce_sum(self, round_: int, msg: Message, part: PartialSum) -> np.ndarray | None:
        """Clients → server for a summed message: this rank's ``part`` (an exact running total per group of its
        accepted clients' weighted rows), added on the server without a single row moving. The ranks agree on
        one window of bits and learn the most terms any rank kept (one ``Iallreduce`` of three int64), each
        exports its totals onto the window, and one ``Ireduce`` (MPI.SUM of int64 words, which add
        associatively) brings the sum to rank 0, rounded there once per entry: the same bits on any rank count.
        Where every rank's kept rows are cheaper than the words, they are gathered and folded on rank 0 instead
        (:data:`KEEP_BYTES_PER_ENTRY`). The ledger records each client at its size on the wire apart, as a real
        deployment uploads each row (:meth:`record_uploads`). Returns the float64 sums on the server
        (groups × numel), else None."""
        totals = part.totals
        window = Window()
        for total in totals:
            window = window.union(total.window)
        agreement = np.append(window.maxima(), len(part.kept) if part.kept is not None else _UNKEPT)
        if self.size > 1:
            from mpi4py import MPI

            bounds = Message(f"{msg.name}_window", "up", 3, "int64", logical=False)
            self._timed(round_, bounds, "allreduce", agreement.nbytes,
                        self.comm.Iallreduce(MPI.IN_PLACE, agreement, op=MPI.MAX))
        agreed = Window.from_maxima(agreement[:2])
        if self.size > 1 and int(agreement[2]) * np.dtype(msg.dtype).itemsize < words(agreed) * 8:
            return self._gather_terms(round_, msg, part.kept or [], len(totals), agreed)
        start = time.perf_counter()
        exports = [total.export(agreed) for total in totals]
        wire = exports[0] if len(exports) == 1 else np.concatenate(exports)
        self.pack_seconds += time.perf_counter() - start
        summed: np.ndarray | None = wire
        if self.size > 1:
            from mpi4py import MPI

            summed = np.empty_like(wire) if self.is_server else None
            self._timed(round_, msg, "reduce", wire.nbytes, self.comm.Ireduce(wire, summed, op=MPI.SUM, root=0))
        if summed is None:
            return None
        return self._rounded(np.split(summed, len(totals)), agreed)

    def _gather_terms(self, round_: int, msg: Message, kept: list[Term], groups: int, agreed: Window
                      ) -> np.ndarray | None:
        """The cheap way of :meth:`reduce_sum`: each rank's kept terms (weight and group of each, then its rows in
        ``msg``'s dtype) gathered on rank 0, which folds them into exact totals of its own."""
        start = time.perf_counter()
        header = np.array([[t.weight for t in kept], [t.group for t in kept]], dtype=np.float64)
        rows = np.array([t.row for t in kept], dtype=msg.dtype).reshape(len(kept), msg.numel)
        blob = np.concatenate([header.reshape(-1).view(np.uint8), rows.reshape(-1).view(np.uint8)])
        self.pack_seconds += time.perf_counter() - start
        arrived = self.gather_bytes(round_, msg.name, blob)
        if not self.is_server:
            return None
        start = time.perf_counter()
        totals = [ExactSum(msg.numel) for _ in range(groups)]
        per_term = 16 + msg.numel * np.dtype(msg.dtype).itemsize
        for part in arrived:
            count = len(part) // per_term
            weights, group_of = part[: 16 * count].view(np.float64).reshape(2, count)
            for row, weight, group in zip(part[16 * count :].view(msg.dtype).reshape(count, msg.numel), weights,
                                          group_of):
                totals[int(group)].add(row, float(weight))
        self.pack_seconds += time.perf_counter() - start
        return self._rounded([total.export(agreed) for total in totals], agreed)

    def _rounded(self, wires: list[np.ndarray], agreed: Window) -> np.ndarray:
        """Each group's summed wire words as float64 sums, one row per group."""
        start = time.perf_counter()
        out = np.stack([round_sum(wire, agreed) for wire in wires])
        self.pack_seconds += time.perf_counter() - start
        return out

    def up_blobs(self, round_: int, stage: str, msg: Message, blobs: list[np.ndarray], clients: np.ndarray
                 ) -> list[np.ndarray] | None:
        """Clients → server for an encoded message: one uint8 blob per local client, each its own size. The sizes
        go first (one int64 per client), then exactly the bytes (``Igatherv``), never padded; the ledger records
        each client's encoded size. Returns every client's blob in ``clients`` order on the server."""
        sizes = np.array([blob.size for blob in blobs], dtype=np.int64)
        if self.size == 1:
            self.ledger.record(round_, stage, msg, clients, sizes)
            return list(blobs)
        order = self.placement.rank_order(clients) if self.is_server else None
        sizes_msg = Message(f"{msg.name}_sizes", "up", 1, "int64", logical=False)
        request, gathered, nbytes = self._start_gather(sizes_msg, sizes.reshape(-1, 1), order)
        all_sizes = self._finish_gather(round_, sizes_msg, order, request, gathered, nbytes)
        send = np.concatenate(blobs) if blobs else np.zeros(0, np.uint8)
        byte = _mpi_type(Message(msg.name, "up", 0, "uint8"))
        if order is None or all_sizes is None:
            self._timed(round_, msg, "gatherv", send.nbytes, self.comm.Igatherv(send, None, root=0))
            return None
        perm, per_rank = order
        in_rank_order = all_sizes.reshape(-1)[perm]  # the rows as they arrive: rank by rank
        counts = _per_rank_sums(in_rank_order, per_rank)
        recv = np.empty(int(in_rank_order.sum()), dtype=np.uint8)
        self._timed(round_, msg, "gatherv", recv.nbytes,
                    self.comm.Igatherv(send, [recv, counts, _displacements(counts), byte], root=0))
        self.ledger.record(round_, stage, msg, clients, all_sizes.reshape(-1))
        pieces = np.split(recv, np.cumsum(in_rank_order)[:-1])
        out: list[np.ndarray] = [np.zeros(0, np.uint8)] * len(perm)
        for position, client_index in enumerate(perm):
            out[client_index] = pieces[position]
        return out

    def down_blobs(self, round_: int, stage: str, msg: Message, blobs: list[np.ndarray] | None,
                   clients: np.ndarray) -> list[np.ndarray]:
        """Server → clients for an encoded message: ``blobs`` (server only) holds one blob for a broadcast, else
        one per client in ``clients`` order. Sizes first, then exactly the bytes (``Ibcast``/``Iscatterv``); the
        ledger records each client's encoded size. Returns this rank's blobs, one per local client."""
        n_local = len(self.local_clients(clients))
        if self.is_server:
            blobs = require_blobs(msg, blobs, 1 if msg.broadcast else len(clients))
            sizes = np.array([b.size for b in blobs], dtype=np.int64)
            self.ledger.record(round_, stage, msg, clients, np.repeat(sizes, len(clients)) if msg.broadcast else sizes)
        if self.size == 1:
            return list(blobs) * n_local if msg.broadcast else list(blobs)  # type: ignore[arg-type]
        sizes_msg = Message(f"{msg.name}_sizes", "down", 1, "int64", broadcast=msg.broadcast, logical=False)
        byte = _mpi_type(Message(msg.name, "down", 0, "uint8"))
        if msg.broadcast:
            size = self._bcast(round_, sizes_msg, sizes if self.is_server else None)
            buf = blobs[0] if self.is_server else np.empty(int(size[0]), np.uint8)  # type: ignore[index]
            nbytes = buf.nbytes * (self.size - 1) if self.is_server else buf.nbytes
            self._timed(round_, msg, "bcast", nbytes, self.comm.Ibcast([buf, byte], root=0))
            return [buf] * n_local
        payload = sizes.reshape(-1, 1) if self.is_server else None
        local_sizes = self._scatter(round_, sizes_msg, payload, clients, n_local).reshape(-1)
        recv = np.empty(int(local_sizes.sum()), dtype=np.uint8)
        if self.is_server:
            perm, per_rank = self.placement.rank_order(clients)
            in_rank_order = sizes[perm]
            counts = _per_rank_sums(in_rank_order, per_rank)
            send = np.concatenate([blobs[i] for i in perm]) if len(perm) else np.zeros(0, np.uint8)  # type: ignore[index]
            request = self.comm.Iscatterv([send, counts, _displacements(counts), byte], [recv, byte], root=0)
            nbytes = send.nbytes
        else:
            request = self.comm.Iscatterv(None, [recv, byte], root=0)
            nbytes = recv.nbytes
        self._timed(round_, msg, "scatterv", nbytes, request)
        return np.split(recv, np.cumsum(local_sizes)[:-1]) if n_local else []

    def gather_bytes(self, round_: int, name: str, blob: np.ndarray) -> list[np.ndarray]:
        """Every rank's variable-length uint8 ``blob`` (e.g. its checkpoint) on the server, indexed by
        rank; an empty list elsewhere. Sizes first (``Gather``), then the bytes (``Gatherv``)."""
        if self.size == 1:
            return [blob]
        sizes = np.zeros(self.size, dtype=np.int64)
        msg = Message(name, "up", 0, "uint8", logical=False)
        sizes_msg = Message(f"{name}_sizes", "up", 1, "int64", logical=False)
        request = self.comm.Igather(np.array([blob.size], dtype=np.int64), sizes if self.is_server else None, root=0)
        self._timed(round_, sizes_msg, "gather", 8, request)  # no blocking call: it would spin a core
        displs = _displacements(sizes)
        if not self.is_server:
            self._timed(round_, msg, "gatherv", blob.nbytes, self.comm.Igatherv(blob, None, root=0))
            return []
        recv = np.empty(int(sizes.sum()), dtype=np.uint8)
        request = self.comm.Igatherv(blob, [recv, sizes, displs, _mpi_type(msg)], root=0)
        self._timed(round_, msg, "gatherv", int(sizes.sum()), request)
        return [recv[d : d + n] for d, n in zip(displs, sizes)]

    def exchange(self, round_: int, name: str, outgoing: dict[int, np.ndarray]) -> dict[int, np.ndarray]:
        """Every rank sends each rank in ``outgoing`` its uint8 buffer and gets back what the others sent it,
        by source rank (sizes first with ``Alltoall``, then the bytes with ``Ialltoallv``). Simulator traffic
        (e.g. a visiting client's state), recorded as physical bytes only. A collective on every rank."""
        if self.size == 1:
            return {r: blob for r, blob in outgoing.items() if r == 0}
        send_counts = np.zeros(self.size, dtype=np.int32)
        for rank, blob in outgoing.items():
            send_counts[rank] = blob.size
        recv_counts = np.zeros(self.size, dtype=np.int32)
        counts_msg = Message(exchange_names(name)[1], "up", self.size, "int32", logical=False)
        self._timed(round_, counts_msg, "alltoall", 8 * self.size, self.comm.Ialltoall(send_counts, recv_counts))
        send = np.concatenate([outgoing.get(r, np.zeros(0, np.uint8)) for r in range(self.size)]).astype(np.uint8)
        recv = np.empty(int(recv_counts.sum()), dtype=np.uint8)
        send_displs, recv_displs = _displacements(send_counts), _displacements(recv_counts)
        msg = Message(name, "up", 0, "uint8", logical=False)
        byte = _mpi_type(msg)
        request = self.comm.Ialltoallv([send, send_counts, send_displs, byte], [recv, recv_counts, recv_displs, byte])
        self._timed(round_, msg, "alltoallv", int(send_counts.sum() + recv_counts.sum()), request)
        return {r: recv[d : d + n] for r, (d, n) in enumerate(zip(recv_displs, recv_counts)) if n}

    @staticmethod
    def check_payload(msg: Message, payload: np.ndarray | None, rows: int) -> np.ndarray:
        """``payload``, checked to be ``rows`` rows of ``msg``'s size and dtype."""
        if payload is None or payload.dtype != np.dtype(msg.dtype) or payload.size != rows * msg.numel:
            got = "None" if payload is None else f"{payload.dtype}{list(payload.shape)}"
            raise ValueError(f"message {msg.name}: expected {rows}×{msg.numel} {msg.dtype}, got {got}")
        return payload

    def _timed(self, round_: int, msg: Message, op: str, nbytes: int, request) -> None:  # noqa: ANN001
        start = time.perf_counter()
        wait_without_spinning(request)
        self.physical.record(round_, msg.name, op, nbytes, time.perf_counter() - start)

    def _bcast(self, round_: int, msg: Message, payload: np.ndarray | None) -> np.ndarray:
        buf = np.ascontiguousarray(payload) if self.is_server else np.empty(msg.numel, dtype=msg.dtype)
        nbytes = buf.nbytes * (self.size - 1) if self.is_server else buf.nbytes
        self._timed(round_, msg, "bcast", nbytes, self.comm.Ibcast(buf, root=0))
        return buf

    def _scatter(
        self, round_: int, msg: Message, payload: np.ndarray | None, clients: np.ndarray, n_local: int
    ) -> np.ndarray:
        recv = np.empty((n_local, msg.numel), dtype=msg.dtype)
        if self.is_server:
            start = time.perf_counter()
            perm, per_rank = self.placement.rank_order(clients)
            send = np.ascontiguousarray(np.asarray(payload).reshape(-1, msg.numel)[perm])  # checked by down()
            self.pack_seconds += time.perf_counter() - start
            counts = per_rank * msg.numel
            request = self.comm.Iscatterv([send, counts, _displacements(counts), _mpi_type(msg)], recv, root=0)
            nbytes = send.nbytes
        else:
            request = self.comm.Iscatterv(None, recv, root=0)
            nbytes = recv.nbytes
        self._timed(round_, msg, "scatterv", nbytes, request)
        return recv

    def _start_gather(self, msg: Message, rows: np.ndarray, order: tuple[np.ndarray, np.ndarray] | None
                      ) -> tuple[Any, np.ndarray | None, int]:
        """Start gathering ``msg``'s rows on the server (``order``: the clients' rank order there, from
        :meth:`Placement.rank_order`): (the request, the receive buffer on the server, the bytes this rank moves)."""
        send = np.ascontiguousarray(rows, dtype=msg.dtype).reshape(-1)
        if order is None:
            return self.comm.Igatherv(send, None, root=0), None, send.nbytes
        perm, per_rank = order
        counts = per_rank * msg.numel
        recv = np.empty((len(perm), msg.numel), dtype=msg.dtype)
        request = self.comm.Igatherv(send, [recv, counts, _displacements(counts), _mpi_type(msg)], root=0)
        return request, recv, recv.nbytes

    def _finish_gather(self, round_: int, msg: Message, order: tuple[np.ndarray, np.ndarray] | None, request: Any,
                       recv: np.ndarray | None, nbytes: int) -> np.ndarray | None:
        """Wait for a gather; on the server, its rows back in client order."""
        self._timed(round_, msg, "gatherv", nbytes, request)
        if recv is None or order is None:
            return None
        start = time.perf_counter()
        perm, _ = order
        out = np.empty_like(recv)
        out[perm] = recv
        self.pack_seconds += time.perf_counter() - start
        return out


def require_blobs(msg: Message, blobs: list[np.ndarray] | None, count: int) -> list[np.ndarray]:
    """``blobs``, checked to be ``count`` uint8 buffers (the server's encoded payload of ``msg``)."""
    if blobs is None or len(blobs) != count or any(b.dtype != np.uint8 or b.ndim != 1 for b in blobs):
        raise ValueError(f"message {msg.name}: expected {count} encoded uint8 buffers")
    return blobs


def exchange_names(name: str) -> tuple[str, str]:
    """The physical-log message names an :meth:`Transport.exchange` called ``name`` records: its bytes and its
    sizes."""
    return name, f"{name}_sizes"


def _per_rank_sums(values: np.ndarray, per_rank: np.ndarray) -> np.ndarray:
    """Each rank's total of ``values`` (consecutive runs of ``per_rank`` entries, rank by rank)."""
    ends = np.cumsum(per_rank)
    totals = np.concatenate(([0], np.cumsum(values, dtype=np.int64)))
    return totals[ends] - totals[ends - per_rank]


def _displacements(counts: np.ndarray) -> np.ndarray:
    """Where each rank's part starts in a buffer of consecutive parts of ``counts`` (their dtype)."""
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(counts.dtype)


def _mpi_type(msg: Message):  # noqa: ANN202 - an MPI.Datatype
    from mpi4py.util.dtlib import from_numpy_dtype

    return from_numpy_dtype(np.dtype(msg.dtype))
