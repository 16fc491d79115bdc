"""A summed message's sum across the ranks: Σᵢ weightᵢ·rowᵢ over the accepted clients, the same bits on any rank count.

The walker asks for a round's total once (:meth:`DistributedSum.total`); the whole protocol lives here, its phases
in order, each on the transport's generic wait (:meth:`~mpifl.comm.transport.Transport.wait`, which lists every
collective in the physical log) and on the exact sum's arithmetic below it:

1. **agree**: each rank has folded its clients' weighted rows into exact totals (:class:`ExactSum`, one per group)
   as they finished, and kept copies of those rows while they are few; one all-reduce (MPI.MAX) of five int64 tells
   every rank the window of bits, the most terms any rank kept and folded (the folded count bounds the sum's terms,
   which sizes the wire: a word less for fewer than 2^15 terms) and whether rank 0 folded any;
2. then the cheapest way to rank 0:
   - **the terms**, where every rank's kept rows are fewer bytes than the totals' wire words: a gather of bytes,
     and rank 0 folds them into exact totals of its own and rounds each entry once;
   - **the workers round**, where rank 0 folded nothing (it hosts no clients): each worker exports its totals onto
     the window, one reduce-scatter of int64 words among the workers (MPI.SUM, associative) gives each its share
     of whole chunks, it rounds each entry of its share once, and rank 0 gathers the float64 sums: rank 0, which
     every worker waits for between its upload and the next broadcast, neither exports nor rounds;
   - **rank 0 rounds**, where it folded terms of its own: every rank exports, one reduce adds the words on rank 0,
     which rounds them.

On one rank nothing moves: each total is rounded where it is (:meth:`ExactSum.rounded`).

Every way gives the correctly rounded exact sum, so the choice changes traffic, never a bit.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from mpifl.comm.exactsum import EMPTY, Array, ExactSum, Window, _backends, host_copy, round_sum, words
from mpifl.comm.messages import Message, require
from mpifl.comm.transport import Transport, displacements

KEEP_BYTES_PER_ENTRY = 32
"""A worker keeps its accepted clients' rows of a summed message beside its exact totals while they take at most
this many bytes per entry (8 float32 rows). When every worker's kept rows are fewer bytes than the totals' wire
words (16 per entry for a typical float32 update of a cohort under 2^15 clients), the rows travel instead and rank
0 folds them itself: the same bits, as the sum is exact, and a deployment's own traffic where a worker hosts a
client or two of the round."""

_UNKEPT = 1 << 40  # the kept-terms count of a rank that stopped keeping: more than any words would pay for
_TERM_HEADER = 16  # a travelling term's weight and group, two float64, ahead of the rows
T = TypeVar("T")


@dataclass(frozen=True)
class Term:
    """One accepted client's contribution to a summed message: ``weight``·``row`` into group ``group``."""

    row: np.ndarray
    weight: float
    group: int


@dataclass(frozen=True)
class _Agreement:
    """What every rank learns before a sum moves: the window of bits, the most terms any rank kept (``_UNKEPT`` if
    one stopped keeping), a bound on the sum's terms (the most any rank folded, times the ranks), and whether rank 0
    folded any."""

    window: Window
    kept: int
    terms: int
    server_folded: bool

    @property
    def words(self) -> int:
        """int64 words per entry on the wire."""
        return words(self.window, self.terms)


