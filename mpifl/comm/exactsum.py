"""Exact, order-independent sums Σᵢ wᵢ·rowᵢ: the same bits however the terms are ordered and grouped over ranks.

Each term x = RN(w·rowⱼ) is a float64. Every x is cut at fixed bit positions ("levels", W bits apart) into
integers, and integers add associatively; the total is rounded to float64 once, at the end, so the result is
the correctly rounded (to nearest, ties to even) exact sum Σx, whatever the order and grouping.

Cutting. A level k has unit 2^bₖ (bₖ = base + k·W) and C = 1.5·2^(bₖ+52). For |r| ≤ 2^(bₖ+51), t = fl(r + C) lies
in C's binade, where floats are spaced 2^bₖ, so t = C + q with q = r rounded to a multiple of 2^bₖ, and the
float's bits are bits(C) + q/2^bₖ: the level's integer is read off t's bits (the round-by-adding-a-constant
trick, read as an integer). r − q is exact and |r − q| ≤ 2^(bₖ−1), which the next level down cuts the same
way; the lowest level takes the remainder whole, exact because the window below puts base at or under every
term's lowest set bit.
The two lowest levels share one step: fl((C₀ + C₁) − t₁) = C₀ − q₁ exactly (both multiples of 2^(b₀+W), ≤ 53
bits), so t₀ = fl(r + (C₀ − q₁)). A fold costs 4 numpy passes per level above the lowest two, 5 for those two,
one for the product and a scan of the row's bits; chunks of ``CHUNK`` entries keep it all in cache
(benchmarks/bench_exactsum.py: about 3-4x ``acc += w*row`` for two levels).

Window. A term's bits lie in [lowest, highest): |x| < 2^highest, and x is a multiple of 2^lowest (its ulp).
Each chunk of a row is scanned (max and smallest nonzero |row|, through the float's bits) before it is folded;
by monotonicity of rounding, |x| ≤ fl(|w|·max) and ulp(x) ≥ ulp(fl(|w|·min)). The levels cover the window;
a row outside it adds levels below or above (the grid keeps its positions, so nothing is re-cut).

Bounds. Each term adds at most 2^(W−1) to a level (|x| ≤ 2^(b_top+W−1)). Levels accumulate in uint64, wrapping;
the bias bits(C) per fold is subtracted when the levels are normalised, which happens every 2^(63−W) folds
and before export: carries move up (balanced digits, |digit| ≤ 2^(W−1)) into a carry level above the window.
So the true sums never leave int64: no overflow for any number of terms below 2^50. Terms must satisfy
|x| < 2^MAX_EXPONENT, so that the total stays finite; beyond it ``add`` raises. NaN and ±inf raise.

Reduction. All ranks agree on one window (an allreduce of ``Window.maxima()`` with MPI.MAX), re-cut their
levels onto that window's grid of 48-bit int64 words (``export``: a flat buffer, chunk by chunk, so a
reduce-scatter over whole chunks works as well as a reduce), and MPI.SUM adds them: balanced digits of at most
2^47 each leave room for ``MAX_RANKS`` ranks. ``round_sum`` carries the sum to balanced digits: exact floats that do
not overlap, each larger than all below it together. Added from the top they stay exact until one addition
rounds; that result is the correctly rounded total unless its error is exactly half an ulp and the digits
left have the error's sign, then it moves one ulp (the end of CPython's ``math.fsum``). Zero is +0.0.

Memory: the accumulator holds levels + 1 (the carry) uint64 per entry, the wire buffer ``words`` int64. The
float32 deltas of B1's MLP after local SGD, weighted 1/50, span about 75 bits: 2 levels of W = 50 (24 B per
entry) and 3 wire words (24 B); deltas log-uniform over 1e-10..1e1 span about 105 bits: 3 levels (32 B).
The worst case, a float64 subnormal term beside terms near 1, spans 1,074 bits: 22 levels (184 B per entry).
The float64 result differs from a sequential float64 sum in the last bits where that sum rounded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

WIDTH = 50  # bits per level of a rank's accumulator
WIRE_WIDTH = 48  # bits per word of the reduced buffer: 2^(64-48) - 1 ranks can add their words without overflow
MAX_RANKS = 2 ** (64 - WIRE_WIDTH) - 1
MAX_EXPONENT = 900  # every term must have |x| < 2**900 (so that 2**50 of them still sum to a finite float64)
LOWEST = -1074  # float64's smallest unit (a subnormal's ulp)
CHUNK = 1 << 16  # entries cut at a time: the temporaries stay in the CPU's cache
FOLDS_PER_NORMALISATION = 2 ** (63 - WIDTH)
_EMPTY_BOUND = 1 << 30

# row dtype -> (unsigned view, bits of |value|, bits of +inf)
_BITS = {np.dtype(np.float32): (np.uint32, 0x7FFF_FFFF, 0x7F80_0000),
         np.dtype(np.float64): (np.uint64, 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000)}


@dataclass(frozen=True)
class Window:
    """The bits a set of terms may set: each term is a multiple of 2^lowest with |x| < 2^highest."""

    lowest: int = _EMPTY_BOUND
    highest: int = -_EMPTY_BOUND

    @property
    def empty(self) -> bool:
        return self.lowest > self.highest

    def union(self, other: Window) -> Window:
        return Window(min(self.lowest, other.lowest), max(self.highest, other.highest))

    def covers(self, other: Window) -> bool:
        return other.empty or (self.lowest <= other.lowest and other.highest <= self.highest)

    def maxima(self) -> np.ndarray:
        """(−lowest, highest) as int64: an MPI.MAX allreduce of every rank's maxima gives the union."""
        return np.array([-self.lowest, self.highest], dtype=np.int64)

    @classmethod
    def from_maxima(cls, maxima: np.ndarray) -> Window:
        return cls(-int(maxima[0]), int(maxima[1]))


