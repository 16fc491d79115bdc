"""The wire: how the ranks' exact totals travel and how their sum is rounded. Its layout (``Wire``: the agreed window's
grid of ``WIRE_WIDTH``-bit int64 words, and whether the carries take a word of their own) is what ``ExactSum.export``
writes and ``round_sum`` reads, so the two change together.

Reduction. All ranks agree on one window (an allreduce of ``Window.maxima()`` with MPI.MAX), re-cut their
levels onto that window's grid of 48-bit int64 words (``export``: a flat buffer, chunk by chunk, so a
reduce-scatter over whole chunks works as well as a reduce), and MPI.SUM adds them: balanced digits of at most
2^47 each leave room for ``MAX_RANKS`` ranks. The carries of the top word travel in a word of their own, unless
the ranks agree that the sum has fewer than ``FEW_TERMS`` (2^15) terms in all: then the top word takes them
(|top| < 2^15·2^47 plus a rounding per rank), one word per entry less. ``round_sum`` carries the sum to balanced
digits: exact floats that do not overlap, each larger than all below it together. Added from the top they stay
exact until one addition rounds; that result is the correctly rounded total unless its error is exactly half an
ulp and the digits left have the error's sign, then it moves one ulp (the end of CPython's ``math.fsum``). Zero
is +0.0.
On the host ``round_sum`` looks at each block first and, where at most two words are nonzero and below 2^53 (a W2
round's), adds them in one correctly rounded addition: the same bits, at a quarter of the time
(benchmarks/bench_server_serial.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from mpifl.comm.exactsum import _backends
from mpifl.comm.exactsum._backends import Array, Ops, chunks, ops_for
from mpifl.comm.exactsum._grid import Grid, Window, carry

if TYPE_CHECKING:
    import torch

WIRE_WIDTH = 48  # bits per word of the reduced buffer: 2^(64-48) - 1 ranks can add their words without overflow
MAX_RANKS = 2 ** (64 - WIRE_WIDTH) - 1
ANY_TERMS = 2**50  # the most terms a sum may have (the carries of any fewer fit in int64)
FEW_TERMS = 2 ** (63 - WIRE_WIDTH)  # fewer terms than this in all: the wire's top word takes their carries


@dataclass(frozen=True)
class Wire:
    """The reduced buffer's layout for a window and a bound on the terms: the window's grid of ``WIRE_WIDTH``-bit
    words (the re-cut also uses its carry level) and how many words an entry takes."""

    grid: Grid
    words: int

    @classmethod
    def of(cls, window: Window, terms: int) -> Wire:
        grid = Grid.fitting(window, WIRE_WIDTH, slack_below=False)
        return cls(grid, grid.levels + (terms >= FEW_TERMS))

    @property
    def carried(self) -> bool:
        """Whether the carries travel in a word of their own (else in the top word)."""
        return self.words > self.grid.levels

    def block(self, wire: Array, start: int, stop: int) -> Array:
        """The words of entries [start, stop) (one chunk) of a wire buffer, words × entries."""
        return wire[start * self.words : stop * self.words].reshape(self.words, stop - start)


def words(window: Window, terms: int = ANY_TERMS) -> int:
    """int64 words per entry in the wire buffer of ``window`` for a sum of at most ``terms`` rows."""
    return Wire.of(window, terms).words


def round_sum(wire: Array, window: Window, terms: int = ANY_TERMS, device: str | torch.device | None = None
              ) -> Array:
    """The float64 nearest (ties to even) to each exact total held by ``wire``: the MPI.SUM of every rank's
    ``export(window, terms)``, or a part of it that starts at a multiple of ``CHUNK * words(window, terms)``.
    It rounds where ``device`` says (as ``ExactSum``'s; ``None``: where ``wire`` is, numpy for host arrays and CPU
    tensors) and returns the sums there: a numpy array, or a tensor on the device, the same bits on each."""
    ops = ops_for(device, wire)
    wire = ops.row(wire)
    layout = Wire.of(window, terms)
    if wire.ndim != 1 or len(wire) % layout.words:
        raise ValueError(f"exact sum: a wire buffer of shape {tuple(wire.shape)} does not hold {layout.words} words "
                         "per entry")
    entries = len(wire) // layout.words
    out = ops.empty(entries, np.dtype(np.float64))
    span, chunk = ops.round_span(entries), _backends.CHUNK
    whole = entries // chunk * chunk
    if span >= entries and whole:  # a GPU: every whole block of the wire at once (words × blocks × CHUNK)
        blocks = wire[: whole * layout.words].reshape(whole // chunk, layout.words, chunk).swapaxes(0, 1)
        out[:whole] = round_block(ops, blocks, layout.grid).reshape(-1)
        if whole < entries:
            out[whole:] = round_block(ops, layout.block(wire, whole, entries), layout.grid)
        return out
    for start, stop in chunks(entries):
        block = layout.block(wire, start, stop)
        for first, last in chunks(stop - start, span):
            out[start + first : start + last] = round_block(ops, block[:, first:last], layout.grid)
    return out


def round_block(ops: Ops, wire: Array, grid: Grid) -> Array:
    """``round_sum`` of one block (words × entries, or words × any shape; a top word that took the carries holds
    less than ``FEW_TERMS``·2^(w−1), so adding 2^(w−1) to it stays in int64), on ``ops``' backend. Balanced digits
    (|d| ≤ 2^(w−1), one spare level on top so that every digit is below 2^53) are exact floats that do not overlap,
    and each dominates the sum of those below it. They are added from the top, exactly, until an addition rounds
    (CPython's ``math.fsum`` ends the same way): that sum is the answer unless its rounding error is exactly half an
    ulp and the digits left over have the error's sign, which moves it one ulp further. Masks are 0/1 factors: no
    branches, nothing read back. Once an addition rounds, the error stays as it is (the later digits are taken
    times 0), so "every addition so far was exact" is "error == 0"; the first addition is exact before it."""
    shape = tuple(wire.shape[1:])
    if ops.reads_free and (few := _round_few(ops, wire, grid)) is not None:
        return few
    digits = ops.zeros(len(wire) + 1, *shape)
    digits[:-1] = wire
    carry(digits, grid.width, balanced=True)

    def value(k: int) -> Array:
        out = ops.empty(math.prod(shape), np.dtype(np.float64)).reshape(shape)
        ops.ldexp(digits[k], grid.unit(k), out=out)
        return out

    top = len(digits) - 1
    total, below = value(top), value(top - 1)
    summed = total + below
    error = below - (summed - total)
    total = summed
    rest = ops.zeros(*shape, dtype=np.float64)
    for k in range(top - 2, -1, -1):
        digit = value(k)
        taken = digit * (error == 0)
        rest += digit - taken
        summed = total + taken
        error += taken - (summed - total)
        total = summed
    twice = error * 2
    step = (total + twice) - total
    same_sign = ops.sign(error) * ops.sign(rest) > 0  # both nonzero, of one sign
    return total + step * ((step == twice) & same_sign)


def _round_few(ops: Ops, wire: Array, grid: Grid) -> Array | None:
    """A host block's sums in one addition where they need no more: at most two of its words are nonzero anywhere
    in it, and none is 2^53 or more (a W2 round's two words, three ranks' digits added). Such words are exact
    floats times their units, and one float addition is correctly rounded (ties to even, an exact zero +0.0): the
    bits of the general way, at a fifth of its passes (no carries, no masks). ``None`` where the block needs the
    general way. Reading the block's extremes is free on the host, not on a GPU, which never asks."""
    used = []
    for k, level in enumerate(wire):
        high, low = int(level.max()), int(level.min())
        if max(high, -low) >= 1 << 53:
            return None
        if high or low:
            used.append(k)
    if len(used) > 2:
        return None
    shape = tuple(wire.shape[1:])
    values = []
    for k in used:
        value = ops.empty(math.prod(shape), np.dtype(np.float64)).reshape(shape)
        ops.ldexp(wire[k], grid.unit(k), out=value)
        values.append(value)
    if not values:
        return ops.zeros(*shape, dtype=np.float64)
    return values[0] if len(values) == 1 else values[0] + values[1]
