"""Reading a results file back: every table up to its committed rows, also while its job still runs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import yaml

from mpifl.extras import optional_import
from mpifl.results.guard import being_written, lock_file
from mpifl.results.layout import CHECKPOINT_PENDING, committed_rows, open_results_file, plain
from mpifl.results.summaries import ledger_summaries
from mpifl.schema import ConfigError


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


def _absent(path: Path) -> str:
    """Why there is no results file at ``path``: none, or one a run has locked and is creating (a new file appears
    under its name once its first write is committed; until then the lock names the run)."""
    if being_written(path):
        try:
            holder = lock_file(path).read_text().strip()
        except OSError:  # released meanwhile
            holder = "another process"
        return (f"results file {path} is being created by a run ({holder}): it appears once the run's first "
                "results are written (after the first evaluation or checkpoint); try again then")
    return f"results file {path} does not exist"


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
                raise ConfigError(_absent(Path(path))) from None
            if attempt == 2:
                raise ConfigError(f"{path} is not a readable mpifl results file (HDF5): {exc}") from None
            time.sleep(0.2)
    raise AssertionError


def _read_results(path: str | Path, checkpoint: bool, ledger: bool) -> Results:
    with open_results_file(path, "r") as f:
        attrs = {k: plain(v) for k, v in f.attrs.items()}
        skip = {CHECKPOINT_PENDING, "checkpoint"} | (set() if ledger else {"ledger"})
        groups = {name: g for name, g in f.items() if name not in skip and isinstance(g, h5py.Group)}
        committed = committed_rows(f)
        if checkpoint:
            found = _checkpoint_group(f)
            if found is not None:
                groups["checkpoint"] = found
        tables = {name: _read_table(group, committed.get(name)) for name, group in groups.items()}
        table_attrs = {name: {k: plain(v) for k, v in group.attrs.items()} for name, group in groups.items()}
        if committed:  # the rows read up to the last commit (layout.rounds_completed's count, already read)
            attrs["rounds_completed"] = len(tables.get("rounds", {}).get("round", ()))
        if "ledger_totals" not in f and "ledger" in f:  # an older file: the summaries from its rows
            rows = tables["ledger"] if ledger else _read_table(f["ledger"], None)
            directions = plain(f["ledger"].attrs.get("directions", np.zeros(0)))
            tables["ledger_totals"], tables["ledger_clients"] = ledger_summaries(rows, directions)
            table_attrs["ledger_totals"] = {k: plain(v) for k, v in f["ledger"].attrs.items()}
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


def rows_up_to(path: str | Path, table: str, round_: int) -> int:
    """How many committed rows of ``table`` have ``round`` ≤ ``round_`` (its rows are in round order): a
    binary search reading a few values, not the column."""
    with open_results_file(path, "r") as f:
        if table not in f or "round" not in f[table]:
            return 0
        column = f[table]["round"]
        low, high = 0, committed_rows(f).get(table, len(column))
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
    with open_results_file(path, "r") as f:
        if table not in f:
            return
        group = f[table]
        total = committed_rows(f).get(table, len(group[columns[0]]))
        for start in range(0, total, chunk):
            yield {name: group[name][start : min(start + chunk, total)] for name in columns}