class DistributedSum:
    """This rank's part of summed message ``msg`` until :meth:`total` adds every rank's part on rank 0."""

    def __init__(self, msg: Message, transport: Transport):
        self.msg, self.transport = msg, transport
        self.totals = [ExactSum(msg.numel) for _ in range(msg.groups)]
        # copies of the folded terms, while few (KEEP_BYTES_PER_ENTRY); only with more than one rank can they travel
        self.kept: list[Term] | None = [] if transport.size > 1 else None

    def add(self, row: Array, weight: float, group: int) -> None:
        """Fold one accepted client's ``weight``·``row`` into ``group``'s total (and keep it while few): a numpy
        row, or a tensor on its device, where the total then folds it (``ExactSum``'s backends)."""
        self.totals[group].add(row, weight)
        if self.kept is not None:
            self.kept.append(Term(host_copy(row), weight, group))
            if len(self.kept) * self.msg.itemsize > KEEP_BYTES_PER_ENTRY:
                self.kept = None

    def add_rows(self, rows: Array, weights: np.ndarray, groups: np.ndarray) -> None:
        """Fold several accepted clients' rows at once (``rows``: clients × numel, a device tensor's rows are
        folded there with one wait for all: ``ExactSum.add_rows``), each into its group's total."""
        for group in np.unique(groups).tolist():
            # the other groups' rows weigh 0 and are left out where the rows are (a list index on a device tensor
            # would be copied there from pageable memory, a wait for the device)
            self.totals[group].add_rows(rows, np.where(groups == group, weights, 0.0))
        if self.kept is not None:
            if (len(self.kept) + len(rows)) * self.msg.itemsize > KEEP_BYTES_PER_ENTRY:
                self.kept = None
            else:
                copies = host_copy(rows)  # one copy of the few rows kept
                self.kept.extend(Term(row, float(w), int(g)) for row, w, g in zip(copies, weights, groups))

    def total(self, round_: int) -> np.ndarray | None:
        """Every rank's part added: the float64 sums (groups × numel) on rank 0, ``None`` elsewhere. A collective:
        the ranks agree, then take the cheapest way (the module's docstring)."""
        if self.transport.size == 1:  # nothing to move: each total rounds itself
            return self._rounded_totals(self.totals)
        agreed = self._agree(round_)
        if agreed.kept * self.msg.itemsize < agreed.words * 8:
            return self._total_of_terms(round_)
        if not agreed.server_folded:
            return self._rounded_by_workers(round_, agreed)
        return self._rounded_on_server(round_, agreed)

    def _agree(self, round_: int) -> _Agreement:
        """The window, kept and folded terms of every rank, in one all-reduce (MPI.MAX) of five int64."""
        window = functools.reduce(Window.union, (part.window for part in self.totals), EMPTY)
        most = max(part.terms for part in self.totals)
        kept = len(self.kept) if self.kept is not None else _UNKEPT
        mine = np.append(window.maxima(), [kept, most, most if self.transport.is_server else 0])
        agreed = _allreduce_max(self.transport, round_, f"{self.msg.name}_window", mine)
        return _Agreement(Window.from_maxima(agreed[:2]), int(agreed[2]), int(agreed[3]) * self.transport.size,
                          bool(agreed[4]))

    def _total_of_terms(self, round_: int) -> np.ndarray | None:
        """The cheap way: each rank's kept terms (weight and group of each, then its rows in ``msg``'s dtype)
        gathered on rank 0, which folds them into exact totals of its own."""
        msg, kept = self.msg, self.kept or []

        def pack() -> np.ndarray:
            header = np.array([[t.weight for t in kept], [t.group for t in kept]], dtype=np.float64)
            rows = np.array([t.row for t in kept], dtype=msg.dtype).reshape(len(kept), msg.numel)
            return np.concatenate([header.reshape(-1).view(np.uint8), rows.reshape(-1).view(np.uint8)])

        arrived = self.transport.gather_bytes(round_, msg.name, self._timed(pack))
        if not self.transport.is_server:
            return None
        return self._rounded_totals(self._timed(lambda: self._folded_terms(arrived)))

    def _folded_terms(self, arrived: list[np.ndarray]) -> list[ExactSum]:
        """Rank 0's own exact totals of every rank's travelling terms."""
        msg = self.msg
        totals = [ExactSum(msg.numel) for _ in range(msg.groups)]
        per_term = _TERM_HEADER + msg.nbytes
        for part in arrived:
            count = len(part) // per_term
            weights, groups = part[: _TERM_HEADER * count].view(np.float64).reshape(2, count)
            rows = part[_TERM_HEADER * count :].view(msg.dtype).reshape(count, msg.numel)
            for row, weight, group in zip(rows, weights, groups):
                totals[int(group)].add(row, float(weight))
        return totals

    def _rounded_by_workers(self, round_: int, agreed: _Agreement) -> np.ndarray | None:
        """The workers' totals summed and rounded by the workers themselves, each its share of whole chunks of the
        entries (a reduce-scatter of the wire words among them), and gathered on rank 0 as float64. The same bits as
        rank 0 rounding the whole sum: each entry is rounded once, from the same exact total."""
        transport, groups, numel = self.transport, len(self.totals), self.msg.numel
        transport.workers()  # every rank: made together the first time
        shares = _worker_shares(groups * numel, numel, transport.size - 1)
        counts = np.diff(shares)
        if transport.is_server:
            sums = _gather_floats(transport, round_, self.msg.name, np.empty(0), np.append(0, counts))
            return require(sums, "the gathered sums").reshape(groups, numel)
        first, last = int(shares[transport.rank - 1]), int(shares[transport.rank])
        wire = self._timed(lambda: self._exported(agreed))
        mine = _reduce_scatter_words(transport, round_, self.msg.name, wire, [int(c) * agreed.words for c in counts])
        rounded = self._timed(lambda: self._rounded_share(mine, first, last, agreed))
        _gather_floats(transport, round_, self.msg.name, rounded, counts)
        return None

    def _rounded_share(self, mine: np.ndarray, first: int, last: int, agreed: _Agreement) -> np.ndarray:
        """This worker's summed words of entries [first, last) (of the groups end to end) rounded, group by group,
        where its totals fold."""
        numel, per, device = self.msg.numel, agreed.words, self.totals[0].round_device
        pieces = []
        for group in range(first // numel, -(-last // numel)):  # the groups this share reaches into
            start, stop = max(first, group * numel), min(last, (group + 1) * numel)
            if start >= stop:
                continue
            part = round_sum(mine[(start - first) * per : (stop - first) * per], agreed.window, agreed.terms, device)
            pieces.append(part if isinstance(part, np.ndarray) else part.cpu().numpy())
        return _joined(pieces) if pieces else np.empty(0)

    def _rounded_on_server(self, round_: int, agreed: _Agreement) -> np.ndarray | None:
        """Rank 0 folded terms of its own: every rank's words reduced onto it (one MPI.SUM), and it rounds them."""
        wire = self._timed(lambda: self._exported(agreed))
        summed = _reduce_words(self.transport, round_, self.msg.name, wire)
        if summed is None:
            return None
        return self._timed(lambda: _rows([round_sum(part, agreed.window, agreed.terms)
                                          for part in np.split(summed, len(self.totals))]))

    def _exported(self, agreed: _Agreement) -> np.ndarray:
        """This rank's totals on the agreed wire, group after group."""
        return _joined([part.export(agreed.window, agreed.terms) for part in self.totals])

    def _rounded_totals(self, totals: list[ExactSum]) -> np.ndarray:
        """Totals that are all there is (one rank, or rank 0's fold of every term), rounded where they are."""
        return self._timed(lambda: _rows([total.rounded() for total in totals]))

    def _timed(self, work: Callable[[], T]) -> T:
        """``work()``, its seconds charged to the transport's packing (exports, terms and rounding are the sum's
        bytes being made ready to move)."""
        start = time.perf_counter()
        result = work()
        self.transport.pack_seconds += time.perf_counter() - start
        return result


def _allreduce_max(transport: Transport, round_: int, name: str, vector: np.ndarray) -> np.ndarray:
    """The entrywise maximum of every rank's int64 ``vector``, on every rank (``Iallreduce``, MPI.MAX)."""
    from mpi4py import MPI

    transport.wait(round_, name, "allreduce", vector.nbytes,
                   transport.comm.Iallreduce(MPI.IN_PLACE, vector, op=MPI.MAX))
    return vector


def _reduce_words(transport: Transport, round_: int, name: str, wire: np.ndarray) -> np.ndarray | None:
    """The entrywise sum of every rank's int64 ``wire`` on rank 0 (``Ireduce``, MPI.SUM: integers add
    associatively); ``None`` elsewhere."""
    from mpi4py import MPI

    summed = np.empty_like(wire) if transport.is_server else None
    transport.wait(round_, name, "reduce", wire.nbytes, transport.comm.Ireduce(wire, summed, op=MPI.SUM, root=0))
    return summed


def _reduce_scatter_words(transport: Transport, round_: int, name: str, wire: np.ndarray, counts: list[int]
                          ) -> np.ndarray:
    """A worker's part of the workers' entrywise sum of their int64 ``wire`` (``Ireduce_scatter``, MPI.SUM, among
    the workers: rank 0 holds no terms and takes no part): worker r keeps ``counts[r − 1]`` words, those after the
    workers' before it."""
    from mpi4py import MPI

    mine = np.empty(counts[transport.rank - 1], dtype=np.int64)
    transport.wait(round_, name, "reduce_scatter", wire.nbytes,
                   transport.workers().Ireduce_scatter(wire, mine, recvcounts=counts, op=MPI.SUM))
    return mine


def _gather_floats(transport: Transport, round_: int, name: str, values: np.ndarray, counts: np.ndarray
                   ) -> np.ndarray | None:
    """Every rank's float64 ``values`` end to end on rank 0, rank by rank (``Igatherv``; ``counts[r]``, known to
    every rank, is how many rank r sends); ``None`` elsewhere."""
    from mpi4py import MPI

    if not transport.is_server:
        transport.wait(round_, name, "gatherv", values.nbytes, transport.comm.Igatherv(values, None, root=0))
        return None
    recv = np.empty(int(counts.sum()))
    request = transport.comm.Igatherv(values, [recv, counts, displacements(counts), MPI.DOUBLE], root=0)
    transport.wait(round_, name, "gatherv", recv.nbytes, request)
    return recv


def _worker_shares(entries: int, numel: int, workers: int) -> np.ndarray:
    """Where each worker's share of the groups' ``entries`` (``numel`` a group, end to end) starts, and the end:
    whole chunks of ``CHUNK`` entries of each group (where the wire may be split), as even as they allow."""
    starts = np.concatenate([group * numel + np.arange(0, numel, _backends.CHUNK, dtype=np.int64)
                             for group in range(entries // max(numel, 1))] or [np.zeros(0, dtype=np.int64)])
    fair = np.arange(workers) * entries / workers
    return np.append(starts[np.minimum(np.searchsorted(starts, fair), len(starts) - 1)] if len(starts) else
                     np.zeros(workers, dtype=np.int64), entries)


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    """``parts`` end to end; a single part as it is (a 1.6 M-entry model's wire is 39 MB: no copy for nothing)."""
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _rows(sums: list[np.ndarray]) -> np.ndarray:
    """Each group's sums as one row of a (groups × numel) array, without a copy for a single group."""
    return _joined(sums).reshape(len(sums), -1)
