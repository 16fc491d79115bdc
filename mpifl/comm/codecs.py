"""Update compression on the wire: each codec turns one float row into its own bytes and back.

Codecs live below the algorithms because compression is a property of the link, not of the method: the runtime
encodes a declared float message as its sender hands it over and decodes it before its receiver sees it, so an
algorithm never sees a codec, every algorithm gets every codec, and the ledger counts the encoded bytes. Every
codec here is pure numpy, deterministic given its ``rng`` (drawn by :func:`codec_rng` from the run's seed,
round, client and message, so results do not depend on the rank count), little-endian, and padded only as its
formula says. With ``error_feedback`` the runtime calls :func:`encode_with_feedback`, which keeps what the
encoding lost and adds it to the next upload.

==========  =============================================  ==========================================
codec       bytes for a row of ``n`` entries                source
==========  =============================================  ==========================================
``fp16``    ``2n``                                          IEEE 754 binary16
``bf16``    ``2n``                                          bfloat16 (Kalamkar et al. 2019)
``qsgd``    ``4 + ceil(n·bits/8)``                          QSGD (Alistarh et al. 2017)
``topk``    ``k·(w + 4)``                                   top-k sparsification (Aji & Heafield 2017;
                                                            Stich et al. 2018)
``randk``   ``k·(w + 4)``                                   random-k (Stich et al. 2018)
``sign``    ``4 + ceil(n/8)``                               EF-signSGD (Karimireddy et al. 2019)
==========  =============================================  ==========================================

where ``k = min(n, max(1, ceil(fraction·n)))`` and ``w`` is 1, 2 or 4: the smallest unsigned width that holds
``n - 1``. Error feedback: Seide et al. 2014 (1-bit SGD), Karimireddy et al. 2019 (EF-SGD).

A non-finite row always decodes to a row with a non-finite entry (the runtime screens NaN uploads after
decoding); each codec's docstring says how.
"""

from __future__ import annotations

import math
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import numpy.typing as npt

from mpifl.comm.config import CodecConfig

_CODEC_TAG = 0x636F6463  # "codc": the codec draws' own stream
_HEADER = np.dtype("<f4")  # qsgd's norm, sign's scale
_VALUE = np.dtype("<f4")  # topk/randk values


