"""The results file's layout: one HDF5 file per run, written by rank 0 only (:mod:`.writing`), read back by
:mod:`.reading`.

Layout (every table is a group of equal-length 1-D columns):

    /                 attrs: config (YAML), status (running|completed|interrupted), mpifl/torch/mpi versions,
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
    /segments         one row per start or resume of the run: first_round, last_round (the last it wrote),
                      world_size, wall_time_s (the root attr wall_time_s is their sum)

    /committed        the committed rows of each appended table (attr tables: their names)

The file is created once and grows: the tables that grow with the run (rounds, eval, ledger, ledger_totals,
ledger_clients, physical) are resizable chunked datasets; each write appends only the new rows, flushes,
then writes their counts to /committed (one small write) and flushes again; the last write's status
"completed" comes after that, so a file never says it before its last rows are committed. A write that changes
committed rows (a resumed run's first, which redoes the rounds after its checkpoint) lowers their counts first.
Readers read each table up to its committed rows, and take the rounds a file holds from them (not from the
root's rounds_completed, which a write sets before its commit), so a run killed at any moment, even mid-write,
is read up to its last committed write.
The checkpoint is written under a temporary name (``checkpoint.new``, marked complete last) and then renamed
over the old one, so a kill during a checkpoint leaves the previous one (or the complete new one) usable.
Files written before this format (whole tables, no /committed) are read as they are. h5py's SWMR mode is
not used: it forbids creating objects once it starts, and a run creates some as it goes (each checkpoint, a
diagnostic column first reported late, the final tables).
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

import h5py
import numpy as np

APPENDED = ("rounds", "eval", "ledger", "ledger_totals", "ledger_clients", "physical")
"""The tables that grow with the run: appended row by row, read up to their committed ``rows``."""


COMMITTED = "committed"  # the committed rows of each appended table, in APPENDED order


CHECKPOINT_PENDING = "checkpoint.new"


SHARDS = "shards"  # a checkpoint's manifest of its files in the shard folder (JSON: rank, file, bytes[, server])


KEPT = "kept"  # the older checkpoints still in the shard folder, newest first (JSON: round, shards)


def shard_dir(path: str | Path) -> Path:
    """Where the ranks of the job writing results file ``path`` put their checkpoint shards: beside it."""
    path = Path(path)
    return path.with_name(f"{path.name}.ckpt")


def committed_rows(f: h5py.File) -> dict[str, int]:
    """How many rows of each appended table are committed (none listed: a file older than the append-only
    format, whose tables are whole)."""
    if COMMITTED not in f:
        return {}
    names = plain(f[COMMITTED].attrs["tables"])
    return dict(zip(names, (int(n) for n in f[COMMITTED][()])))


def rounds_completed(f: h5py.File) -> int:
    """The rounds a results file holds: its committed rows of ``rounds``, or the attribute in a file older than
    the append-only format. Not the attribute in a newer one: a write sets it before it commits its rows, so a
    kill in between leaves it ahead of them (behind them in a resumed run's first write). At most the rows there:
    an earlier mpifl's resumed run, killed in its first write, could leave its old count over fewer rows."""
    committed = committed_rows(f)
    if not committed:
        return int(plain(f.attrs.get("rounds_completed", 0)))
    column = f.get("rounds/round")
    return min(committed.get("rounds", 0), len(column) if column is not None else 0)


def missing(dtype: np.dtype) -> Any:
    """What a row that lacks a column holds there: NaN for numbers with one, else zero or empty."""
    return np.nan if dtype.kind == "f" else b"" if dtype.kind == "S" else 0


def plain(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    return value


_TRUNCATED = re.compile(r"truncated file: eof = (\d+),.*stored_eof = (\d+)")


def open_results_file(path: str | Path, mode: str, **kwargs: Any) -> h5py.File:
    """``h5py.File(path, mode)``, also for a file whose job was killed while HDF5 flushed it: the superblock may
    then record an end of file past the bytes that reached the disk (space allocated, not yet written; no
    committed row lies there), which HDF5 refuses as truncated. The missing tail is read as zeros, as HDF5
    would have left it: in memory for reading (a running job may still be writing it), on disk for ``r+``
    (a resume: its job is gone)."""
    try:
        return h5py.File(path, mode, **kwargs)
    except OSError as exc:
        found = _TRUNCATED.search(str(exc))
        if found is None or int(found[1]) != os.path.getsize(path) or mode not in ("r", "r+"):
            raise
        end = int(found[2])
    if mode == "r":
        data = Path(path).read_bytes()
        return h5py.File(io.BytesIO(data + bytes(max(0, end - len(data)))), "r", **kwargs)
    with open(path, "r+b") as tail:
        if os.fstat(tail.fileno()).st_size < end:
            tail.truncate(end)
    return h5py.File(path, mode, **kwargs)
