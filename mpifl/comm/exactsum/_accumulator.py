"""One rank's running exact total (``ExactSum``): terms folded as they come, normalised now and then, exported onto
the ranks' agreed wire or rounded where it is.

Bounds. Each term adds at most 2^(W−1) to a level (|x| ≤ 2^(b_top+W−1)). Levels accumulate in int64,
wrapping (two's complement: the bits uint64 would hold); the bias bits(C) per fold is subtracted when the
levels are normalised, which happens every 2^(63−W) folds and before export: carries move up (balanced
digits, |digit| ≤ 2^(W−1)) into a carry level above the window. So the true sums never leave int64: no
overflow for any number of terms below 2^50. Terms must satisfy |x| < 2^MAX_EXPONENT, so that the total stays
finite; beyond it ``add`` raises. NaN and ±inf raise.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from mpifl.comm.exactsum import _backends
from mpifl.comm.exactsum._backends import FLOAT_BITS, Array, Ops, TorchOps, chunks, ops_for
from mpifl.comm.exactsum._grid import EMPTY, LOWEST, Grid, Window, carry, chunk_window, cut, window_of, wrapped
from mpifl.comm.exactsum._wire import ANY_TERMS, WIRE_WIDTH, Wire, round_block

if TYPE_CHECKING:
    import torch

WIDTH = 50  # bits per level of a rank's accumulator
FOLDS_PER_NORMALISATION = 2 ** (63 - WIDTH)
_BATCH_BYTES = 1 << 28  # ExactSum.add_rows: the float64 temporaries of at most this many bytes at a time


class ExactSum:
    """One rank's running exact total of weight·row terms over ``size`` entries (see the package's docstring)::

        total = ExactSum(numel)
        total.add(row, weight)  # each accepted client, as it finishes
        maxima = total.window.maxima()
        comm.Allreduce(MPI.IN_PLACE, maxima, op=MPI.MAX)
        agreed = Window.from_maxima(maxima)
        wire = total.export(agreed)
        summed = np.empty_like(wire) if rank == 0 else None
        comm.Reduce(wire, summed, op=MPI.SUM, root=0)
        result = round_sum(summed, agreed)  # rank 0: float64, the same bits on any ranks

    ``device`` says where the fold runs, with the same bits everywhere: ``None`` follows the first row (torch on
    a tensor's GPU; numpy for numpy arrays and CPU tensors, the faster fold on CPU), ``"numpy"`` numpy on the host,
    a torch device (``"cpu"``, ``"cuda:0"``) torch ops there. Rows elsewhere are copied to it; ``export`` returns
    host numpy words whichever it is (one copy per total).
    """

    def __init__(self, size: int, device: str | torch.device | None = None):
        self.size = size
        self.device = device
        self.window = EMPTY  # the union of the folded terms' windows
        self._grid: Grid | None = None
        self._ops: Ops | None = None  # chosen by the first row unless ``device`` names it
        self._levels: Array = None  # (levels + 1) × size int64, with the grid
        self._folds = 0  # adds since the levels were last normalised (each left one bias in every level)
        self.terms = 0  # rows folded (with a nonzero weight)
        self._failed = False
        self._x: Array = None
        self._scratch: Array = None
        self._bits: dict[np.dtype, Array] = {}  # scratch for the window scan, per row kind

    @property
    def nbytes(self) -> int:
        return 0 if self._levels is None or self._ops is None else self._ops.nbytes(self._levels)

    @property
    def round_device(self) -> torch.device | None:
        """Where sums of this total's wire are best rounded: the GPU it folds on (``round_sum`` there reads nothing
        back), else ``None``, numpy on the host (the faster on a CPU)."""
        ops = self._ops
        return ops.device if isinstance(ops, TorchOps) and ops.device.type != "cpu" else None

    @property
    def backend(self) -> str | None:
        """Where the fold runs ("numpy", "torch-cpu", "torch-cuda"); ``None`` until a row chose it."""
        return None if self._ops is None else self._ops.name

    def add(self, row: Array, weight: float = 1.0) -> None:
        """Fold weight·row (each product rounded to float64 once) into the total. A row that raises part-way
        (NaN, ±inf, out of range) leaves the total unusable: screen rows first."""
        self._check_usable()
        row, kind = self._checked(row)
        weight = _finite(weight)
        if weight == 0.0:
            return
        ops = self._ops_or_raise
        if kind not in self._bits:
            self._bits[kind] = ops.empty(len(self._x), FLOAT_BITS[kind][0])
        bits = self._bits[kind]
        spans = self._spans()
        if self._grid is None:
            window = EMPTY
            for start, stop in spans:
                window = window.union(chunk_window(ops, row[start:stop], kind, weight, bits))
            if window.empty:
                return
            self._start_grid(window)
        self._failed = True  # until the whole row is in
        for start, stop in spans:
            chunk = row[start:stop]
            self._cover(chunk_window(ops, chunk, kind, weight, bits), start)
            x = self._x[: stop - start]
            ops.weighted(chunk, weight, out=x)
            grid = self._grid_or_raise
            cut(ops, x, self._scratch[: stop - start], self._levels[:, start:stop], grid.constants, grid.levels - 1)
        self._folded(1)

    def add_rows(self, rows: Array, weights: Sequence[float]) -> None:
        """Fold every ``weights[i]``·``rows[i]`` (rows × size), the same bits as :meth:`add` of each in turn (the
        sum is exact). With rows on a torch device, the windows of all rows are read from it at once and each
        level adds all rows' digits in one pass: one wait for the device for the batch, not a few per row, and a bad
        row raises before any is folded. Host rows fold one by one, as :meth:`add` (nothing to wait for)."""
        self._check_usable()
        weights = [float(w) for w in weights]
        if len(weights) != len(rows):
            raise ValueError(f"exact sum: {len(rows)} rows but {len(weights)} weights")
        if self._ops is None and len(rows):
            self._checked(rows[0])  # chooses the backend (by the rows' device unless named)
        if not isinstance(self._ops, TorchOps):
            if self._ops is not None and _backends.is_tensor(rows):  # a CPU tensor's rows: its memory, shared
                rows = self._ops.row(rows)  # once, not a read a row
            for row, weight in zip(rows, weights):
                self.add(row, weight)
            return
        rows, weights, windows = self._device_terms(self._ops, rows, weights)
        if self._grid is None:  # as add: rows before the first non-empty one are no terms
            first = next((i for i, window in enumerate(windows) if not window.empty), len(windows))
            rows, weights, windows = rows[first:], weights[first:], windows[first:]
            if not windows:
                return
            self._start_grid(windows[0])
        self._cover(functools.reduce(Window.union, windows, EMPTY), 0)
        self._fold_blocks(self._ops, rows, weights)

    def _device_terms(self, ops: TorchOps, rows: Array, weights: list[float]
                      ) -> tuple[Array, list[float], list[Window]]:
        """The rows of nonzero weight on the device, their weights, and their windows, read from the device at once
        for all: every weight and row is checked before any is folded."""
        for weight in weights:
            _finite(weight)
        keep = [i for i, weight in enumerate(weights) if weight != 0.0]
        rows = ops.row(rows)
        if len(keep) < len(rows):  # the index uploaded as rows are (indexing with a list would copy it pageable)
            rows = rows.index_select(0, ops.upload(np.array(keep, dtype=np.int64)))
        kind = ops.kind(rows)
        if tuple(rows.shape) != (len(keep), self.size) or kind not in FLOAT_BITS:
            raise ValueError(f"exact sum: rows of shape {tuple(rows.shape)} and type {rows.dtype} do not fit a "
                             f"total of {self.size} float entries")
        weights = [weights[i] for i in keep]
        tops, lows = ops.row_extrema(rows, kind) if len(keep) else (np.empty(0), np.empty(0))
        return rows, weights, [window_of(int(t), int(low), kind, w) for t, low, w in zip(tops, lows, weights)]

    def _fold_blocks(self, ops: TorchOps, rows: Array, weights: list[float]) -> None:
        """Fold the device's rows a block at a time, each level adding a block's digits in one pass: blocks of at
        most ``_BATCH_BYTES`` of float64 temporaries, none past a normalisation."""
        step = max(1, min(FOLDS_PER_NORMALISATION, _BATCH_BYTES // (16 * self.size)))
        factors_all = ops.upload(np.array(weights, dtype=np.float64))  # one upload for every block, no wait
        start = 0
        while start < len(weights):
            count = min(step, len(weights) - start, FOLDS_PER_NORMALISATION - self._folds)
            block = rows[start : start + count]
            factors = factors_all[start : start + count]
            self._failed = True
            x = block.to(ops.torch.float64) * factors[:, None]  # fl64(weight·row), as add's ``weighted``
            grid = self._grid_or_raise
            cut(ops, x, ops.torch.empty_like(x), self._levels, grid.constants, grid.levels - 1)
            self._folded(count)
            start += count

    def _check_usable(self) -> None:
        if self._failed:
            raise RuntimeError("exact sum: an earlier add failed part-way, so this total is incomplete")

    def _start_grid(self, window: Window) -> None:
        """The first levels: the fewest that cover the first term's ``window``."""
        self._grid = Grid.fitting(window, WIDTH)
        self._levels = self._ops_or_raise.zeros(self._grid.levels + 1, self.size)

    def _cover(self, window: Window, done: int) -> None:
        """Take terms of ``window`` in: the levels widened where they do not reach it (``done`` entries of the current
        row are in already)."""
        if not self.window.covers(window):
            if not self._grid_or_raise.window.covers(window):
                self._widen(window, done)
            self.window = self.window.union(window)

    def _folded(self, count: int) -> None:
        """``count`` more terms are in: each left one bias in every level, which a normalisation removes in time."""
        self._folds += count
        self.terms += count
        self._failed = False
        if self._folds >= FOLDS_PER_NORMALISATION:
            self._normalise()

    def _checked(self, row: Array) -> tuple[Array, np.dtype]:
        """``row`` on the backend (chosen now if not yet), float16 widened, and its kind; shape and kind checked."""
        if self._ops is None:
            self._ops = ops_for(self.device, row)
            span = min(self._ops.span(self.size), self.size)
            self._x = self._ops.empty(span, np.dtype(np.float64))
            self._scratch = self._ops.empty(span, np.dtype(np.float64))
        row = self._ops.row(row)
        if tuple(row.shape) != (self.size,):
            raise ValueError(f"exact sum: a row of shape {tuple(row.shape)} does not match the total's {(self.size,)}")
        kind = self._ops.kind(row)
        if kind is None or kind not in FLOAT_BITS:
            raise TypeError(f"exact sum: rows must be float16, float32 or float64, not {row.dtype}")
        return row, kind

    def _spans(self) -> list[tuple[int, int]]:
        """The entries folded at a time: ``CHUNK`` on CPU (whole blocks of the wire), the whole row on a GPU."""
        return chunks(self.size, self._ops_or_raise.span(self.size))

    @property
    def _ops_or_raise(self) -> Ops:
        if self._ops is None:
            raise RuntimeError("exact sum: no row chose a backend yet")
        return self._ops

    @property
    def _grid_or_raise(self) -> Grid:
        if self._grid is None:
            raise RuntimeError("exact sum: nothing folded yet")
        return self._grid

    def _widen(self, window: Window, done: int) -> None:
        """Add levels below or above so the grid covers ``window``; ``done`` entries of the current row are in
        already. A new level is given the biases of the adds it missed, so that every level of every entry
        carries one bias per add. Below float64's smallest unit the levels are re-cut instead."""
        grid = self._grid_or_raise
        below = max(0, -(-(grid.base - window.lowest) // grid.width))
        above = max(0, -(-(window.highest - grid.window.highest) // grid.width))
        if grid.base - below * grid.width < LOWEST:
            self._bias_done(done, -1)  # the re-cut takes whole adds only: the current row's part comes out...
            self._regrid(Grid.fitting(Window(LOWEST, max(window.highest, grid.window.highest)), grid.width, False))
            self._bias_done(done, 1)  # ...and its bias goes back in on the new levels
            return
        wider = Grid(grid.base - below * grid.width, grid.levels + below + above, grid.width)
        levels = self._ops_or_raise.zeros(wider.levels + 1, self.size)
        levels[below : below + grid.levels + 1] = self._levels
        biases = wider.biases
        for k in [*range(below), *range(below + grid.levels, wider.levels)]:  # new levels, and the old carry
            levels[k] += wrapped(self._folds * biases[k])
            levels[k, :done] += wrapped(biases[k])
        self._grid, self._levels = wider, levels

    def _bias_done(self, done: int, sign: int) -> None:
        """Add (or take out) one bias in every data level of the first ``done`` entries."""
        grid = self._grid_or_raise
        for k, bias in enumerate(grid.biases[: grid.levels]):
            self._levels[k, :done] += wrapped(sign * bias)

    def _unbiased_chunk(self, start: int, stop: int) -> Array:
        """The levels of entries [start, stop) as int64 digits, biases removed."""
        grid = self._grid_or_raise
        digits = self._levels[:, start:stop]
        for k, bias in enumerate(grid.biases[: grid.levels]):
            digits[k] -= wrapped(self._folds * bias)
        return digits

    def _normalise(self) -> None:
        """Remove the biases and carry every level down to a balanced digit, the excess into the carry level."""
        if self._grid is None:
            return
        for start, stop in self._spans():
            carry(self._unbiased_chunk(start, stop), self._grid.width, balanced=True)
        self._folds = 0

    def _recut(self, start: int, stop: int, grid: Grid, out: Array) -> None:
        """Entries [start, stop) re-cut onto ``grid`` into ``out`` (int64, levels × entries): balanced digits.
        Each normalised level is an exact float64 (|digit| ≤ 2^(W−1), the carry's below 2^53), a multiple of
        its unit (or of the window's lowest bit, at level 0), cut into the levels of ``grid`` it can reach."""
        source, ops = self._grid_or_raise, self._ops_or_raise
        out[:] = 0
        cuts = [0] * (grid.levels + 1)  # cuts that added a bias to each level of ``grid``
        x, scratch = self._x[: stop - start], self._scratch[: stop - start]
        for k, digits in enumerate(self._levels[:, start:stop]):
            if not ops.any(digits):
                continue
            bottom = min(max(0, (source.unit(k) - grid.base) // grid.width), grid.levels)
            reach = -(-(source.unit(k) + source.width - 52 - grid.base) // grid.width)  # unit + 51 ≥ |x|'s bits
            top = grid.levels if k == source.levels else min(max(bottom, reach), grid.levels)
            ops.ldexp(digits, source.unit(k), out=x)
            cut(ops, x, scratch, out[bottom : top + 1], grid.constants[bottom : top + 1], top - bottom)
            for level in range(bottom, top + 1):
                cuts[level] += 1
        for k, bias in enumerate(grid.biases):
            out[k] -= wrapped(cuts[k] * bias)
        carry(out, grid.width, balanced=True)

    def _regrid(self, grid: Grid) -> None:
        self._normalise()
        levels = self._ops_or_raise.zeros(grid.levels + 1, self.size)
        for start, stop in self._spans():
            self._recut(start, stop, grid, levels[:, start:stop])
        self._grid, self._levels = grid, levels

    def export(self, window: Window, terms: int = ANY_TERMS) -> np.ndarray:
        """The total as a flat host int64 buffer on the grid of ``window`` (the union of every rank's window), for
        an MPI.SUM reduction; ``round_sum`` turns the sum into float64. ``terms``: at most how many rows every total
        of the reduction holds together (the ranks agree on it); with fewer than ``FEW_TERMS`` the top word takes
        the carries and the carry word is left out. Each block of ``CHUNK`` entries holds its ``words(window,
        terms)`` words per entry together, so the buffer may be split at any multiple of ``CHUNK * words`` (a
        reduce-scatter over entries). The total stays as it was: folding may go on."""
        if not window.covers(self.window):
            raise ValueError(f"exact sum: the agreed window {window} does not cover this rank's {self.window}")
        if self.terms > terms:
            raise ValueError(f"exact sum: this total holds {self.terms} terms, more than the {terms} agreed")
        wire = Wire.of(window, terms)
        if self._grid is None:
            return np.zeros(self.size * wire.words, dtype=np.int64)
        ops = self._ops_or_raise
        out = ops.zeros(self.size * wire.words)
        self._normalise()
        recut = None
        for start, stop in self._spans():
            if stop - start <= _backends.CHUNK and wire.carried:  # one block of the wire as the re-cut leaves it
                self._recut(start, stop, wire.grid, wire.block(out, start, stop))
                continue
            if recut is None:
                recut = ops.zeros(wire.grid.levels + 1, stop - start)
            cut = recut[:, : stop - start]
            self._recut(start, stop, wire.grid, cut)
            if not wire.carried:  # few terms: the carry joins the top word, exactly (|top| < FEW_TERMS·2^(W−1))
                cut[-2] += cut[-1] * 2**WIRE_WIDTH
            for first, last in chunks(stop - start):  # laid out in blocks of CHUNK entries
                wire.block(out, start + first, start + last)[...] = cut[: wire.words, first:last]
        return ops.host(out)

    def rounded(self) -> np.ndarray:
        """This total alone rounded to float64 (host numpy): ``round_sum(export(window), window)``'s bits without
        the re-cut onto the wire's grid, for a job whose sum never leaves the rank (one rank). The accumulator's
        normalised levels are balanced digits of ``WIDTH`` bits, which ``round_block`` rounds as it does the
        wire's ``WIRE_WIDTH``-bit words."""
        if self._grid is None:
            return np.zeros(self.size)
        self._normalise()
        ops = self._ops_or_raise
        out = ops.empty(self.size, np.dtype(np.float64))
        for start, stop in chunks(self.size, ops.round_span(self.size)):  # on a GPU, all at once
            out[start:stop] = round_block(ops, self._levels[:, start:stop], self._grid)
        return ops.host(out)  # one copy from a GPU, of the float64 sums


def _finite(weight: float) -> float:
    """``weight`` as a float, checked to be finite."""
    weight = float(weight)
    if not math.isfinite(weight):
        raise ValueError(f"exact sum: weight {weight} is not finite")
    return weight


def exact_sum(rows: Array, weights: Array | None = None, device: str | torch.device | None = None) -> np.ndarray:
    """Σᵢ weights[i]·rows[i], exact and rounded once, in one process: what the reduction gives on any ranks."""
    total = ExactSum(rows.shape[1], device)
    for i, row in enumerate(rows):
        total.add(row, 1.0 if weights is None else weights[i])
    return total.rounded()
