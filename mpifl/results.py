"""The results file: one HDF5 file per run, written by rank 0 only, replaced atomically.

Layout (every table is a group of equal-length 1-D columns):

    /                 attrs: config (YAML), status (running|completed), mpifl/torch/mpi versions,
                      world_size, mpi_library, wall_time_s, rounds_completed
    /rounds           one row per training round: round, sim_time_s, wall_time_s, server_time_s,
                      unix_time_s (when the round ended), train_loss, logical_up_bytes,
                      logical_down_bytes, + the algorithm's diagnostics (attr diagnostics: their names)
    /eval             one row per evaluation: round, cum_logical_bytes, and for each model kind
                      K (global, local, personal, ...) and group G (seen, unseen):
                      K/G/acc_pooled, K/G/acc_mean, K/G/loss (flattened as "K.G.acc_pooled"),
                      + the algorithm's evaluation diagnostics (attr diagnostics: their names)
    /ledger           logical bytes: round, client, message, stage, bytes; attrs message_names,
                      directions, stages
    /physical         rank 0's collectives: round, message, op, bytes, seconds
    /ranks            per rank: rank, clients, mpi_bytes, mpi_seconds, compute_seconds
    /clients          final per-client metrics: client, unseen, train_size, owner, and per kind K:
                      K.acc, K.loss, K.n_test

The file is rewritten to a temporary name and renamed over the old one at every evaluation, so a
run killed at any moment leaves either the previous complete file or the new one, never half of one.
"""

from __future__ import annotations

import errno
import os
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import yaml

from mpifl.schema import ConfigError


class MissingExtra(ConfigError, ImportError):
    """An optional dependency is not installed: one line that names the extra to install (the CLI exits
    with code 2; code that imports mpifl sees an ImportError)."""


def optional_import(module: str, extra: str, purpose: str) -> Any:
    """``module``, imported, or :class:`MissingExtra` saying how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(f"{purpose} needs {exc.name or module}: pip install 'mpifl[{extra}]'") from None


def flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level of dotted keys (``{"client": {"lr": 0.1}}`` → ``{"client.lr": 0.1}``)."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


@dataclass
class Table:
    """Append-only columns of numbers; a row may add a column that earlier rows lack (NaN-filled)."""

    columns: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    length: int = 0

    def append(self, row: dict[str, float]) -> None:
        for key in row:
            if key not in self.columns:
                self.columns[key] = [np.nan] * self.length
        for key, values in self.columns.items():
            values.append(row.get(key, np.nan))
        self.length += 1

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: np.asarray(v) for k, v in self.columns.items()}

    def extend(self, columns: dict[str, np.ndarray]) -> None:
        """Append the rows of a table read back from a results file."""
        rows = len(next(iter(columns.values()))) if columns else 0
        for i in range(rows):
            self.append({k: v[i].item() for k, v in columns.items()})


def _write_table(group: h5py.Group, columns: dict[str, np.ndarray]) -> None:
    for name, values in columns.items():
        group.create_dataset(name, data=values, compression="gzip" if values.size > 4096 else None)


def _write_attrs(node: h5py.Group, attrs: dict[str, Any]) -> None:
    for key, value in attrs.items():
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            value = np.array(value, dtype=h5py.string_dtype())
        node.attrs[key] = value


def check_writable(path: str | Path) -> None:
    """Refuse, before anything trains, a results path the first write would fail on: not a directory, and
    its nearest existing directory (where the missing ones will be created) takes a new file. A file
    probed there is removed at once, so a refused run leaves nothing behind."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"output {path}: is a directory, not a results file")
    existing = next(p for p in (path.parent, *path.parent.parents) if p.exists())
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        raise ConfigError(f"output {path}: cannot be written: {exc.strerror or exc} ({existing})") from None


def write_atomically(path: str | Path, attrs: dict[str, Any], tables: dict[str, dict[str, np.ndarray]],
                     table_attrs: dict[str, dict[str, Any]] | None = None) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with h5py.File(tmp, "w") as f:
            _write_attrs(f, attrs)
            for name, columns in tables.items():
                group = f.create_group(name)
                _write_table(group, columns)
                _write_attrs(group, (table_attrs or {}).get(name, {}))
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


@dataclass(frozen=True)
class Results:
    """A results file read back into memory."""

    attrs: dict[str, Any]
    tables: dict[str, dict[str, np.ndarray]]
    table_attrs: dict[str, dict[str, Any]]

    def table(self, name: str) -> dict[str, np.ndarray]:
        return self.tables.get(name, {})

    def frame(self, name: str) -> Any:
        """Table ``name`` as a pandas DataFrame (one column per column, byte strings decoded), for analysis in
        notebooks; pandas is optional (``pip install 'mpifl[pandas]'``)."""
        pandas = optional_import("pandas", "pandas", "Results.frame")
        if name not in self.tables:
            raise ConfigError(f"no table {name!r} in this results file (it has: {', '.join(sorted(self.tables))})")
        columns = {k: np.char.decode(v) if v.dtype.kind == "S" else v for k, v in self.tables[name].items()}
        return pandas.DataFrame(columns)

    @property
    def config(self) -> dict[str, Any]:
        """The run's config as the mapping it was written from (every default filled in)."""
        return yaml.safe_load(self.attrs["config"])

    def diagnostics(self, table: str) -> list[str]:
        """The columns of ``table`` (rounds or eval) that the algorithm added: its own per-round diagnostics."""
        return [name for name in self.table_attrs.get(table, {}).get("diagnostics", []) if name in self.table(table)]


def read_results(path: str | Path, checkpoint: bool = False) -> Results:
    """Read a results file; its (possibly large) checkpoint group only when asked for."""
    try:
        with h5py.File(path, "r") as f:
            attrs = {k: _plain(v) for k, v in f.attrs.items()}
            groups = {name: g for name, g in f.items() if checkpoint or name != "checkpoint"}
            tables = {name: {col: group[col][()] for col in group} for name, group in groups.items()}
            table_attrs = {name: {k: _plain(v) for k, v in group.attrs.items()} for name, group in groups.items()}
    except FileNotFoundError:
        raise ConfigError(f"results file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"{path} is not a readable mpifl results file (HDF5): {exc}") from None
    if "config" not in attrs:
        raise ConfigError(f"{path} is an HDF5 file but not an mpifl results file (no config attribute)")
    return Results(attrs, tables, table_attrs)


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    return value
