"""Readers for the on-disk formats: IDX (MNIST family), CIFAR python pickles, LEAF JSON.

Each reader validates what it reads and turns every low-level failure into one ConfigError that
names the file, because a bad dataset must stop a run before training, with a message a user can act on.
"""

from __future__ import annotations

import codecs
import gzip
import json
import os
import pickle
import zlib
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import numpy as np

from mpifl.schema import ConfigError

_READ_ERRORS = (OSError, EOFError, zlib.error)

# ----------------------------------------------------------------------------------------- IDX

_IDX_TYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
IDX_LABELS_MAGIC = 0x00000801
IDX_IMAGES_MAGIC = 0x00000803
_CHUNK_BYTES = 1 << 22


def _open(path: Path) -> IO[bytes]:
    if path.suffix == ".gz":
        return gzip.open(path, "rb")  # type: ignore[return-value]  # a GzipFile reads bytes like any IO[bytes]
    return open(path, "rb")


class IdxFile:
    """One IDX file, header parsed and length checked up front; rows are read on demand (memory-mapped
    when uncompressed, streamed when gzipped) so a worker reads only its clients' samples."""

    def __init__(self, path: Path, magic: int):
        self.path = path
        try:
            with _open(path) as f:
                head = f.read(4)
                if len(head) < 4 or head[:2] != b"\0\0" or head[2] not in _IDX_TYPES:
                    raise ConfigError(f"data.root: {path}: not an IDX file (bad magic {head.hex() or 'empty'})")
                if int.from_bytes(head, "big") != magic:
                    raise ConfigError(
                        f"data.root: {path}: IDX magic 0x{int.from_bytes(head, 'big'):08x}, expected 0x{magic:08x}"
                    )
                dims = f.read(4 * head[3])
        except _READ_ERRORS as exc:
            raise ConfigError(f"data.root: {path}: cannot read IDX header ({exc})") from exc
        if len(dims) < 4 * head[3]:
            raise ConfigError(f"data.root: {path}: truncated IDX header")
        self.dtype = np.dtype(_IDX_TYPES[head[2]])
        self.shape = tuple(int(d) for d in np.frombuffer(dims, ">u4"))
        self.offset = 4 + len(dims)
        self.nbytes = int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize
        self._check_length()

    def _check_length(self) -> None:
        expected = self.offset + self.nbytes
        if self.path.suffix != ".gz":
            actual = os.path.getsize(self.path)
        else:
            with open(self.path, "rb") as f:  # gzip's trailer holds the uncompressed size mod 2**32
                f.seek(-4, os.SEEK_END)
                trailer = int.from_bytes(f.read(4), "little")
            if trailer == expected % 2**32:
                return
            actual = self._stream_length()  # multi-member archives only record their last member
        if actual != expected:
            raise ConfigError(
                f"data.root: {self.path}: IDX size mismatch, header {self.shape} needs {expected} bytes, "
                f"file has {actual} (truncated or corrupt)"
            )

    def _stream_length(self) -> int:
        total = 0
        try:
            with gzip.open(self.path, "rb") as f:
                while block := f.read(_CHUNK_BYTES):
                    total += len(block)
        except _READ_ERRORS as exc:
            raise ConfigError(f"data.root: {self.path}: corrupt or truncated gzip ({exc})") from exc
        return total

    def read_all(self) -> np.ndarray:
        return self.read_rows(np.arange(self.shape[0]))

    def read_rows(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` (any order, in range) of the first axis, in native byte order."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) and (rows.min() < 0 or rows.max() >= self.shape[0]):
            raise IndexError(f"{self.path}: rows outside [0, {self.shape[0]})")
        wanted, inverse = np.unique(rows, return_inverse=True)
        if not len(wanted):
            picked = np.empty((0, *self.shape[1:]), dtype=self.dtype)
        elif self.path.suffix != ".gz":
            data = np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset, shape=self.shape)
            picked = np.array(data[wanted])
        else:
            picked = self._stream_rows(wanted)
        return picked[inverse].astype(self.dtype.newbyteorder("="))

    def _stream_rows(self, wanted: np.ndarray) -> np.ndarray:
        row_shape = self.shape[1:]
        row_bytes = int(np.prod(row_shape, dtype=np.int64)) * self.dtype.itemsize
        per_chunk = max(1, _CHUNK_BYTES // max(row_bytes, 1))
        out = np.empty((len(wanted), *row_shape), dtype=self.dtype)
        done = 0
        try:
            with gzip.open(self.path, "rb") as f:
                f.read(self.offset)
                start = 0
                while done < len(wanted):
                    stop = min(start + per_chunk, self.shape[0])
                    block = f.read((stop - start) * row_bytes)
                    if len(block) < (stop - start) * row_bytes:
                        raise EOFError("file ends before the rows its header announces")
                    chunk = np.frombuffer(block, self.dtype).reshape(stop - start, *row_shape)
                    hit = wanted[done:][wanted[done:] < stop]
                    out[done : done + len(hit)] = chunk[hit - start]
                    done += len(hit)
                    start = stop
        except _READ_ERRORS as exc:
            raise ConfigError(f"data.root: {self.path}: corrupt or truncated gzip ({exc})") from exc
        return out


def find_file(root: Path, names: Iterable[str], what: str) -> Path:
    """The first of ``names`` (each also tried with ``.gz``) present in ``root``."""
    tried = []
    for name in names:
        for candidate in (root / name, root / f"{name}.gz"):
            if candidate.is_file():
                return candidate
            tried.append(candidate.name)
    raise ConfigError(f"data.root: {root}: no {what} file (looked for {', '.join(tried)})")


# ------------------------------------------------------------------------------- CIFAR pickle


class _ForbiddenGlobal(pickle.UnpicklingError):
    pass


def _numpy_globals() -> dict[tuple[str, str], Any]:
    reconstruct = np.zeros(1).__reduce__()[0]
    frombuffer = np.zeros(1).__reduce_ex__(5)[0]
    allowed: dict[tuple[str, str], Any] = {
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): codecs.encode,  # Python-3 protocol-2 pickles wrap bytes with it
    }
    for core in ("numpy.core", "numpy._core"):  # the module's name moved in numpy 2
        allowed[(f"{core}.multiarray", "_reconstruct")] = reconstruct
        allowed[(f"{core}.numeric", "_frombuffer")] = frombuffer
    return allowed


class _SafeUnpickler(pickle.Unpickler):
    """Rebuilds plain containers and numpy arrays only: a dataset file must not be able to run code."""

    _ALLOWED = _numpy_globals()

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self._ALLOWED[(module, name)]
        except KeyError:
            raise _ForbiddenGlobal(f"{module}.{name}") from None


def load_pickle(path: Path) -> Any:
    """Unpickle a CIFAR batch (``encoding="bytes"``) with the restricted unpickler."""
    if not path.is_file():
        raise ConfigError(f"data.root: missing file {path}")
    try:
        with open(path, "rb") as f:
            return _SafeUnpickler(f, encoding="bytes").load()
    except _ForbiddenGlobal as exc:
        raise ConfigError(f"data.root: {path}: refusing to unpickle global {exc} (only numpy arrays allowed)") from exc
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, LookupError,
            OSError, MemoryError, OverflowError, RecursionError) as exc:
        # MemoryError: a damaged length field asks for an impossible buffer (OverflowError: for more bytes than
        # the platform can address); LookupError: a damaged string encoding name (or memo key); RecursionError:
        # damaged nesting
        raise ConfigError(f"data.root: {path}: corrupt or truncated pickle ({type(exc).__name__}: {exc})") from exc


def read_cifar_batch(path: Path, label_key: bytes, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """``(images uint8 [N,3,32,32], labels int64 [N])`` of one CIFAR batch file, validated."""
    batch = load_pickle(path)
    if not isinstance(batch, dict) or b"data" not in batch or label_key not in batch:
        raise ConfigError(f"data.root: {path}: expected a dict with keys b'data' and {label_key!r}")
    data = np.asarray(batch[b"data"])
    try:
        labels = np.asarray(batch[label_key], dtype=np.int64)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"data.root: {path}: {label_key!r} is not a list of integers") from exc
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or labels.shape != (len(data),):
        raise ConfigError(
            f"data.root: {path}: expected data [N, 3072] and N labels, got {data.shape} and {labels.shape}"
        )
    if data.dtype != np.uint8:
        raise ConfigError(f"data.root: {path}: expected uint8 pixels, got {data.dtype}")
    check_labels(labels, num_classes, path)
    return data.reshape(-1, 3, 32, 32), labels


def check_labels(labels: np.ndarray, num_classes: int, path: Path | str) -> None:
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise ConfigError(
            f"data.root: {path}: labels must lie in [0, {num_classes}), found {labels.min()}..{labels.max()}"
        )


# ---------------------------------------------------------------------------------- LEAF JSON

Decoder = Callable[[list, Path], np.ndarray]


def leaf_files(directory: Path) -> list[Path]:
    """The sorted ``*.json`` files of one LEAF split directory."""
    if not directory.is_dir():
        raise ConfigError(f"data.root: missing LEAF directory {directory}")
    files = sorted(directory.glob("*.json"))
    if not files:
        raise ConfigError(f"data.root: {directory}: no *.json files")
    return files


def read_leaf_file(
    path: Path, decode_y: Decoder, decode_x: Decoder | None, users: set[str] | None = None
) -> dict[str, tuple[np.ndarray | None, np.ndarray]]:
    """``{user: (x, y)}`` of one LEAF JSON file, restricted to ``users`` when given; ``x`` is left
    undecoded (None) when ``decode_x`` is None, which is all the layout needs."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"data.root: {path}: invalid LEAF JSON ({exc})") from exc
    if not isinstance(doc, dict) or not all(k in doc for k in ("users", "num_samples", "user_data")):
        raise ConfigError(f"data.root: {path}: expected keys 'users', 'num_samples', 'user_data'")
    if len(doc["users"]) != len(doc["num_samples"]):
        raise ConfigError(f"data.root: {path}: 'users' and 'num_samples' differ in length")
    out = {}
    for user, count in zip(doc["users"], doc["num_samples"], strict=True):
        if users is not None and user not in users:
            continue
        entry = doc["user_data"].get(user) if isinstance(doc["user_data"], dict) else None
        if not isinstance(entry, dict) or "x" not in entry or "y" not in entry:
            raise ConfigError(f"data.root: {path}: user {user!r} has no 'x'/'y' in 'user_data'")
        if not len(entry["x"]) == len(entry["y"]) == count:
            raise ConfigError(
                f"data.root: {path}: user {user!r} has {len(entry['x'])} x, {len(entry['y'])} y, num_samples {count}"
            )
        out[user] = (None if decode_x is None else decode_x(entry["x"], path), decode_y(entry["y"], path))
    return out
