"""The results file: one HDF5 file per run, written by rank 0 only, replaced atomically.

Layout (every table is a group of equal-length 1-D columns):

    /                 attrs: config (YAML), status (running|completed|failed), mpifl/torch/mpi versions,
                      world_size, mpi_library, wall_time_s, rounds_completed, layout ("append" since
                      the append-only format; absent in older files)
    /rounds           one row per training round: round, sim_time_s, wall_time_s, server_time_s,
                      unix_time_s (when the round ended), train_loss, logical_up_bytes,
                      logical_down_bytes, + the algorithm's diagnostics (attr diagnostics: their names)
    /eval             one row per evaluation: round, cum_logical_bytes, and for each model kind
                      K (global, local, personal, ...) and group G (seen, unseen):
                      K/G/acc_pooled, K/G/acc_mean, K/G/loss (flattened as "K.G.acc_pooled"),
                      + the algorithm's evaluation diagnostics (attr diagnostics: their names)
    /ledger           logical bytes: round, client, message, stage, bytes; attrs message_names,
                      directions, stages
    /ledger_totals    logical bytes per (round, stage, message): round, stage, message, bytes
    /ledger_clients   per (round, stage, direction), what one client moved: clients, bytes_min,
                      bytes_max, bytes_sum (direction 0 = down, 1 = up)
    /physical         rank 0's collectives: round, message, op, bytes, seconds
    /ranks            per rank: rank, clients, mpi_bytes, mpi_seconds, compute_seconds
    /clients          final per-client metrics: client, unseen, train_size, owner, and per kind K:
                      K.acc, K.loss, K.n_test

    /committed        the committed rows of each appended table (attr tables: their names)

The file is created once and grows: the tables that grow with the run (rounds, eval, ledger, ledger_totals,
ledger_clients, physical) are resizable chunked datasets; each write appends only the new rows, flushes,
then writes their counts to /committed (one small write) and flushes again. Readers read each table up to
its committed rows, so a run killed at any moment, even mid-write, is read up to its last committed write.
The checkpoint is written under a temporary name (``checkpoint.new``, marked complete last) and then renamed
over the old one, so a kill during a checkpoint leaves the previous one (or the complete new one) usable.
Files written before this format (whole tables, no /committed) are read as they are. h5py's SWMR mode is
not used: it forbids creating objects once it starts, and a run creates some as it goes (each checkpoint, a
diagnostic column first reported late, the final tables).
"""

from __future__ import annotations

import errno
import json
import os
import re
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
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

    def since(self, start: int) -> dict[str, np.ndarray]:
        """The rows from ``start`` on (what a write appends), without converting the older ones."""
        return {k: np.asarray(v[start:]) for k, v in self.columns.items()}

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


APPENDED = ("rounds", "eval", "ledger", "ledger_totals", "ledger_clients", "physical")
"""The tables that grow with the run: appended row by row, read up to their committed ``rows``."""

CHECKPOINT_PENDING = "checkpoint.new"
SHARDS = "shards"  # a checkpoint's manifest of per-rank shard files (JSON: rank, file, bytes)


def shard_dir(path: str | Path) -> Path:
    """Where the ranks of the job writing results file ``path`` put their checkpoint shards: beside it."""
    path = Path(path)
    return path.with_name(f"{path.name}.ckpt")
COMMITTED = "committed"  # the committed rows of each appended table, in APPENDED order


