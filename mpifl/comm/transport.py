"""Moving declared messages between the server (rank 0) and the worker ranks.

Every call is a collective on flat contiguous numpy buffers (mpi4py's uppercase API): broadcast
payloads go by ``Ibcast``, per-client payloads by ``Iscatterv``/``Igatherv`` with counts and
displacements. Rows for a set of clients are always presented in client-id order, whichever rank
holds which client, so everything downstream is independent of the rank count.

The transport moves bytes and lists each collective in the physical log (:meth:`Transport.wait`); what a real
deployment would send (the ledger) is counted by the plan walker. How a summed message is added up, with the
collectives only it needs, is :class:`~mpifl.comm.exactsum.distributed.DistributedSum`'s business, on
:meth:`Transport.wait`, :meth:`Transport.workers` and :meth:`Transport.gather_bytes`.

Waiting is non-blocking with a growing sleep: Open MPI's blocking calls poll a full core, which
on an oversubscribed node steals cycles from the training ranks.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mpifl.comm.ledger import PhysicalLog
from mpifl.comm.messages import Message
from mpifl.comm.placement import Placement

_MIN_SLEEP_S = 20e-6
_MAX_SLEEP_S = 5e-4


def wait_without_spinning(request, longest: float = _MAX_SLEEP_S) -> None:  # noqa: ANN001 - an MPI.Request
    """Complete ``request`` while yielding the core: test, then sleep with exponential back-off up to ``longest``
    seconds (longer where a wait may last minutes and a late wake costs nothing)."""
    delay = _MIN_SLEEP_S
    while not request.Test():
        time.sleep(delay)
        delay = min(delay * 2.0, longest)


def arrive_together(comm) -> None:  # noqa: ANN001 - an mpi4py Comm
    """Wait, without spinning, until every rank of ``comm`` is here (``Ibarrier``): put before a blocking
    collective of Python objects, it finds every rank ready instead of polling a core while a slower rank (the
    server writing its results, a rank still loading) works on."""
    wait_without_spinning(comm.Ibarrier())


@dataclass
class Transport:
    """Collectives for one communicator; rank 0 is the server, and also hosts every client if alone."""

    comm: Any  # mpi4py.MPI.Comm, or None when running without MPI in one process
    placement: Placement
    physical: PhysicalLog = field(default_factory=PhysicalLog)
    pack_seconds: float = 0.0  # copying rows into and out of the flat, rank-ordered MPI buffers; exact sums' words
    _workers: Any = field(default=None, init=False, repr=False)  # the workers' communicator, made when first needed

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

    def down(self, round_: int, msg: Message, payload: np.ndarray | None, clients: np.ndarray) -> np.ndarray:
        """Server → clients. ``payload`` (server only): shape [numel] if broadcast, else [len(clients), numel].

        Returns this rank's rows, one per local client in ``clients`` (a read-only view for broadcasts).
        """
        if self.is_server:
            payload = self.check_payload(msg, payload, 1 if msg.broadcast else len(clients))
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
        """The server's ``payload`` on every rank (one row, whatever the clients)."""
        if self.size == 1:
            return self.check_payload(msg, payload, 1)
        return self._bcast(round_, msg, payload)

    def up(self, round_: int, msg: Message, rows: np.ndarray, clients: np.ndarray) -> np.ndarray | None:
        """Clients → server. ``rows``: this rank's local clients' rows. Returns all rows in ``clients`` order
        on the server, ``None`` elsewhere."""
        return self.upload(round_, [msg], [rows], clients)[0]  # type: ignore[return-value]

    def upload(self, round_: int, msgs: list[Message], outgoing: list[np.ndarray | list[np.ndarray]],
               clients: np.ndarray) -> list[np.ndarray | list[np.ndarray] | None]:
        """One phase of uploads of the same clients: for each message, this rank's local clients' rows (an array)
        or their encodings (a list of uint8 blobs, each its own size). Every gather of rows is started before the
        first is waited for, so they overlap; encodings follow, sizes first, then exactly the bytes, never padded.
        Returns, per message, all rows in ``clients`` order (or every client's blob) on the server, else None."""
        local = self.local_clients(clients)
        raw = [j for j, out in enumerate(outgoing) if isinstance(out, np.ndarray)]
        for j in raw:
            self.check_payload(msgs[j], outgoing[j], len(local))  # type: ignore[arg-type]
        if self.size == 1:
            return list(outgoing)
        order = self.placement.rank_order(clients) if self.is_server else None
        started = {j: self._start_gather(msgs[j], outgoing[j], order) for j in raw}  # type: ignore[arg-type]
        arrived: list[np.ndarray | list[np.ndarray] | None] = [None] * len(msgs)
        for j, flight in started.items():
            arrived[j] = self._finish_gather(round_, msgs[j], order, *flight)
        for j, blobs in enumerate(outgoing):
            if j not in started:
                arrived[j] = self._gather_blobs(round_, msgs[j], blobs, order)  # type: ignore[arg-type]
        return arrived

    def workers(self) -> Any:
        """The communicator of the worker ranks (1..P−1), for collectives the server takes no part in; ``None`` on
        the server and alone. Made at the first call, which every rank makes together (``Comm.Split``)."""
        if self.size == 1:
            return None
        if self._workers is None:
            from mpi4py import MPI

            self._workers = self.comm.Split(MPI.UNDEFINED if self.is_server else 1, self.rank)
        return None if self.is_server else self._workers

    def _gather_blobs(self, round_: int, msg: Message, blobs: list[np.ndarray],
                      order: tuple[np.ndarray, np.ndarray] | None) -> list[np.ndarray] | None:
        """One message's encodings on the server, in client order: sizes first (one int64 per client, an
        ``Igatherv``), then exactly the bytes."""
        sizes = np.array([blob.size for blob in blobs], dtype=np.int64)
        sizes_msg = Message(f"{msg.name}_sizes", "up", 1, "int64", logical=False)
        request, gathered, nbytes = self._start_gather(sizes_msg, sizes.reshape(-1, 1), order)
        all_sizes = self._finish_gather(round_, sizes_msg, order, request, gathered, nbytes)
        send = np.concatenate(blobs) if blobs else np.zeros(0, np.uint8)
        byte = _mpi_type(Message(msg.name, "up", 0, "uint8"))
        if order is None or all_sizes is None:
            self.wait(round_, msg.name, "gatherv", send.nbytes, self.comm.Igatherv(send, None, root=0))
            return None
        perm, per_rank = order
        in_rank_order = all_sizes.reshape(-1)[perm]  # the rows as they arrive: rank by rank
        counts = _per_rank_sums(in_rank_order, per_rank)
        recv = np.empty(int(in_rank_order.sum()), dtype=np.uint8)
        self.wait(round_, msg.name, "gatherv", recv.nbytes,
                  self.comm.Igatherv(send, [recv, counts, displacements(counts), byte], root=0))
        pieces = np.split(recv, np.cumsum(in_rank_order)[:-1])
        out: list[np.ndarray] = [np.zeros(0, np.uint8)] * len(perm)
        for position, client_index in enumerate(perm):
            out[client_index] = pieces[position]
        return out

    def down_blobs(self, round_: int, msg: Message, blobs: list[np.ndarray] | None, clients: np.ndarray
                   ) -> list[np.ndarray]:
        """Server → clients for an encoded message: ``blobs`` (server only) holds one blob for a broadcast, else
        one per client in ``clients`` order. Sizes first, then exactly the bytes (``Ibcast``/``Iscatterv``).
        Returns this rank's blobs, one per local client."""
        n_local = len(self.local_clients(clients))
        if self.is_server:
            blobs = require_blobs(msg, blobs, 1 if msg.broadcast else len(clients))
            sizes = np.array([b.size for b in blobs], dtype=np.int64)
        if self.size == 1:
            return list(blobs) * n_local if msg.broadcast else list(blobs)  # type: ignore[arg-type]
        sizes_msg = Message(f"{msg.name}_sizes", "down", 1, "int64", broadcast=msg.broadcast, logical=False)
        byte = _mpi_type(Message(msg.name, "down", 0, "uint8"))
        if msg.broadcast:
            size = self._bcast(round_, sizes_msg, sizes if self.is_server else None)
            buf = blobs[0] if self.is_server else np.empty(int(size[0]), np.uint8)  # type: ignore[index]
            nbytes = buf.nbytes * (self.size - 1) if self.is_server else buf.nbytes
            self.wait(round_, msg.name, "bcast", nbytes, self.comm.Ibcast([buf, byte], root=0))
            return [buf] * n_local
        payload = sizes.reshape(-1, 1) if self.is_server else None
        local_sizes = self._scatter(round_, sizes_msg, payload, clients, n_local).reshape(-1)
        recv = np.empty(int(local_sizes.sum()), dtype=np.uint8)
        if self.is_server:
            perm, per_rank = self.placement.rank_order(clients)
            in_rank_order = sizes[perm]
            counts = _per_rank_sums(in_rank_order, per_rank)
            send = np.concatenate([blobs[i] for i in perm]) if len(perm) else np.zeros(0, np.uint8)  # type: ignore[index]
            request = self.comm.Iscatterv([send, counts, displacements(counts), byte], [recv, byte], root=0)
            nbytes = send.nbytes
        else:
            request = self.comm.Iscatterv(None, [recv, byte], root=0)
            nbytes = recv.nbytes
        self.wait(round_, msg.name, "scatterv", nbytes, request)
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
        self.wait(round_, sizes_msg.name, "gather", 8, request)  # no blocking call: it would spin a core
        displs = displacements(sizes)
        if not self.is_server:
            self.wait(round_, msg.name, "gatherv", blob.nbytes, self.comm.Igatherv(blob, None, root=0))
            return []
        recv = np.empty(int(sizes.sum()), dtype=np.uint8)
        request = self.comm.Igatherv(blob, [recv, sizes, displs, _mpi_type(msg)], root=0)
        self.wait(round_, msg.name, "gatherv", int(sizes.sum()), request)
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
        self.wait(round_, counts_msg.name, "alltoall", 8 * self.size, self.comm.Ialltoall(send_counts, recv_counts))
        send = np.concatenate([outgoing.get(r, np.zeros(0, np.uint8)) for r in range(self.size)]).astype(np.uint8)
        recv = np.empty(int(recv_counts.sum()), dtype=np.uint8)
        send_displs, recv_displs = displacements(send_counts), displacements(recv_counts)
        msg = Message(name, "up", 0, "uint8", logical=False)
        byte = _mpi_type(msg)
        request = self.comm.Ialltoallv([send, send_counts, send_displs, byte], [recv, recv_counts, recv_displs, byte])
        self.wait(round_, msg.name, "alltoallv", int(send_counts.sum() + recv_counts.sum()), request)
        return {r: recv[d : d + n] for r, (d, n) in enumerate(zip(recv_displs, recv_counts)) if n}

    @staticmethod
    def check_payload(msg: Message, payload: np.ndarray | None, rows: int) -> np.ndarray:
        """``payload``, checked to be ``rows`` rows of ``msg``'s size and dtype."""
        if payload is None or payload.dtype != np.dtype(msg.dtype) or payload.size != rows * msg.numel:
            got = "None" if payload is None else f"{payload.dtype}{list(payload.shape)}"
            raise ValueError(f"message {msg.name}: expected {rows}×{msg.numel} {msg.dtype}, got {got}")
        return payload

    def wait(self, round_: int, name: str, op: str, nbytes: int, request) -> None:  # noqa: ANN001
        """Wait for ``request``, a collective ``op`` of message ``name`` started on :attr:`comm` (or on
        :meth:`workers`), and list it in the physical log at ``nbytes``: every collective, this module's and the
        exact sum's, is recorded here alike."""
        start = time.perf_counter()
        wait_without_spinning(request)
        self.physical.record(round_, name, op, nbytes, time.perf_counter() - start)

    def _bcast(self, round_: int, msg: Message, payload: np.ndarray | None) -> np.ndarray:
        buf = np.ascontiguousarray(payload) if self.is_server else np.empty(msg.numel, dtype=msg.dtype)
        nbytes = buf.nbytes * (self.size - 1) if self.is_server else buf.nbytes
        self.wait(round_, msg.name, "bcast", nbytes, self.comm.Ibcast(buf, root=0))
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
            request = self.comm.Iscatterv([send, counts, displacements(counts), _mpi_type(msg)], recv, root=0)
            nbytes = send.nbytes
        else:
            request = self.comm.Iscatterv(None, recv, root=0)
            nbytes = recv.nbytes
        self.wait(round_, msg.name, "scatterv", nbytes, request)
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
        request = self.comm.Igatherv(send, [recv, counts, displacements(counts), _mpi_type(msg)], root=0)
        return request, recv, recv.nbytes

    def _finish_gather(self, round_: int, msg: Message, order: tuple[np.ndarray, np.ndarray] | None, request: Any,
                       recv: np.ndarray | None, nbytes: int) -> np.ndarray | None:
        """Wait for a gather; on the server, its rows back in client order."""
        self.wait(round_, msg.name, "gatherv", nbytes, request)
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


def displacements(counts: np.ndarray) -> np.ndarray:
    """Where each rank's part starts in a buffer of consecutive parts of ``counts`` (their dtype)."""
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(counts.dtype)


def _mpi_type(msg: Message):  # noqa: ANN202 - an MPI.Datatype
    from mpi4py.util.dtlib import from_numpy_dtype

    return from_numpy_dtype(np.dtype(msg.dtype))
