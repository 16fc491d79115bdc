"""Exporting a results file's metrics to CSV files and TensorBoard event files.

The TensorBoard writer is self-contained (TFRecord framing with masked CRC-32C around hand-encoded
``Event``/``Summary`` protobufs), so exporting needs neither TensorFlow nor TensorBoard installed.
"""

from __future__ import annotations

import csv
import socket
import struct
import time
from pathlib import Path

import numpy as np

from mpifl.results import Results, read_results

_CRC32C_TABLE = []
for _byte in range(256):
    _crc = _byte
    for _ in range(8):
        _crc = (_crc >> 1) ^ 0x82F63B78 if _crc & 1 else _crc >> 1
    _CRC32C_TABLE.append(_crc)


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC32C_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, body: bytes) -> bytes:
    """An ``Event`` message: wall_time (1, double), step (2, int64), then ``body`` (version or summary)."""
    return b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step) + body


def _scalar_summary(tag: str, value: float) -> bytes:
    value_msg = _length_delimited(1, tag.encode()) + b"\x15" + struct.pack("<f", value)
    return _length_delimited(5, _length_delimited(1, value_msg))


def _record(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", _masked_crc(header)) + data + struct.pack("<I", _masked_crc(data))


def _scalar_series(res: Results) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    series = {}
    for table, x in (("rounds", "round"), ("eval", "round")):
        columns = res.table(table)
        for name, values in columns.items():
            if name != x and values.dtype.kind == "f":
                series[f"{table}/{name}"] = (columns[x].astype(np.int64), values)
    return series


def write_tensorboard(res: Results, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    now = time.time()
    path = directory / f"events.out.tfevents.{int(now)}.{socket.gethostname()}.mpifl"
    records = [_record(_event(now, 0, _length_delimited(3, b"brain.Event:2")))]
    for tag, (steps, values) in _scalar_series(res).items():
        for step, value in zip(steps, values):
            if np.isfinite(value):
                records.append(_record(_event(now, int(step), _scalar_summary(tag, float(value)))))
    path.write_bytes(b"".join(records))
    return path


def write_csv(res: Results, directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for table in ("rounds", "eval", "clients"):
        columns = res.table(table)
        if not columns:
            continue
        path = directory / f"{table}.csv"
        names = list(columns)
        with open(path, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(names)
            writer.writerows(zip(*(columns[n].tolist() for n in names)))
        written.append(path)
    return written


def export(path: str, csv_dir: str | None, tensorboard_dir: str | None) -> list[Path]:
    res = read_results(path)
    written: list[Path] = []
    if csv_dir:
        written += write_csv(res, Path(csv_dir))
    if tensorboard_dir:
        written.append(write_tensorboard(res, Path(tensorboard_dir)))
    return written