class AppendOnlyFile:
    """The results file of a running job, kept open by rank 0: created once, then each :meth:`write` appends
    only new rows and commits them (see the module docstring). Not thread-safe: one writer thread uses it."""

    def __init__(self, path: str | Path, resume: bool):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # a new file is made under a temporary name and renamed once its first write is committed: a kill while
        # HDF5 lays out a new file leaves no file rather than a broken one
        self.creating = None if resume else self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        # no HDF5 file lock: others (report, a test) may read the committed rows while the job runs
        self.file = h5py.File(self.creating or self.path, "w" if self.creating else "r+", locking=False)
        self.file.attrs["layout"] = "append"
        if COMMITTED not in self.file:
            self.file.create_dataset(COMMITTED, data=np.zeros(len(APPENDED), np.int64))
            self.file[COMMITTED].attrs["tables"] = np.array(APPENDED, dtype=h5py.string_dtype())
        self.rows = _committed(self.file)

    def write(self, attrs: dict[str, Any], appended: dict[str, tuple[int, dict[str, np.ndarray]]],
              replaced: dict[str, dict[str, np.ndarray]], table_attrs: dict[str, dict[str, Any]],
              checkpoint: tuple[int, dict[str, np.ndarray]] | None = None) -> None:
        """``appended``: table → (the row its new rows start at, the new rows), committed after the data;
        ``replaced``: small tables written whole; ``checkpoint``: (round, blobs), swapped in complete."""
        f = self.file
        for name, (start, columns) in appended.items():
            self._append(f.require_group(name), start, columns)
        for name, columns in replaced.items():
            self._replace(name, columns)
        for name, extra in table_attrs.items():
            _write_attrs(f.require_group(name), extra)
        for name, (start, columns) in appended.items():
            self.rows[name] = start + _length(columns)
        _write_attrs(f, attrs)
        f.flush()  # the rows are in the file before the count that commits them (one write of one small dataset)
        f[COMMITTED][...] = [self.rows.get(name, 0) for name in APPENDED]
        f.flush()
        if checkpoint is not None:  # after the rows it resumes from are committed
            self._checkpoint(*checkpoint)
            f.flush()
        if self.creating is not None:
            f.close()
            os.replace(self.creating, self.path)
            self.file, self.creating = h5py.File(self.path, "r+", locking=False), None

    @staticmethod
    def _append(group: h5py.Group, start: int, columns: dict[str, np.ndarray]) -> None:
        """Rows ``start`` on become ``columns`` (rows past them, uncommitted or from before a resume, go); a
        column new to the table starts with NaN (missing) in the rows before."""
        end = start + _length(columns)
        for key, values in columns.items():
            if key not in group:
                chunk = 16384 if values.dtype.itemsize <= 8 and group.name == "/ledger" else 1024
                group.create_dataset(key, shape=(start,), maxshape=(None,), chunks=(chunk,), dtype=values.dtype,
                                     fillvalue=_missing(values.dtype))
            column = group[key]
            column.resize((end,))
            if len(values):
                column[start:end] = values
        for key in set(group) - set(columns):  # a column these rows lack
            group[key].resize((end,))
            if end > start:
                group[key][start:end] = _missing(group[key].dtype)

    def _replace(self, name: str, columns: dict[str, np.ndarray]) -> None:
        """A small table written whole: in place when its columns keep their shapes (the clients table at every
        evaluation), so the file does not grow by a copy each time."""
        group = self.file.get(name)
        if group is not None and set(group) == set(columns) and all(
                group[k].shape == v.shape and group[k].dtype == v.dtype for k, v in columns.items()):
            for key, values in columns.items():
                group[key][...] = values
            return
        if group is not None:
            del self.file[name]
        _write_table(self.file.create_group(name), columns)

    def _checkpoint(self, round_: int, blobs: dict[str, np.ndarray]) -> None:
        f = self.file
        if CHECKPOINT_PENDING in f:
            del f[CHECKPOINT_PENDING]
        group = f.create_group(CHECKPOINT_PENDING)
        for name, blob in blobs.items():
            group.create_dataset(name, data=blob)
        group.attrs["round"] = round_
        group.attrs["complete"] = True
        f.flush()
        if "checkpoint" in f:
            del f["checkpoint"]
        f.move(CHECKPOINT_PENDING, "checkpoint")
        if SHARDS in blobs:  # committed: earlier checkpoints' shards (and unfinished ones) can go, not later ones
            f.flush()
            keep = {entry["file"] for entry in json.loads(blobs[SHARDS].tobytes())}
            for file in shard_dir(self.path).glob("*"):
                written = re.fullmatch(r"\.?round(\d+)-rank\d+\.h5(\.tmp)?", file.name)
                if written and int(written.group(1)) <= round_ and file.name not in keep:
                    file.unlink(missing_ok=True)

    def close(self) -> None:
        self.file.close()
        if self.creating is not None:  # closed before its first write (a failure): nothing to keep
            self.creating.unlink()


def _committed(f: h5py.File) -> dict[str, int]:
    """How many rows of each appended table are committed (none listed: a file older than the append-only
    format, whose tables are whole)."""
    if COMMITTED not in f:
        return {}
    names = _plain(f[COMMITTED].attrs["tables"])
    return dict(zip(names, (int(n) for n in f[COMMITTED][()])))


def rows_up_to(path: str | Path, table: str, round_: int) -> int:
    """How many committed rows of ``table`` have ``round`` ≤ ``round_`` (its rows are in round order): a
    binary search reading a few values, not the column."""
    with h5py.File(path, "r") as f:
        if table not in f or "round" not in f[table]:
            return 0
        column = f[table]["round"]
        low, high = 0, _committed(f).get(table, len(column))
        while low < high:
            middle = (low + high) // 2
            if column[middle] <= round_:
                low = middle + 1
            else:
                high = middle
        return low


def read_column_chunks(path: str | Path, table: str, columns: tuple[str, ...], chunk: int = 1 << 20
                       ) -> Iterator[dict[str, np.ndarray]]:
    """The committed rows of ``columns`` of ``table``, ``chunk`` rows at a time (bounded memory)."""
    with h5py.File(path, "r") as f:
        if table not in f:
            return
        group = f[table]
        total = _committed(f).get(table, len(group[columns[0]]))
        for start in range(0, total, chunk):
            yield {name: group[name][start : min(start + chunk, total)] for name in columns}


def _missing(dtype: np.dtype) -> Any:
    """What a row that lacks a column holds there: NaN for numbers with one, else zero or empty."""
    return np.nan if dtype.kind == "f" else b"" if dtype.kind == "S" else 0


def _length(columns: dict[str, np.ndarray]) -> int:
    return len(next(iter(columns.values()))) if columns else 0


