"""The exact sum's array operations, written once for numpy and once for torch, so that the fold, ``export`` and the
rounding run where the rows are, with the same bits.

The fold and ``export`` use a few array operations (``NumpyOps``, ``TorchOps``: add and subtract into a buffer, bit
views, bitwise and, max and min, ldexp, zeros): numpy on the host, or torch on a tensor's device (CUDA: elementwise
float64 and int64 kernels and reductions only, no atomics; one pass over a whole row, one copy of the wire to the host
per total). On CPU numpy is the faster fold (torch's int64 add is about 3x numpy's; benchmarks/bench_exactsum.py:
about 1.4x per fold), so host rows, CPU tensors included, fold with numpy unless a total names ``device="cpu"``.
``round_sum`` and ``rounded`` are written once over the same operations too, so a GPU rank can round a wire (or its
own total) on its device with nothing read back. Host arrays reach a device from pinned memory without a wait
(``TorchOps.upload``).
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

# An array of a total's backend: a numpy array, or a torch tensor on the total's device. The algorithm is written
# once against both (their shared operators and the few operations of ``NumpyOps`` and ``TorchOps``).
Array = Any

# Entries cut at a time, and the wire's blocks: the temporaries stay in the CPU's cache. The other modules read it as
# ``_backends.CHUNK``, so that a test can shrink it in one place.
CHUNK = 1 << 16
ROUND_SPAN = 1 << 13  # entries rounded at a time on the CPU: 2.7x faster than CHUNK (the temporaries stay in L2)

# row kind -> (signed view of its bits, bits of |value|, bits of +inf); |value|'s bits are never negative
FLOAT_BITS: dict[np.dtype, tuple[np.dtype, int, int]] = {
    np.dtype(np.float32): (np.dtype(np.int32), 0x7FFF_FFFF, 0x7F80_0000),
    np.dtype(np.float64): (np.dtype(np.int64), 0x7FFF_FFFF_FFFF_FFFF, 0x7FF0_0000_0000_0000)}


def is_tensor(row: object) -> bool:
    """Whether ``row`` is a torch tensor (without importing torch: a tensor exists only if torch is loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(row, torch.Tensor)


def host_copy(row: Array) -> np.ndarray:
    """A copy of ``row`` in host memory, whether a numpy array or a tensor on any device."""
    return row.detach().cpu().numpy().copy() if is_tensor(row) else np.array(row)


class NumpyOps:
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
        """``row`` (or a block of rows) as a contiguous host array, float16 widened (exactly) to float32. A CPU
        tensor is shared, not copied; a tensor on another device is copied to the host."""
        if is_tensor(row):
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


class TorchOps:
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
        if not is_tensor(row):
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
        signed, magnitude, _ = FLOAT_BITS[kind]
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


Ops = NumpyOps | TorchOps


def ops_for(device: str | torch.device | None, row: object) -> Ops:
    """The backend for ``device`` (see ``ExactSum``); with none, the one for ``row``'s device."""
    if device is None:
        on_device = is_tensor(row) and row.device.type != "cpu"  # type: ignore[attr-defined]
        return TorchOps(row.device) if on_device else NumpyOps()  # type: ignore[attr-defined]
    return NumpyOps() if device == "numpy" else TorchOps(device)


def chunks(size: int, step: int | None = None) -> list[tuple[int, int]]:
    """[start, stop) of each ``step`` entries (``CHUNK`` by default: the wire's blocks)."""
    step = CHUNK if step is None else step
    return [(start, min(start + step, size)) for start in range(0, size, step)]