EMPTY = Window()


@dataclass(frozen=True)
class _Grid:
    """Levels base + k·width (k < levels) and a carry level above them."""

    base: int
    levels: int
    width: int

    @classmethod
    def fitting(cls, window: Window, width: int, slack_below: bool = True) -> _Grid:
        """The fewest levels covering ``window``; the spare bits go half below, half above (``slack_below``)
        or all above."""
        if window.empty:
            return cls(0, 1, width)
        span = window.highest - window.lowest + 1  # +1: a term's top level holds |x| ≤ 2^(unit + width − 1)
        levels = -(-span // width)
        below = (levels * width - span + 1) // 2 if slack_below else 0
        return cls(max(window.lowest - below, LOWEST), levels, width)

    def unit(self, level: int) -> int:
        return self.base + level * self.width

    @cached_property
    def window(self) -> Window:
        """The terms these levels can take."""
        return Window(self.base, self.unit(self.levels) - 1)

    @cached_property
    def constants(self) -> list[float]:
        """C of every level, the carry level's last."""
        return [math.ldexp(1.5, self.unit(k) + 52) for k in range(self.levels + 1)]

    @cached_property
    def biases(self) -> list[int]:
        """bits(C) of every level: what one cut adds to a level besides its digit."""
        return [int(np.float64(c).view(np.uint64)) for c in self.constants]


def _cut(x: np.ndarray, scratch: np.ndarray, levels: np.ndarray, constants: list[float], top: int) -> None:
    """Add the digits of the float64 terms ``x`` (|x| ≤ 2^(unit(top) + 51), multiples of 2^unit(0)) to
    ``levels[0..top]`` (uint64, biased by bits(C) per call); ``x`` is overwritten."""
    view = scratch.view(np.uint64)
    for k in range(top, 1, -1):
        np.add(x, constants[k], out=scratch)
        np.add(levels[k], view, out=levels[k])
        np.subtract(scratch, constants[k], out=scratch)
        np.subtract(x, scratch, out=x)
    if top == 0:
        np.add(x, constants[0], out=scratch)
    else:
        np.add(x, constants[1], out=scratch)
        np.add(levels[1], view, out=levels[1])
        np.subtract(constants[0] + constants[1], scratch, out=scratch)
        np.add(x, scratch, out=scratch)
    np.add(levels[0], view, out=levels[0])


def _carry(digits: np.ndarray, width: int, balanced: bool) -> None:
    """Move every level's excess over ``width`` bits up (int64 levels, the last takes what is left): balanced
    digits lie in [−2^(width−1), 2^(width−1)), the others in [0, 2^width)."""
    half = 1 << (width - 1) if balanced else 0
    for k in range(len(digits) - 1):
        carry = (digits[k] + half) >> width
        digits[k] -= carry << width
        digits[k + 1] += carry


def _chunk_window(row: np.ndarray, weight: float, bits: np.ndarray) -> Window:
    """The window of fl(weight·row) for one chunk (``bits``: scratch of the row's unsigned type)."""
    unsigned, magnitude, infinity = _BITS[row.dtype]
    bits = bits[: len(row)]
    np.bitwise_and(row.view(unsigned), unsigned(magnitude), out=bits)
    top = int(np.maximum.reduce(bits))
    if top >= infinity:
        raise ValueError("exact sum: the row holds NaN or ±inf; non-finite values must be screened out first")
    if top == 0:
        return EMPTY
    np.subtract(bits, unsigned(1), out=bits)  # zeros wrap round to the largest value
    low = int(np.minimum.reduce(bits)) + 1
    largest = abs(weight) * float(unsigned(top).view(row.dtype))
    if largest >= math.ldexp(1.0, MAX_EXPONENT):
        raise ValueError(f"exact sum: a term weight·row of {largest:.3g} is out of range (|term| < 2**{MAX_EXPONENT})")
    if largest == 0.0:
        return EMPTY
    smallest = abs(weight) * float(unsigned(low).view(row.dtype))
    lowest = LOWEST if smallest == 0.0 else max(math.frexp(smallest)[1] - 53, LOWEST)
    return Window(lowest, math.frexp(largest)[1])


def _chunks(size: int) -> list[tuple[int, int]]:
    return [(start, min(start + CHUNK, size)) for start in range(0, size, CHUNK)]


class ExactSum:
    """One rank's running exact total of weight·row terms over ``size`` entries (see the module docstring)::

        total = ExactSum(numel)
        total.add(row, weight)  # each accepted client, as it finishes
        maxima = total.window.maxima()
        comm.Allreduce(MPI.IN_PLACE, maxima, op=MPI.MAX)
        agreed = Window.from_maxima(maxima)
        wire = total.export(agreed)
        summed = np.empty_like(wire) if rank == 0 else None
        comm.Reduce(wire, summed, op=MPI.SUM, root=0)
        result = round_sum(summed, agreed)  # rank 0: float64, the same bits on any ranks
    """

    def __init__(self, size: int):
        self.size = size
        self.window = EMPTY  # the union of the folded terms' windows
        self._grid: _Grid | None = None
        self._levels = np.zeros((0, size), dtype=np.uint64)
        self._folds = 0  # adds since the levels were last normalised (each left one bias in every level)
        self._failed = False
        chunk = min(CHUNK, size)
        self._x = np.empty(chunk)
        self._scratch = np.empty(chunk)

    @property
    def nbytes(self) -> int:
        return self._levels.nbytes

    def add(self, row: np.ndarray, weight: float = 1.0) -> None:
        """Fold weight·row (each product rounded to float64 once) into the total. A row that raises part-way
        (NaN, ±inf, out of range) leaves the total unusable: screen rows first."""
        if self._failed:
            raise RuntimeError("exact sum: an earlier add failed part-way, so this total is incomplete")
        row = self._checked(row)
        weight = float(weight)
        if not math.isfinite(weight):
            raise ValueError(f"exact sum: weight {weight} is not finite")
        if weight == 0.0:
            return
        bits = np.empty(len(self._x), dtype=_BITS[row.dtype][0])
        if self._grid is None:
            window = EMPTY
            for start, stop in _chunks(self.size):
                window = window.union(_chunk_window(row[start:stop], weight, bits))
            if window.empty:
                return
            self._grid = _Grid.fitting(window, WIDTH)
            self._levels = np.zeros((self._grid.levels + 1, self.size), dtype=np.uint64)
        self._failed = True  # until the whole row is in
        for start, stop in _chunks(self.size):
            chunk = row[start:stop]
            window = _chunk_window(chunk, weight, bits)
            if not self.window.covers(window):
                if not self._grid.window.covers(window):
                    self._widen(window, start)
                self.window = self.window.union(window)
            x = self._x[: len(chunk)]
            np.multiply(chunk, weight, out=x, dtype=np.float64)
            _cut(x, self._scratch[: len(chunk)], self._levels[:, start:stop],
                 self._grid.constants, self._grid.levels - 1)
        self._folds += 1
        self._failed = False
        if self._folds >= FOLDS_PER_NORMALISATION:
            self._normalise()

    def _checked(self, row: np.ndarray) -> np.ndarray:
        row = np.ascontiguousarray(row)
        if row.shape != (self.size,):
            raise ValueError(f"exact sum: a row of shape {row.shape} does not match the total's {(self.size,)}")
        if row.dtype == np.float16:
            row = row.astype(np.float32)
        if row.dtype not in _BITS:
            raise TypeError(f"exact sum: rows must be float16, float32 or float64, not {row.dtype}")
        return row

    @property
    def _grid_or_raise(self) -> _Grid:
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
            self._regrid(_Grid.fitting(Window(LOWEST, max(window.highest, grid.window.highest)), grid.width, False))
            self._bias_done(done, 1)  # ...and its bias goes back in on the new levels
            return
        wider = _Grid(grid.base - below * grid.width, grid.levels + below + above, grid.width)
        levels = np.zeros((wider.levels + 1, self.size), dtype=np.uint64)
        levels[below : below + grid.levels + 1] = self._levels
        biases = wider.biases
        for k in [*range(below), *range(below + grid.levels, wider.levels)]:  # new levels, and the old carry
            levels[k] += np.uint64(self._folds * biases[k] % 2**64)
            levels[k, :done] += np.uint64(biases[k])
        self._grid, self._levels = wider, levels

    def _bias_done(self, done: int, sign: int) -> None:
        """Add (or take out) one bias in every data level of the first ``done`` entries."""
        grid = self._grid_or_raise
        biases = np.array([sign * bias % 2**64 for bias in grid.biases[: grid.levels]], dtype=np.uint64)
        self._levels[: grid.levels, :done] += biases[:, None]

    def _unbiased_chunk(self, start: int, stop: int) -> np.ndarray:
        """The levels of entries [start, stop) as int64 digits, biases removed."""
        grid = self._grid_or_raise
        digits = self._levels[:, start:stop].view(np.int64)
        for k, bias in enumerate(grid.biases[: grid.levels]):
            digits[k] -= np.int64(np.uint64(self._folds * bias % 2**64).view(np.int64))
        return digits

    def _normalise(self) -> None:
        """Remove the biases and carry every level down to a balanced digit, the excess into the carry level."""
        if self._grid is None:
            return
        for start, stop in _chunks(self.size):
            _carry(self._unbiased_chunk(start, stop), self._grid.width, balanced=True)
        self._folds = 0

    def _recut(self, start: int, stop: int, grid: _Grid, out: np.ndarray) -> None:
        """Entries [start, stop) re-cut onto ``grid`` into ``out`` (int64, levels × entries): balanced digits.
        Each normalised level is an exact float64 (|digit| ≤ 2^(W−1), the carry's below 2^53), a multiple of
        its unit (or of the window's lowest bit, at level 0), cut into the levels of ``grid`` it can reach."""
        source = self._grid_or_raise
        out[:] = 0
        cuts = np.zeros(grid.levels + 1, dtype=np.int64)  # cuts that added a bias to each level of ``grid``
        x, scratch = self._x[: stop - start], self._scratch[: stop - start]
        for k, digits in enumerate(self._levels[:, start:stop].view(np.int64)):
            if not digits.any():
                continue
            bottom = min(max(0, (source.unit(k) - grid.base) // grid.width), grid.levels)
            reach = -(-(source.unit(k) + source.width - 52 - grid.base) // grid.width)  # unit + 51 ≥ |x|'s bits
            top = grid.levels if k == source.levels else min(max(bottom, reach), grid.levels)
            np.ldexp(digits, np.int32(source.unit(k)), out=x, dtype=np.float64)  # int32: numpy's fast loop
            _cut(x, scratch, out[bottom : top + 1].view(np.uint64), grid.constants[bottom : top + 1], top - bottom)
            cuts[bottom : top + 1] += 1
        for k, bias in enumerate(grid.biases):
            out[k] -= np.int64(np.uint64(int(cuts[k]) * bias % 2**64).view(np.int64))
        _carry(out, grid.width, balanced=True)

    def _regrid(self, grid: _Grid) -> None:
        self._normalise()
        levels = np.empty((grid.levels + 1, self.size), dtype=np.int64)
        for start, stop in _chunks(self.size):
            self._recut(start, stop, grid, levels[:, start:stop])
        self._grid, self._levels = grid, levels.view(np.uint64)

    def export(self, window: Window) -> np.ndarray:
        """The total as a flat int64 buffer on the grid of ``window`` (the union of every rank's window), for an
        MPI.SUM reduction; ``round_sum`` turns the sum into float64. Each block of ``CHUNK`` entries holds its
        ``words(window)`` words per entry together, so the buffer may be split at any multiple of
        ``CHUNK * words(window)`` (a reduce-scatter over entries). The total stays as it was: folding may go on."""
        if not window.covers(self.window):
            raise ValueError(f"exact sum: the agreed window {window} does not cover this rank's {self.window}")
        grid = _wire_grid(window)
        wire = np.zeros(self.size * (grid.levels + 1), dtype=np.int64)
        if self._grid is not None:
            self._normalise()
            for start, stop in _chunks(self.size):
                self._recut(start, stop, grid, _block(wire, grid, start, stop))
        return wire


def _wire_grid(window: Window) -> _Grid:
    return _Grid.fitting(window, WIRE_WIDTH, slack_below=False)


def words(window: Window) -> int:
    """int64 words per entry in the wire buffer of ``window``."""
    return _wire_grid(window).levels + 1


def _block(wire: np.ndarray, grid: _Grid, start: int, stop: int) -> np.ndarray:
    """The words of entries [start, stop) (one chunk) of a wire buffer, levels × entries."""
    return wire[start * (grid.levels + 1) : stop * (grid.levels + 1)].reshape(grid.levels + 1, stop - start)


def round_sum(wire: np.ndarray, window: Window) -> np.ndarray:
    """The float64 nearest (ties to even) to each exact total held by ``wire``: the MPI.SUM of every rank's
    ``export(window)``, or a part of it that starts at a multiple of ``CHUNK * words(window)``."""
    grid = _wire_grid(window)
    if wire.ndim != 1 or len(wire) % (grid.levels + 1):
        raise ValueError(f"exact sum: a wire buffer of shape {wire.shape} does not hold {words(window)} words "
                         "per entry")
    entries = len(wire) // (grid.levels + 1)
    out = np.empty(entries)
    for start, stop in _chunks(entries):
        out[start:stop] = _round_block(_block(wire, grid, start, stop), grid)
    return out


def _round_block(wire: np.ndarray, grid: _Grid) -> np.ndarray:
    """``round_sum`` of one block (levels × entries). Balanced digits (|d| ≤ 2^(w−1), one spare level on top so
    that every digit is below 2^53) are exact floats that do not overlap, and each dominates the sum of those
    below it. They are added from the top, exactly, until an addition rounds (CPython's ``math.fsum`` ends the
    same way): that sum is the answer unless its rounding error is exactly half an ulp and the digits left
    over have the error's sign, which moves it one ulp further. Masks are 0/1 factors: no branches."""
    digits = np.zeros((len(wire) + 1, wire.shape[1]), dtype=np.int64)
    digits[:-1] = wire
    _carry(digits, grid.width, balanced=True)
    values = np.empty(digits.shape)
    for k, level in enumerate(digits):
        np.ldexp(level, np.int32(grid.unit(k)), out=values[k], dtype=np.float64)
    total = values[-1].copy()
    error, rest = np.zeros(len(total)), np.zeros(len(total))
    exact = np.ones(len(total))  # 1 while every addition so far was exact
    for value in values[-2::-1]:
        taken = value * exact
        rest += value - taken
        summed = total + taken
        error += taken - (summed - total)
        total = summed
        exact *= error == 0
    twice = error * 2
    step = (total + twice) - total
    same_sign = (np.signbit(error) == np.signbit(rest)) & (error != 0) & (rest != 0)
    return total + step * ((step == twice) & same_sign)


def exact_sum(rows: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Σᵢ weights[i]·rows[i], exact and rounded once, in one process: what the reduction gives on any ranks."""
    total = ExactSum(rows.shape[1])
    for i, row in enumerate(rows):
        total.add(row, 1.0 if weights is None else weights[i])
    return round_sum(total.export(total.window), total.window)