def ledger_summaries(rows: dict[str, np.ndarray], directions: list[str]
                     ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Two small tables of ledger rows covering whole rounds: the bytes per (round, stage, message) and, per
    (round, stage, direction), the spread of what one client moved in that round (``clients``, ``bytes_min``,
    ``bytes_max``, ``bytes_sum``) — what ``report`` shows without reading per-client rows."""
    rounds, stages, messages, nbytes = rows["round"], rows["stage"], rows["message"], rows["bytes"]
    keys, which = np.unique(np.stack([rounds, stages, messages], axis=1), axis=0, return_inverse=True)
    keys = keys.reshape(-1, 3)
    totals: dict[str, np.ndarray] = {"round": keys[:, 0].astype(np.int64), "stage": keys[:, 1].astype(np.int8),
              "message": keys[:, 2].astype(np.int32),
              "bytes": np.bincount(which.ravel(), weights=nbytes, minlength=len(keys)).astype(np.int64)}
    up = np.array([d == "up" for d in directions], dtype=np.int64)
    direction = up[messages] if len(up) else np.zeros(0, np.int64)
    pairs, which = np.unique(np.stack([rounds, stages, direction, rows["client"]], axis=1), axis=0,
                             return_inverse=True)
    pairs = pairs.reshape(-1, 4)
    sums = np.bincount(which.ravel(), weights=nbytes, minlength=len(pairs)).astype(np.int64)
    groups, which = np.unique(pairs[:, :3], axis=0, return_inverse=True)
    groups, which = groups.reshape(-1, 3), which.ravel()
    low, high = np.full(len(groups), np.iinfo(np.int64).max), np.zeros(len(groups), np.int64)
    np.minimum.at(low, which, sums)
    np.maximum.at(high, which, sums)
    spread: dict[str, np.ndarray] = {"round": groups[:, 0].astype(np.int64), "stage": groups[:, 1].astype(np.int8),
              "direction": groups[:, 2].astype(np.int8),
              "clients": np.bincount(which, minlength=len(groups)).astype(np.int64), "bytes_min": low,
              "bytes_max": high, "bytes_sum": np.bincount(which, weights=sums, minlength=len(groups)).astype(np.int64)}
    return totals, spread


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


def read_results(path: str | Path, checkpoint: bool = False, ledger: bool = True) -> Results:
    """Read a results file: every table up to its committed rows; its (possibly large) checkpoint only when
    asked for; the per-client ledger unless ``ledger`` is False (its per-round summaries are always read,
    worked out from the per-client rows in files older than the append-only format). A running job's file is
    read again (twice at most) if a flush under way leaves it momentarily unreadable."""
    for attempt in range(3):
        try:
            return _read_results(path, checkpoint, ledger)
        except (OSError, KeyError, ValueError) as exc:
            if isinstance(exc, FileNotFoundError):
                raise ConfigError(f"results file {path} does not exist") from None
            if attempt == 2:
                raise ConfigError(f"{path} is not a readable mpifl results file (HDF5): {exc}") from None
            time.sleep(0.2)
    raise AssertionError


def _read_results(path: str | Path, checkpoint: bool, ledger: bool) -> Results:
    with h5py.File(path, "r") as f:
        attrs = {k: _plain(v) for k, v in f.attrs.items()}
        skip = {CHECKPOINT_PENDING, "checkpoint"} | (set() if ledger else {"ledger"})
        groups = {name: g for name, g in f.items() if name not in skip and isinstance(g, h5py.Group)}
        committed = _committed(f)
        if checkpoint:
            found = _checkpoint_group(f)
            if found is not None:
                groups["checkpoint"] = found
        tables = {name: _read_table(group, committed.get(name)) for name, group in groups.items()}
        table_attrs = {name: {k: _plain(v) for k, v in group.attrs.items()} for name, group in groups.items()}
        if committed:  # as of the last commit, whatever a write killed after it had begun to change
            attrs["rounds_completed"] = len(tables.get("rounds", {}).get("round", ()))
        if "ledger_totals" not in f and "ledger" in f:  # an older file: the summaries from its rows
            rows = tables["ledger"] if ledger else _read_table(f["ledger"], None)
            directions = _plain(f["ledger"].attrs.get("directions", np.zeros(0)))
            tables["ledger_totals"], tables["ledger_clients"] = ledger_summaries(rows, directions)
            table_attrs["ledger_totals"] = {k: _plain(v) for k, v in f["ledger"].attrs.items()}
    if "config" not in attrs:
        raise ConfigError(f"{path} is an HDF5 file but not an mpifl results file (no config attribute)")
    return Results(attrs, tables, table_attrs)


def _read_table(group: h5py.Group, rows: int | None) -> dict[str, np.ndarray]:
    return {col: group[col][()] if rows is None else group[col][:rows] for col in group}


def _checkpoint_group(f: h5py.File) -> h5py.Group | None:
    """The last complete checkpoint: ``checkpoint``, or one killed between being finished and renamed."""
    if "checkpoint" in f:
        return f["checkpoint"]
    pending = f.get(CHECKPOINT_PENDING)
    return pending if pending is not None and pending.attrs.get("complete", False) else None


def _plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    return value
