"""Where a term's bits sit: the window of bits a set of terms may set, the grid of levels that covers it, and the
cut of float64 terms into the levels' integers, with the carries between them. Shared by the accumulator, which
cuts terms, and the wire, which re-cuts totals onto the ranks' agreed grid and rounds it.

Cutting. A level k has unit 2^bₖ (bₖ = base + k·W) and C = 1.5·2^(bₖ+52). For |r| ≤ 2^(bₖ+51), t = fl(r + C) lies
in C's binade, where floats are spaced 2^bₖ, so t = C + q with q = r rounded to a multiple of 2^bₖ, and the
float's bits are bits(C) + q/2^bₖ: the level's integer is read off t's bits (the round-by-adding-a-constant
trick, read as an integer). r − q is exact and |r − q| ≤ 2^(bₖ−1), which the next level down cuts the same
way; the lowest level takes the remainder whole, exact because the window below puts base at or under every
term's lowest set bit.
The two lowest levels share one step: fl(t₁ − (C₀ + C₁)) = q₁ − C₀ exactly (both multiples of 2^(b₀+W), ≤ 53
bits), so t₀ = fl(r − (q₁ − C₀)) = fl(r + (C₀ − q₁)) (rounding is symmetric). A fold costs 4 array passes per
level above the lowest two, 5 for those two, one for the product and a scan of the row's bits; chunks of
``CHUNK`` entries keep it all in cache (benchmarks/bench_exactsum.py: about 3-4x ``acc += w*row`` for two levels).

Window. A term's bits lie in [lowest, highest): |x| < 2^highest, and x is a multiple of 2^lowest (its ulp).
Each chunk of a row is scanned (max and smallest nonzero |row|, through the float's bits) before it is folded;
by monotonicity of rounding, |x| ≤ fl(|w|·max) and ulp(x) ≥ ulp(fl(|w|·min)). The levels cover the window;
a row outside it adds levels below or above (the grid keeps its positions, so nothing is re-cut).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from mpifl.comm.exactsum._backends import FLOAT_BITS, Array, Ops

MAX_EXPONENT = 900  # every term must have |x| < 2**900 (so that 2**50 of them still sum to a finite float64)
LOWEST = -1074  # float64's smallest unit (a subnormal's ulp)
_EMPTY_BOUND = 1 << 30


def wrapped(value: int) -> int:
    """``value`` modulo 2^64 as a signed int64: adding it to an int64 level adds ``value`` modulo 2^64, as the
    levels wrap (two's complement, the bits uint64 would hold)."""
    return (value + 2**63) % 2**64 - 2**63


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
class Grid:
    """Levels base + k·width (k < levels) and a carry level above them."""

    base: int
    levels: int
    width: int

    @classmethod
    def fitting(cls, window: Window, width: int, slack_below: bool = True) -> Grid:
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


def cut(ops: Ops, x: Array, scratch: Array, levels: Array, constants: list[float], top: int) -> None:
    """Add the digits of the float64 terms ``x`` (|x| ≤ 2^(unit(top) + 51), multiples of 2^unit(0)) to
    ``levels[0..top]`` (int64, wrapping, biased by bits(C) per call); ``x`` is overwritten."""
    view = ops.view(scratch, np.dtype(np.int64))
    for k in range(top, 1, -1):
        ops.add(x, constants[k], out=scratch)
        _accumulate(ops, levels[k], view)
        ops.subtract(scratch, constants[k], out=scratch)
        ops.subtract(x, scratch, out=x)
    if top == 0:
        ops.add(x, constants[0], out=scratch)
    else:
        ops.add(x, constants[1], out=scratch)
        _accumulate(ops, levels[1], view)
        ops.subtract(scratch, constants[0] + constants[1], out=scratch)  # q₁ − C₀, exactly
        ops.subtract(x, scratch, out=scratch)  # fl(r + (C₀ − q₁)): rounding is symmetric
    _accumulate(ops, levels[0], view)


def _accumulate(ops: Ops, level: Array, digits: Array) -> None:
    """Add one term's ``digits`` to ``level``, or with several terms (rows) their column sums: int64 adds wrap,
    so any grouping of the adds gives the same bits."""
    ops.add(level, digits if digits.ndim == 1 else digits.sum(0), out=level)


def carry(digits: Array, width: int, balanced: bool) -> None:
    """Move every level's excess over ``width`` bits up (int64 levels, the last takes what is left): balanced
    digits lie in [−2^(width−1), 2^(width−1)), the others in [0, 2^width)."""
    half = 1 << (width - 1) if balanced else 0
    for k in range(len(digits) - 1):
        carry = (digits[k] + half) >> width
        digits[k] -= carry << width
        digits[k + 1] += carry


def chunk_window(ops: Ops, row: Array, kind: np.dtype, weight: float, bits: Array) -> Window:
    """The window of fl(weight·row) for one chunk of ``kind`` (``bits``: scratch of its signed bits type)."""
    signed, magnitude, _ = FLOAT_BITS[kind]
    bits = bits[: len(row)]
    ops.bitwise_and(ops.view(row, signed), magnitude, out=bits)
    top = ops.max(bits)
    return window_of(top, ops.smallest_nonzero(bits, magnitude) if top else 0, kind, weight)


def window_of(top: int, low: int, kind: np.dtype, weight: float) -> Window:
    """The window of fl(weight·row) for a row of ``kind`` whose largest |entry| has the bits ``top`` and whose
    smallest nonzero one ``low``."""
    signed, _, infinity = FLOAT_BITS[kind]
    if top >= infinity:
        raise ValueError("exact sum: the row holds NaN or ±inf; non-finite values must be screened out first")
    if top == 0:
        return EMPTY
    largest = abs(weight) * float(signed.type(top).view(kind))
    if largest >= math.ldexp(1.0, MAX_EXPONENT):
        raise ValueError(f"exact sum: a term weight·row of {largest:.3g} is out of range (|term| < 2**{MAX_EXPONENT})")
    if largest == 0.0:
        return EMPTY
    smallest = abs(weight) * float(signed.type(low).view(kind))
    lowest = LOWEST if smallest == 0.0 else max(math.frexp(smallest)[1] - 53, LOWEST)
    return Window(lowest, math.frexp(largest)[1])
