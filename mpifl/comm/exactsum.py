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
The two lowest levels share one step: fl(t₁ − (C₀ + C₁)) = q₁ − C₀ exactly (both multiples of 2^(b₀+W), ≤ 53
bits), so t₀ = fl(r − (q₁ − C₀)) = fl(r + (C₀ − q₁)) (rounding is symmetric). A fold costs 4 array passes per
level above the lowest two, 5 for those two, one for the product and a scan of the row's bits; chunks of
``CHUNK`` entries keep it all in cache (benchmarks/bench_exactsum.py: about 3-4x ``acc += w*row`` for two levels).

Window. A term's bits lie in [lowest, highest): |x| < 2^highest, and x is a multiple of 2^lowest (its ulp).
Each chunk of a row is scanned (max and smallest nonzero |row|, through the float's bits) before it is folded;
by monotonicity of rounding, |x| ≤ fl(|w|·max) and ulp(x) ≥ ulp(fl(|w|·min)). The levels cover the window;
a row outside it adds levels below or above (the grid keeps its positions, so nothing is re-cut).

Bounds. Each term adds at most 2^(W−1) to a level (|x| ≤ 2^(b_top+W−1)). Levels accumulate in int64,
wrapping (two's complement: the bits uint64 would hold); the bias bits(C) per fold is subtracted when the
levels are normalised, which happens every 2^(63−W) folds and before export: carries move up (balanced
digits, |digit| ≤ 2^(W−1)) into a carry level above the window. So the true sums never leave int64: no
overflow for any number of terms below 2^50. Terms must satisfy |x| < 2^MAX_EXPONENT, so that the total stays
finite; beyond it ``add`` raises. NaN and ±inf raise.

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

Memory: the accumulator holds levels + 1 (the carry) int64 per entry, the wire buffer ``words`` int64. The
float32 deltas of B1's MLP after local SGD, weighted 1/50, span about 75 bits: 2 levels of W = 50 (24 B per
entry) and 3 wire words (24 B; 2 words, 16 B, with fewer than 2^15 terms); deltas log-uniform over 1e-10..1e1
span about 105 bits: 3 levels (32 B).
The worst case, a float64 subnormal term beside terms near 1, spans 1,074 bits: 22 levels (184 B per entry).
The float64 result differs from a sequential float64 sum in the last bits where that sum rounded.

Backends. The fold and ``export`` are written once over a few array operations (``_NumpyOps``, ``_TorchOps``:
add and subtract into a buffer, bit views, bitwise and, max and min, ldexp, zeros), so they run where the rows
are, with the same bits: numpy on the host, or torch on a tensor's device (CUDA: elementwise float64 and int64
kernels and reductions only, no atomics; one pass over a whole row, one copy of the wire to the host per
total). On CPU numpy is the faster fold (torch's int64 add is about 3x numpy's; benchmarks/bench_exactsum.py:
about 1.4x per fold), so host rows, CPU tensors included, fold with numpy unless a total names ``device="cpu"``.
``round_sum`` and ``rounded`` are written once over the same operations too, so a GPU rank can round a wire (or
its own total) on its device with nothing read back; on the host they look at each block first and, where at most
two words are nonzero and below 2^53 (a W2 round's), add them in one correctly rounded addition: the same bits,
at a quarter of the time (benchmarks/bench_server_serial.py). Host arrays reach a device from pinned memory without
a wait (``_TorchOps.upload``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

# An array of a total's backend: a numpy array, or a torch tensor on the total's device. The algorithm is written
# once against both (their shared operators and the few operations of ``_NumpyOps`` and ``_TorchOps``).
Array = Any

WIDTH = 50  # bits per level of a rank's accumulator
WIRE_WIDTH = 48  # bits per word of the reduced buffer: 2^(64-48) - 1 ranks can add their words without overflow
MAX_RANKS = 2 ** (64 - WIRE_WIDTH) - 1
MAX_EXPONENT = 900  # every term must have |x| < 2**900 (so that 2**50 of them still sum to a finite float64)
LOWEST = -1074  # float64's smallest unit (a subnormal's ulp)
CHUNK = 1 << 16  # entries cut at a time: the temporaries stay in the CPU's cache
ROUND_SPAN = 1 << 13  # entries rounded at a time on the CPU: 2.7x faster than CHUNK (the temporaries stay in L2)
_BATCH_BYTES = 1 << 28  # ExactSum.add_rows: the float64 temporaries of at most this many bytes at a time
FOLDS_PER_NORMALISATION = 2 ** (63 - WIDTH)
ANY_TERMS = 2**50  # the most terms a sum may have (the carries of any fewer fit in int64)
FEW_TERMS = 2 ** (63 - WIRE_WIDTH)  # fewer terms than this in all: the wire's top word takes their carries
_EMPTY_BOUND = 1 << 30

# row kind -> (signed view of its bits, bits of |value|, bits of +inf); |value|'s bits are never negative
_BITS: dict[np.dtype, tuple[np.dtype, int, int]] = {
    np.dtype(np.float32): (np.dtype(np.int32), 0x7FFF_FFFF, 0x7F80_0000),
    np.dtype(np.float64): (np.dtype(np.int64), 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000)}


def _wrapped(value: int) -> int:
    """``value`` modulo 2^64 as a signed int64: adding it to an int64 level adds ``value`` modulo 2^64, as the
    levels wrap (two's complement, the bits uint64 would hold)."""
    return (value + 2**63) % 2**64 - 2**63


def _is_tensor(row: object) -> bool:
    """Whether ``row`` is a torch tensor (without importing torch: a tensor exists only if torch is loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(row, torch.Tensor)


def host_copy(row: Array) -> np.ndarray:
    """A copy of ``row`` in host memory, whether a numpy array or a tensor on any device."""
    return row.detach().cpu().numpy().copy() if _is_tensor(row) else np.array(row)


class _NumpyOps:
    """The fold's array operations on host numpy arrays: single-threaded, ``CHUNK`` entries at a time so that the
    temporaries stay in cache. The faster fold on CPU (benchmarks/bench_exactsum.py), so CPU tensors use it too."""

    name = "numpy"
    reads_free = True  # reading a value back costs nothing: the rounding may look at a block before it works
    add = staticmethod(np.add)
    subtract = staticmethod(np.subtract)
    bitwise_and = staticmethod(np.bitwise_and)

    def span(self, size: int) -> int:
        """Entries folded at a time."""
        return CHUNK

    def round_span(self, size: int) -> int:
        """Entries rounded at a time: the rounding's dozen temporaries stay in the core's cache."""
        return ROUND_SPAN

    signbit = staticmethod(np.signbit)
    sign = staticmethod(np.sign)

    def upload(self, array: np.ndarray) -> Array:
        """A host array on the backend: itself."""
        return array

    def zeros(self, *shape: int, dtype: type = np.int64) -> Array:
        return np.zeros(shape, dtype=dtype)

    def empty(self, size: int, dtype: np.dtype) -> Array:
        return np.empty(size, dtype=dtype)

    def row(self, row: Any) -> Array:
        """``row`` as a contiguous host array, float16 widened (exactly) to float32. A CPU tensor is shared, not
        copied; a tensor on another device is copied to the host."""
        if _is_tensor(row):
            row = row.detach().cpu().numpy()
        row = np.ascontiguousarray(row)
        return row.astype(np.float32) if row.dtype == np.float16 else row

    def kind(self, row: Array) -> np.dtype:
        return row.dtype

    def view(self, array: Array, dtype: np.dtype) -> Array:
        return array.view(dtype)

    def weighted(self, row: Array, weight: float, out: Array) -> None:
        np.multiply(row, weight, out=out, dtype=np.float64)

    def max(self, array: Array) -> int:
        return int(np.maximum.reduce(array))

    def smallest_nonzero(self, bits: Array, magnitude: int) -> int:
        """The least positive entry of ``bits`` (some is positive, none negative); ``bits`` is overwritten."""
        unsigned = bits.view(np.dtype(f"u{bits.itemsize}"))
        np.subtract(unsigned, unsigned.dtype.type(1), out=unsigned)  # zeros wrap round to the largest value
        return int(np.minimum.reduce(unsigned)) + 1

    def ldexp(self, digits: Array, exponent: int, out: Array) -> None:
        np.ldexp(digits, np.int32(exponent), out=out, dtype=np.float64)  # int32: numpy's fast loop

    def any(self, array: Array) -> bool:
        return bool(array.any())

    def nbytes(self, array: Array) -> int:
        return array.nbytes

    def host(self, array: Array) -> np.ndarray:
        return array


class _TorchOps:
    """The same operations with torch on ``device``, elementwise (deterministic on CUDA: no atomics). torch lacks
    uint64, but int64 adds wrap with the same bits, so the levels are int64 on both backends. On CUDA a whole row
    is one span: the passes are bound by memory bandwidth, and each reduction there waits for the device."""

    def __init__(self, device: str | torch.device):
        import torch

        self.torch, self.device = torch, torch.device(device)
        self.name = f"torch-{self.device.type}"
        # never on the CPU either: a GPU's reads wait for the device, and the CPU runs (and the sync check sees)
        # the GPU's path
        self.reads_free = False
        self.dtypes = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64,
                       np.dtype(np.float64): torch.float64}
        self.kinds: dict[Any, np.dtype] = {torch.float32: np.dtype(np.float32), torch.float64: np.dtype(np.float64)}

    def span(self, size: int) -> int:
        return CHUNK if self.device.type == "cpu" else max(size, 1)

    def round_span(self, size: int) -> int:
        """As numpy's on the CPU; on a GPU every entry at once (a few kernels, no read back)."""
        return ROUND_SPAN if self.device.type == "cpu" else max(size, 1)

    def signbit(self, array: Array) -> Array:
        return self.torch.signbit(array)

    def sign(self, array: Array) -> Array:
        return self.torch.sign(array)

    def upload(self, array: np.ndarray) -> Array:
        """A host array on the device: shared on the CPU, else copied from pinned memory without waiting (a copy
        from pageable memory blocks the host until the device has run everything queued before it)."""
        tensor = self.torch.from_numpy(np.ascontiguousarray(array))
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def zeros(self, *shape: int, dtype: type = np.int64) -> Array:
        return self.torch.zeros(shape, dtype=self.dtypes[np.dtype(dtype)], device=self.device)

    def empty(self, size: int, dtype: np.dtype) -> Array:
        return self.torch.empty(size, dtype=self.dtypes[np.dtype(dtype)], device=self.device)

    def row(self, row: Any) -> Array:
        """``row`` as a contiguous tensor on the device, float16 and bfloat16 widened (exactly) to float32."""
        torch = self.torch
        if not _is_tensor(row):
            row = self.upload(row)
        elif row.device.type == "cpu" and self.device.type != "cpu":  # a host tensor: as a host array
            row = row.detach().pin_memory().to(self.device, non_blocking=True)
        else:
            row = row.detach().to(self.device)
        return (row.float() if row.dtype in (torch.float16, torch.bfloat16) else row).contiguous()

    def kind(self, row: Array) -> np.dtype | None:
        return self.kinds.get(row.dtype)

    def view(self, array: Array, dtype: np.dtype) -> Array:
        return array.view(self.dtypes[np.dtype(dtype)])

    def add(self, a: Array, b: Array | float, out: Array) -> None:
        self.torch.add(a, b, out=out)

    def subtract(self, a: Array, b: Array | float, out: Array) -> None:
        self.torch.sub(a, b, out=out)

    def bitwise_and(self, a: Array, b: int, out: Array) -> None:
        self.torch.bitwise_and(a, b, out=out)

    def weighted(self, row: Array, weight: float, out: Array) -> None:
        """fl64(weight·row): a float32 row is widened first (torch would multiply it in float32)."""
        if row.dtype == self.torch.float64:
            self.torch.mul(row, weight, out=out)
        else:
            out.copy_(row)
            out.mul_(weight)

    def max(self, array: Array) -> int:
        return int(array.max())

    def row_extrema(self, rows: Array, kind: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """Each row's largest |entry| and smallest nonzero |entry|, as the bits of ``kind`` (int64 host arrays;
        the second is meaningless for an all-zero row): one read from the device for all rows."""
        signed, magnitude, _ = _BITS[kind]
        bits = self.torch.bitwise_and(rows.view(self.dtypes[signed]), magnitude)
        top = bits.amax(1)
        low = self.torch.bitwise_and(bits - 1, magnitude).amin(1) + 1
        both = self.host(self.torch.stack([top, low]).long())
        return both[0], both[1]

    def smallest_nonzero(self, bits: Array, magnitude: int) -> int:
        """As numpy's, without unsigned types: zeros become −1 and then, masked, the largest magnitude."""
        self.torch.sub(bits, 1, out=bits)
        self.torch.bitwise_and(bits, magnitude, out=bits)
        return int(bits.min()) + 1

    def ldexp(self, digits: Array, exponent: int, out: Array) -> None:
        """np.ldexp's bits for int64 digits below 2^53: scaling by a power of two is exact unless the result is
        subnormal, and then one multiplication rounds it; below 2^−1022 the digits first go to 2^−1022's multiples
        (exactly: |d|·2^−1022 has no bit under float64's smallest unit), so that the scale is never zero."""
        out.copy_(digits)  # exact: |digit| < 2^53
        if exponent >= -1022:
            out.mul_(math.ldexp(1.0, exponent))
        else:
            out.mul_(math.ldexp(1.0, -1022)).mul_(math.ldexp(1.0, exponent + 1022))

    def any(self, array: Array) -> bool:
        return bool(array.any())

    def nbytes(self, array: Array) -> int:
        return array.numel() * array.element_size()

    def host(self, array: Array) -> np.ndarray:
        return array.detach().to("cpu").numpy()  # one copy, one read


Ops = _NumpyOps | _TorchOps


def _ops_for(device: str | torch.device | None, row: object) -> Ops:
    """The backend for ``device`` (see ``ExactSum``); with none, the one for ``row``'s device."""
    if device is None:
        on_device = _is_tensor(row) and row.device.type != "cpu"  # type: ignore[attr-defined]
        return _TorchOps(row.device) if on_device else _NumpyOps()  # type: ignore[attr-defined]
    return _NumpyOps() if device == "numpy" else _TorchOps(device)


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


def _cut(ops: Ops, x: Array, scratch: Array, levels: Array, constants: list[float], top: int) -> None:
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


def _carry(digits: Array, width: int, balanced: bool) -> None:
    """Move every level's excess over ``width`` bits up (int64 levels, the last takes what is left): balanced
    digits lie in [−2^(width−1), 2^(width−1)), the others in [0, 2^width)."""
    half = 1 << (width - 1) if balanced else 0
    for k in range(len(digits) - 1):
        carry = (digits[k] + half) >> width
        digits[k] -= carry << width
        digits[k + 1] += carry


def _chunk_window(ops: Ops, row: Array, kind: np.dtype, weight: float, bits: Array) -> Window:
    """The window of fl(weight·row) for one chunk of ``kind`` (``bits``: scratch of its signed bits type)."""
    signed, magnitude, _ = _BITS[kind]
    bits = bits[: len(row)]
    ops.bitwise_and(ops.view(row, signed), magnitude, out=bits)
    top = ops.max(bits)
    return _window_of(top, ops.smallest_nonzero(bits, magnitude) if top else 0, kind, weight)


def _window_of(top: int, low: int, kind: np.dtype, weight: float) -> Window:
    """The window of fl(weight·row) for a row of ``kind`` whose largest |entry| has the bits ``top`` and whose
    smallest nonzero one ``low``."""
    signed, _, infinity = _BITS[kind]
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


def _chunks(size: int, step: int | None = None) -> list[tuple[int, int]]:
    """[start, stop) of each ``step`` entries (``CHUNK`` by default: the wire's blocks)."""
    step = CHUNK if step is None else step
    return [(start, min(start + step, size)) for start in range(0, size, step)]


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

    ``device`` says where the fold runs, with the same bits everywhere: ``None`` follows the first row (torch on
    a tensor's GPU; numpy for numpy arrays and CPU tensors, the faster fold on CPU), ``"numpy"`` numpy on the host,
    a torch device (``"cpu"``, ``"cuda:0"``) torch ops there. Rows elsewhere are copied to it; ``export`` returns
    host numpy words whichever it is (one copy per total).
    """

    def __init__(self, size: int, device: str | torch.device | None = None):
        self.size = size
        self.device = device
        self.window = EMPTY  # the union of the folded terms' windows
        self._grid: _Grid | None = None
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
        return ops.device if isinstance(ops, _TorchOps) and ops.device.type != "cpu" else None

    @property
    def backend(self) -> str | None:
        """Where the fold runs ("numpy", "torch-cpu", "torch-cuda"); ``None`` until a row chose it."""
        return None if self._ops is None else self._ops.name

    def add(self, row: Array, weight: float = 1.0) -> None:
        """Fold weight·row (each product rounded to float64 once) into the total. A row that raises part-way
        (NaN, ±inf, out of range) leaves the total unusable: screen rows first."""
        if self._failed:
            raise RuntimeError("exact sum: an earlier add failed part-way, so this total is incomplete")
        row, kind = self._checked(row)
        weight = float(weight)
        if not math.isfinite(weight):
            raise ValueError(f"exact sum: weight {weight} is not finite")
        if weight == 0.0:
            return
        ops = self._ops_or_raise
        if kind not in self._bits:
            self._bits[kind] = ops.empty(len(self._x), _BITS[kind][0])
        bits = self._bits[kind]
        spans = self._spans()
        if self._grid is None:
            window = EMPTY
            for start, stop in spans:
                window = window.union(_chunk_window(ops, row[start:stop], kind, weight, bits))
            if window.empty:
                return
            self._grid = _Grid.fitting(window, WIDTH)
            self._levels = ops.zeros(self._grid.levels + 1, self.size)
        self._failed = True  # until the whole row is in
        for start, stop in spans:
            chunk = row[start:stop]
            window = _chunk_window(ops, chunk, kind, weight, bits)
            if not self.window.covers(window):
                if not self._grid.window.covers(window):
                    self._widen(window, start)
                self.window = self.window.union(window)
            x = self._x[: stop - start]
            ops.weighted(chunk, weight, out=x)
            _cut(ops, x, self._scratch[: stop - start], self._levels[:, start:stop],
                 self._grid.constants, self._grid.levels - 1)
        self._folds += 1
        self.terms += 1
        self._failed = False
        if self._folds >= FOLDS_PER_NORMALISATION:
            self._normalise()

    def add_rows(self, rows: Array, weights: Sequence[float]) -> None:
        """Fold every ``weights[i]``·``rows[i]`` (rows × size), the same bits as :meth:`add` of each in turn (the
        sum is exact). With rows on a torch device, the windows of all rows are read from it at once and each
        level adds all rows' digits in one pass: one wait for the device for the batch, not a few per row, and a bad
        row raises before any is folded. Host rows fold one by one, as :meth:`add` (nothing to wait for)."""
        if self._failed:
            raise RuntimeError("exact sum: an earlier add failed part-way, so this total is incomplete")
        weights = [float(w) for w in weights]
        if len(weights) != len(rows):
            raise ValueError(f"exact sum: {len(rows)} rows but {len(weights)} weights")
        if self._ops is None and len(rows):
            self._checked(rows[0])  # chooses the backend (by the rows' device unless named)
        if not isinstance(self._ops, _TorchOps):
            for row, weight in zip(rows, weights):
                self.add(row, weight)
            return
        for weight in weights:
            if not math.isfinite(weight):
                raise ValueError(f"exact sum: weight {weight} is not finite")
        ops = self._ops
        keep = [i for i, weight in enumerate(weights) if weight != 0.0]
        rows = ops.row(rows)
        if len(keep) < len(rows):  # the index uploaded as rows are (indexing with a list would copy it pageable)
            rows = rows.index_select(0, ops.upload(np.array(keep, dtype=np.int64)))
        kind = ops.kind(rows)
        if tuple(rows.shape) != (len(keep), self.size) or kind not in _BITS:
            raise ValueError(f"exact sum: rows of shape {tuple(rows.shape)} and type {rows.dtype} do not fit a "
                             f"total of {self.size} float entries")
        weights = [weights[i] for i in keep]
        tops, lows = ops.row_extrema(rows, kind) if len(keep) else (np.empty(0), np.empty(0))
        windows = [_window_of(int(t), int(low), kind, w) for t, low, w in zip(tops, lows, weights)]
        if self._grid is None:  # as add: rows before the first non-empty one are no terms
            first = next((i for i, window in enumerate(windows) if not window.empty), len(windows))
            rows, weights, windows = rows[first:], weights[first:], windows[first:]
            if not windows:
                return
            self._grid = _Grid.fitting(windows[0], WIDTH)
            self._levels = ops.zeros(self._grid.levels + 1, self.size)
        union = EMPTY
        for window in windows:
            union = union.union(window)
        if not self._grid.window.covers(union):
            self._widen(union, 0)
        self.window = self.window.union(union)
        step = max(1, min(FOLDS_PER_NORMALISATION, _BATCH_BYTES // (16 * self.size)))
        factors_all = ops.upload(np.array(weights, dtype=np.float64))  # one upload for every block, no wait
        start = 0
        while start < len(weights):
            count = min(step, len(weights) - start, FOLDS_PER_NORMALISATION - self._folds)
            block = rows[start : start + count]
            factors = factors_all[start : start + count]
            self._failed = True
            x = block.to(ops.torch.float64) * factors[:, None]  # fl64(weight·row), as add's ``weighted``
            _cut(ops, x, ops.torch.empty_like(x), self._levels, self._grid.constants, self._grid.levels - 1)
            self._folds += count
            self.terms += count
            self._failed = False
            if self._folds >= FOLDS_PER_NORMALISATION:
                self._normalise()
            start += count

    def _checked(self, row: Array) -> tuple[Array, np.dtype]:
        """``row`` on the backend (chosen now if not yet), float16 widened, and its kind; shape and kind checked."""
        if self._ops is None:
            self._ops = _ops_for(self.device, row)
            span = min(self._ops.span(self.size), self.size)
            self._x = self._ops.empty(span, np.dtype(np.float64))
            self._scratch = self._ops.empty(span, np.dtype(np.float64))
        row = self._ops.row(row)
        if tuple(row.shape) != (self.size,):
            raise ValueError(f"exact sum: a row of shape {tuple(row.shape)} does not match the total's {(self.size,)}")
        kind = self._ops.kind(row)
        if kind is None or kind not in _BITS:
            raise TypeError(f"exact sum: rows must be float16, float32 or float64, not {row.dtype}")
        return row, kind

    def _spans(self) -> list[tuple[int, int]]:
        """The entries folded at a time: ``CHUNK`` on CPU (whole blocks of the wire), the whole row on a GPU."""
        return _chunks(self.size, self._ops_or_raise.span(self.size))

    @property
    def _ops_or_raise(self) -> Ops:
        if self._ops is None:
            raise RuntimeError("exact sum: no row chose a backend yet")
        return self._ops

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
        levels = self._ops_or_raise.zeros(wider.levels + 1, self.size)
        levels[below : below + grid.levels + 1] = self._levels
        biases = wider.biases
        for k in [*range(below), *range(below + grid.levels, wider.levels)]:  # new levels, and the old carry
            levels[k] += _wrapped(self._folds * biases[k])
            levels[k, :done] += _wrapped(biases[k])
        self._grid, self._levels = wider, levels

    def _bias_done(self, done: int, sign: int) -> None:
        """Add (or take out) one bias in every data level of the first ``done`` entries."""
        grid = self._grid_or_raise
        for k, bias in enumerate(grid.biases[: grid.levels]):
            self._levels[k, :done] += _wrapped(sign * bias)

    def _unbiased_chunk(self, start: int, stop: int) -> Array:
        """The levels of entries [start, stop) as int64 digits, biases removed."""
        grid = self._grid_or_raise
        digits = self._levels[:, start:stop]
        for k, bias in enumerate(grid.biases[: grid.levels]):
            digits[k] -= _wrapped(self._folds * bias)
        return digits

    def _normalise(self) -> None:
        """Remove the biases and carry every level down to a balanced digit, the excess into the carry level."""
        if self._grid is None:
            return
        for start, stop in self._spans():
            _carry(self._unbiased_chunk(start, stop), self._grid.width, balanced=True)
        self._folds = 0

    def _recut(self, start: int, stop: int, grid: _Grid, out: Array) -> None:
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
            _cut(ops, x, scratch, out[bottom : top + 1], grid.constants[bottom : top + 1], top - bottom)
            for level in range(bottom, top + 1):
                cuts[level] += 1
        for k, bias in enumerate(grid.biases):
            out[k] -= _wrapped(cuts[k] * bias)
        _carry(out, grid.width, balanced=True)

    def _regrid(self, grid: _Grid) -> None:
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
        wire = _Wire.of(window, terms)
        if self._grid is None:
            return np.zeros(self.size * wire.words, dtype=np.int64)
        ops = self._ops_or_raise
        out = ops.zeros(self.size * wire.words)
        self._normalise()
        recut = None
        for start, stop in self._spans():
            if stop - start <= CHUNK and wire.carried:  # one block of the wire as the re-cut leaves it
                self._recut(start, stop, wire.grid, wire.block(out, start, stop))
                continue
            if recut is None:
                recut = ops.zeros(wire.grid.levels + 1, stop - start)
            cut = recut[:, : stop - start]
            self._recut(start, stop, wire.grid, cut)
            if not wire.carried:  # few terms: the carry joins the top word, exactly (|top| < FEW_TERMS·2^(W−1))
                cut[-2] += cut[-1] * 2**WIRE_WIDTH
            for first, last in _chunks(stop - start):  # laid out in blocks of CHUNK entries
                wire.block(out, start + first, start + last)[...] = cut[: wire.words, first:last]
        return ops.host(out)

    def rounded(self) -> np.ndarray:
        """This total alone rounded to float64 (host numpy): ``round_sum(export(window), window)``'s bits without
        the re-cut onto the wire's grid, for a job whose sum never leaves the rank (one rank). The accumulator's
        normalised levels are balanced digits of ``WIDTH`` bits, which ``_round_block`` rounds as it does the
        wire's ``WIRE_WIDTH``-bit words."""
        if self._grid is None:
            return np.zeros(self.size)
        self._normalise()
        ops = self._ops_or_raise
        out = ops.empty(self.size, np.dtype(np.float64))
        for start, stop in _chunks(self.size, ops.round_span(self.size)):  # on a GPU, all at once
            out[start:stop] = _round_block(ops, self._levels[:, start:stop], self._grid)
        return ops.host(out)  # one copy from a GPU, of the float64 sums


@dataclass(frozen=True)
class _Wire:
    """The reduced buffer's layout for a window and a bound on the terms: the window's grid of ``WIRE_WIDTH``-bit
    words (the re-cut also uses its carry level) and how many words an entry takes."""

    grid: _Grid
    words: int

    @classmethod
    def of(cls, window: Window, terms: int) -> _Wire:
        grid = _Grid.fitting(window, WIRE_WIDTH, slack_below=False)
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
    return _Wire.of(window, terms).words


def round_sum(wire: Array, window: Window, terms: int = ANY_TERMS, device: str | torch.device | None = None
              ) -> Array:
    """The float64 nearest (ties to even) to each exact total held by ``wire``: the MPI.SUM of every rank's
    ``export(window, terms)``, or a part of it that starts at a multiple of ``CHUNK * words(window, terms)``.
    It rounds where ``device`` says (as ``ExactSum``'s; ``None``: where ``wire`` is, numpy for host arrays and CPU
    tensors) and returns the sums there: a numpy array, or a tensor on the device, the same bits on each."""
    ops = _ops_for(device, wire)
    wire = ops.row(wire)
    layout = _Wire.of(window, terms)
    if wire.ndim != 1 or len(wire) % layout.words:
        raise ValueError(f"exact sum: a wire buffer of shape {tuple(wire.shape)} does not hold {layout.words} words "
                         "per entry")
    entries = len(wire) // layout.words
    out = ops.empty(entries, np.dtype(np.float64))
    span = ops.round_span(entries)
    whole = entries // CHUNK * CHUNK
    if span >= entries and whole:  # a GPU: every whole block of the wire at once (words × blocks × CHUNK)
        blocks = wire[: whole * layout.words].reshape(whole // CHUNK, layout.words, CHUNK).swapaxes(0, 1)
        out[:whole] = _round_block(ops, blocks, layout.grid).reshape(-1)
        if whole < entries:
            out[whole:] = _round_block(ops, layout.block(wire, whole, entries), layout.grid)
        return out
    for start, stop in _chunks(entries):
        block = layout.block(wire, start, stop)
        for first, last in _chunks(stop - start, span):
            out[start + first : start + last] = _round_block(ops, block[:, first:last], layout.grid)
    return out


def _round_block(ops: Ops, wire: Array, grid: _Grid) -> Array:
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
    _carry(digits, grid.width, balanced=True)

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


def _round_few(ops: Ops, wire: Array, grid: _Grid) -> Array | None:
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


def exact_sum(rows: Array, weights: Array | None = None, device: str | torch.device | None = None) -> np.ndarray:
    """Σᵢ weights[i]·rows[i], exact and rounded once, in one process: what the reduction gives on any ranks."""
    total = ExactSum(rows.shape[1], device)
    for i, row in enumerate(rows):
        total.add(row, 1.0 if weights is None else weights[i])
    return total.rounded()