class Codec(ABC):
    """One wire encoding of a 1-D float row (float32 or float64) into 1-D uint8 bytes."""

    name: str
    stochastic: bool = False  # draws from the rng given to encode

    @abstractmethod
    def encoded_nbytes(self, numel: int) -> int:
        """The exact length of :meth:`encode`'s output for a row of ``numel`` entries."""

    @abstractmethod
    def encode(self, row: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """``row`` as a fresh contiguous uint8 array of :meth:`encoded_nbytes` bytes."""

    def decode(self, blob: np.ndarray, numel: int, dtype: np.dtype | str) -> np.ndarray:
        """The ``numel`` entries of ``dtype`` that ``blob`` stands for, as a fresh array (never a view of ``blob``)."""
        if blob.shape != (self.encoded_nbytes(numel),):
            raise ValueError(f"{self.name}: {blob.size} bytes for {numel} entries, expected "
                             f"{self.encoded_nbytes(numel)}")
        return self._decode(np.ascontiguousarray(blob, dtype=np.uint8), numel).astype(dtype)

    @abstractmethod
    def _decode(self, blob: np.ndarray, numel: int) -> np.ndarray:
        """``blob`` (already checked for length) as a float row of any float dtype."""


def _cast(values: npt.ArrayLike, dtype: npt.DTypeLike) -> np.ndarray:
    """``values`` as a contiguous ``dtype`` array; magnitudes past its range become ±Inf, which the receiver
    sees (no warning: that is the format, not an accident)."""
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(values, dtype=dtype)


def _bytes(values: npt.ArrayLike, dtype: npt.DTypeLike) -> np.ndarray:
    """``values`` as ``dtype``'s little-endian bytes."""
    return _cast(values, dtype).view(np.uint8)


def _read(blob: np.ndarray, offset: int, dtype: npt.DTypeLike, count: int) -> np.ndarray:
    """``count`` little-endian ``dtype`` values from ``blob`` at byte ``offset``."""
    itemsize = np.dtype(dtype).itemsize
    return blob[offset:offset + count * itemsize].view(dtype)


def _header_and_bits(header: float, bits: np.ndarray) -> np.ndarray:
    return np.concatenate([_bytes([header], _HEADER), bits])


@dataclass(frozen=True)
class Fp16(Codec):
    """IEEE half precision, round to nearest even (numpy's cast); NaN and ±Inf stay as they are, and finite
    magnitudes beyond 65504 become ±Inf."""

    name = "fp16"

    def encoded_nbytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, row: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        return _bytes(row, "<f2")

    def _decode(self, blob: np.ndarray, numel: int) -> np.ndarray:
        return _read(blob, 0, "<f2", numel)


@dataclass(frozen=True)
class Bf16(Codec):
    """bfloat16: the top 16 bits of the float32, rounded to nearest even on the dropped 16 (float64 rows are
    rounded to float32 first). A NaN keeps its quiet bit set so that dropping its low mantissa bits cannot turn
    it into an Inf; ±Inf is unchanged by the rounding; finite values past bfloat16's largest round to ±Inf."""

    name = "bf16"

    def encoded_nbytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, row: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        u = _cast(row, np.float32).view(np.uint32)
        rounded = (u + (np.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16  # no wrap: non-NaN patterns are ≤ 0xFF800000
        top = np.where(np.isnan(row), (u >> 16) | 0x0040, rounded)
        return _bytes(top.astype(np.uint16), "<u2")

    def _decode(self, blob: np.ndarray, numel: int) -> np.ndarray:
        return (_read(blob, 0, "<u2", numel).astype(np.uint32) << 16).view(np.float32)


def _pack_bits(codes: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned ``codes`` (< 2^bits ≤ 2^16) packed ``bits`` bits each: entry i in bits [i·bits, (i+1)·bits) of a
    little-endian bit stream (least significant bit first), the last byte zero-padded."""
    planes = np.unpackbits(_bytes(codes.astype(np.uint16), "<u2").reshape(-1, 2), axis=1, bitorder="little")
    return np.packbits(planes[:, :bits], bitorder="little")


def _unpack_bits(data: np.ndarray, numel: int, bits: int) -> np.ndarray:
    """The inverse of :func:`_pack_bits`: ``numel`` codes of ``bits`` bits as uint16."""
    planes = np.unpackbits(data, count=numel * bits, bitorder="little").reshape(numel, bits)
    padded = np.zeros((numel, 16), dtype=np.uint8)
    padded[:, :bits] = planes
    return np.packbits(padded, axis=1, bitorder="little").view("<u2").reshape(numel)


@dataclass(frozen=True)
class Qsgd(Codec):
    """QSGD (Alistarh et al. 2017): the row's L2 norm as a float32 header, then per entry a level
    ``l ∈ {0..s}``, ``s = 2^(bits-1) - 1``, of ``s·|x|/norm`` rounded up with probability equal to its fractional
    part (so ``E[decode] = row``), and a sign bit: ``bits`` bits per entry, the level in the low ``bits - 1``
    bits, the sign (1 = negative) on top. The header is rounded up to float32 so no level exceeds ``s``. A zero
    row has norm 0 and decodes to zeros; a non-finite entry makes the norm non-finite, and a non-finite norm
    (or one past float32's range) decodes to all NaN."""

    bits: int = 8
    name = "qsgd"
    stochastic = True

    def __post_init__(self) -> None:
        if not 2 <= self.bits <= 16:
            raise ValueError(f"qsgd: bits must be in [2, 16], got {self.bits}")

    @property
    def levels(self) -> int:
        return 2 ** (self.bits - 1) - 1

    def encoded_nbytes(self, numel: int) -> int:
        return _HEADER.itemsize + -(-numel * self.bits // 8)

    def encode(self, row: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        x = row.astype(np.float64)
        exact = float(np.linalg.norm(x))
        norm = _cast([exact], _HEADER)[0]
        if float(norm) < exact:
            norm = np.nextafter(norm, np.float32(np.inf))
        level = np.zeros(x.shape)
        if np.isfinite(norm) and norm > 0:
            level = np.abs(x) / np.float64(norm) * self.levels
        low = np.floor(level)
        level = np.minimum(low + (rng.random(x.shape) < level - low), self.levels)
        codes = level.astype(np.uint16) | (np.signbit(x).astype(np.uint16) << (self.bits - 1))
        return _header_and_bits(norm, _pack_bits(codes, self.bits))

    def _decode(self, blob: np.ndarray, numel: int) -> np.ndarray:
        norm = np.float64(_read(blob, 0, _HEADER, 1)[0])
        if not np.isfinite(norm):
            return np.full(numel, np.nan)
        codes = _unpack_bits(blob[_HEADER.itemsize:], numel, self.bits)
        magnitude = (codes & self.levels) * (norm / self.levels)
        return np.where(codes >> (self.bits - 1), -magnitude, magnitude)


def sparse_k(fraction: float, numel: int) -> int:
    """Entries a top-k/random-k row keeps: ``min(numel, max(1, ceil(fraction·numel)))``, with ``fraction`` taken
    as written (its shortest decimal), so 0.07 of 100 entries is 7, not the float product's 8."""
    return min(numel, max(1, math.ceil(Fraction(repr(fraction)) * numel)))


def index_width(numel: int) -> int:
    """Bytes of one sparse index: the smallest of 1, 2, 4 that holds ``numel - 1``."""
    for width in (1, 2, 4):
        if numel - 1 < 256 ** width:
            return width
    raise ValueError(f"a sparse index cannot address {numel} entries")


@dataclass(frozen=True)
class _Sparse(Codec):
    """``k`` entries as their indices (ascending, ``w`` bytes each) then their values (float32), no header: ``k``
    and ``w`` follow from the row length and ``fraction``. Unsent entries decode to zero."""

    fraction: float = 0.01

    def __post_init__(self) -> None:
        if not 0 < self.fraction <= 1:
            raise ValueError(f"{self.name}: fraction must be in (0, 1], got {self.fraction}")

    def encoded_nbytes(self, numel: int) -> int:
        return sparse_k(self.fraction, numel) * (index_width(numel) + _VALUE.itemsize)

    def encode(self, row: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        index = self._indices(row, sparse_k(self.fraction, row.size), rng)
        values = _cast(row[index], _VALUE)
        if np.isfinite(values).all() and not np.isfinite(row).all():
            values[0] = np.nan  # the row is broken but no broken entry was picked: say so
        return np.concatenate([_bytes(index, f"<u{index_width(row.size)}"), _bytes(values, _VALUE)])

    def _decode(self, blob: np.ndarray, numel: int) -> np.ndarray:
        k, width = sparse_k(self.fraction, numel), index_width(numel)
        out = np.zeros(numel, dtype=np.float32)
        out[_read(blob, 0, f"<u{width}", k)] = _read(blob, k * width, _VALUE, k)
        return out

    @abstractmethod
    def _indices(self, row: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
        """The ``k`` entries to send, ascending."""


@dataclass(frozen=True)
class TopK(_Sparse):
    """Top-k sparsification: the ``k`` largest magnitudes, ties broken by the lower index. A NaN counts as an
    infinite magnitude, so a non-finite row always sends a non-finite entry (``k ≥ 1``)."""

    name = "topk"

    def _indices(self, row: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
        if k == 0:
            return np.zeros(0, dtype=np.int64)
        magnitude = np.abs(row)
        magnitude[np.isnan(magnitude)] = np.inf
        threshold = np.partition(magnitude, row.size - k)[row.size - k]  # the k-th largest magnitude
        above = magnitude > threshold
        ties = np.flatnonzero(magnitude == threshold)[: k - int(above.sum())]
        above[ties] = True
        return np.flatnonzero(above)


@dataclass(frozen=True)
class RandK(_Sparse):
    """Random-k sparsification: ``k`` indices drawn uniformly without replacement, values sent unscaled. Unscaled
    random-k is biased (``E[decode] = (k/n)·row``); with error feedback that is the standard choice (Stich et
    al. 2018): the residual returns what was dropped, and error feedback needs a contraction, which the unbiased
    variant's ``n/k`` rescaling is not. A non-finite row whose draw missed every non-finite entry sends NaN as
    its first value."""

    name = "randk"
    stochastic = True

    def _indices(self, row: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
        return np.sort(rng.choice(row.size, size=k, replace=False))


@dataclass(frozen=True)
class Sign(Codec):
    """Scaled signSGD as in EF-signSGD (Karimireddy et al. 2019): the mean magnitude ``‖x‖₁/n`` as a float32
    header, then one bit per entry (1 = non-negative, little-endian bit order); decodes to ``±scale``. A
    non-finite entry makes the scale non-finite, so every decoded entry is."""

    name = "sign"

    def encoded_nbytes(self, numel: int) -> int:
        return _HEADER.itemsize + -(-numel // 8)

    def encode(self, row: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        scale = np.abs(row.astype(np.float64)).mean() if row.size else 0.0
        return _header_and_bits(scale, np.packbits(row >= 0, bitorder="little"))

    def _decode(self, blob: np.ndarray, numel: int) -> np.ndarray:
        scale = _read(blob, 0, _HEADER, 1)[0]
        positive = np.unpackbits(blob[_HEADER.itemsize:], count=numel, bitorder="little").astype(bool)
        return np.where(positive, scale, -scale)


_FACTORIES: dict[str, Callable[[CodecConfig], Codec]] = {
    "fp16": lambda cfg: Fp16(),
    "bf16": lambda cfg: Bf16(),
    "qsgd": lambda cfg: Qsgd(cfg.bits),
    "topk": lambda cfg: TopK(cfg.fraction),
    "randk": lambda cfg: RandK(cfg.fraction),
    "sign": lambda cfg: Sign(),
}


def build_codec(cfg: CodecConfig) -> Codec | None:
    """The codec a config section names (``None`` for ``none``: the raw bytes)."""
    return None if cfg.codec == "none" else _FACTORIES[cfg.codec](cfg)


def codec_rng(seed: int, round_: int, client: int, message: str) -> np.random.Generator:
    """The draws of one encoding, keyed by (seed, round, client, message) only, so they do not depend on which
    rank holds the client. ``client`` is -1 for a broadcast (keyed as ``client + 1``: entropy is non-negative)."""
    return np.random.default_rng([seed, _CODEC_TAG, round_, client + 1, zlib.crc32(message.encode())])


def encode_with_feedback(codec: Codec, row: np.ndarray, residual: np.ndarray | None, rng: np.random.Generator
                         ) -> tuple[np.ndarray, np.ndarray]:
    """Error feedback (Seide et al. 2014; EF-SGD, Karimireddy et al. 2019): encode ``row + residual`` and keep
    what the encoding lost as the next residual, so nothing is dropped for good, only delayed. Returns the blob
    and the new residual (``row``'s dtype; ``residual=None`` is zeros)."""
    corrected = row if residual is None else (row + residual).astype(row.dtype, copy=False)
    blob = codec.encode(corrected, rng)
    return blob, corrected - codec.decode(blob, row.size, row.dtype)
