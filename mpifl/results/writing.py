"""Writing the results file: refusing an unwritable path before training, then appending each write's new rows
and committing them (:mod:`.layout`)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from mpifl.results.layout import (
    APPENDED,
    CHECKPOINT_PENDING,
    COMMITTED,
    KEPT,
    SHARDS,
    committed_rows,
    missing,
    open_results_file,
    shard_dir,
)
from mpifl.results.space import (
    FAILED_HDF5,
    StorageFull,
    arrays_bytes,
    ensure_room,
    storage_errno,
    storage_failures,
    storage_full,
    sync_folder,
)
from mpifl.schema import ConfigError

LEDGER_CHUNK, CHUNK = 16384, 1024  # rows of a chunk of an appended column: the ledger's, every other table's


def write_table(group: h5py.Group, columns: dict[str, np.ndarray]) -> None:
    for name, values in columns.items():
        group.create_dataset(name, data=values, compression="gzip" if values.size > 4096 else None)


def write_attrs(node: h5py.Group, attrs: dict[str, Any]) -> None:
    for key, value in attrs.items():
        if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
            value = np.array(value, dtype=h5py.string_dtype())
        node.attrs[key] = value


PATH_MAX = 4096  # Linux's limit on a whole path, in bytes


def _short(name: str) -> str:
    """A long name as one line can show it: its start and end."""
    return name if len(name) <= 40 else f"{name[:24]}…{name[-12:]}"


def check_names(path: str | Path, beside: tuple[tuple[str, str], ...] = (), what: str = "output") -> None:
    """Refuse (one line) a path that the file system would answer with "File name too long" in the middle of a
    write: a folder's or the file's own name longer than the file system allows (``NAME_MAX``, 255 bytes on
    most), a name the command creates beside it (``beside``: (what it is, its name), e.g. a lock, a temporary
    name, a checkpoint folder) longer still, or a whole path past ``PATH_MAX``. Checks names only, so it runs
    before anything is looked at or created."""
    path = Path(path)
    existing = next((p for p in (path.parent, *path.parent.parents) if os.path.isdir(p)), Path("."))
    try:
        limit = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    for part in path.parts:
        if len(os.fsencode(part)) > limit:
            raise ConfigError(f"{what} {path}: the name {_short(part)!r} is {len(os.fsencode(part))} bytes, past the "
                              f"{limit} this file system allows in a name; give a shorter one")
    own = len(os.fsencode(path.name))
    for description, name in beside:
        extra = len(os.fsencode(name)) - own
        if own + extra > limit:
            raise ConfigError(f"{what} {path}: its name is {own} bytes, and the {description} written beside it "
                              f"({_short(name)!r}) adds {extra}, past the {limit} this file system allows in a "
                              f"name; give a name of at most {limit - extra} bytes")
    if len(os.fsencode(os.path.abspath(path))) + max((len(n) for _, n in beside), default=0) >= PATH_MAX:
        raise ConfigError(f"{what} {_short(str(path))}: the whole path passes the {PATH_MAX} bytes a path may have; "
                          "give a shorter one")


def creating_name(path: Path) -> Path:
    """The temporary name a new results file is written under until its first write is committed."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def check_writable(path: str | Path, beside: tuple[tuple[str, str], ...] = ()) -> None:
    """Refuse, before anything trains, a results path the first write would fail on: names the file system
    takes (:func:`check_names`, with the names created ``beside`` it), not a directory, and its nearest
    existing directory (where the missing ones will be created) takes a new file. A file probed there is removed
    at once, so a refused run leaves nothing behind."""
    path = Path(path)
    check_names(path, beside)
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


class AppendOnlyFile:
    """The results file of a running job, kept open by rank 0: created once, then each :meth:`write` appends
    only new rows and commits them (see the module docstring). Not thread-safe: one writer thread uses it."""

    def __init__(self, path: str | Path, resume: bool):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # a new file is made under a temporary name and renamed once its first write is committed: a kill while
        # HDF5 lays out a new file leaves no file rather than a broken one
        self.creating = None if resume else creating_name(self.path)
        # no HDF5 file lock: others (report, a test) may read the committed rows while the job runs
        ensure_room(self.path, 0, f"creating {self.path.name}")
        try:
            self.file = (h5py.File(self.creating, "w", locking=False) if self.creating
                         else open_results_file(self.path, "r+", locking=False))
            self.file.attrs["layout"] = "append"
            if COMMITTED not in self.file:
                self.file.create_dataset(COMMITTED, data=np.zeros(len(APPENDED), np.int64))
                self.file[COMMITTED].attrs["tables"] = np.array(APPENDED, dtype=h5py.string_dtype())
        except OSError as exc:  # the file system filled under it: no half-made file left
            if self.creating is not None:
                with contextlib.suppress(OSError):  # (one read-only or failing keeps it)
                    self.creating.unlink(missing_ok=True)
            if storage_errno(exc) is None:
                raise
            raise storage_full(exc, self.path, f"creating {self.path.name}") from None
        self.rows = committed_rows(self.file)
        # (rounds, checkpoint round) its last completed write committed to disk; None while it is being created
        self.kept: tuple[int, int | None] | None = None if self.creating else (
            self.rows.get("rounds", 0), int(self.file["checkpoint"].attrs["round"]) if "checkpoint" in self.file
            else None)
        self._failed: list[BaseException] = []  # the failures HDF5 reported during the write under way

    def write(self, attrs: dict[str, Any], appended: dict[str, tuple[int, dict[str, np.ndarray]]],
              replaced: dict[str, dict[str, np.ndarray]], table_attrs: dict[str, dict[str, Any]],
              checkpoint: tuple[int, dict[str, np.ndarray]] | None = None) -> None:
        """``appended``: table → (the row its new rows start at, the new rows), committed after the data;
        ``replaced``: small tables written whole; ``checkpoint``: (round, blobs), swapped in complete. A write the
        file system would not have room for is not begun (:func:`~mpifl.results.space.ensure_room`); one that
        fails all the same (a quota, a failing disk) leaves the file as its last commit left it, untouched from
        then on (:attr:`broken`: HDF5 may crash on the next call into a file whose write failed)."""
        what = f"writing round {attrs.get('rounds_completed', '?')}'s results to {self.path.name}"
        try:
            ensure_room(self.path, _write_bytes(appended, replaced, checkpoint), what)
            with storage_failures(self.path, what) as self._failed:
                try:
                    self._write(attrs, appended, replaced, table_attrs, checkpoint)
                except Exception as exc:
                    self._failed.append(exc)
                    raise
                finally:
                    if self.broken:  # never freed: the interpreter's exit would close it, and HDF5 crash
                        FAILED_HDF5.append(self.file)
        except StorageFull as exc:  # what the file holds on disk, known here without reading it
            exc.kept = self.kept
            raise

    @property
    def broken(self) -> bool:
        """Whether a write failed in HDF5: the file is not touched again."""
        return any(storage_errno(error) is not None for error in self._failed)

    def _ok(self) -> None:
        """Stop the write at once where HDF5 has failed to write (reported only as it freed an object): the next
        call into the file (a flush) may crash the process."""
        if self._failed:
            raise self._failed[0]

    def _write(self, attrs: dict[str, Any], appended: dict[str, tuple[int, dict[str, np.ndarray]]],
               replaced: dict[str, dict[str, np.ndarray]], table_attrs: dict[str, dict[str, Any]],
               checkpoint: tuple[int, dict[str, np.ndarray]] | None) -> None:
        f = self.file
        rewritten = {name: start for name, (start, _) in appended.items() if start < self.rows.get(name, 0)}
        if rewritten:  # committed rows about to change (a resumed run redoes the rounds after its checkpoint):
            self._commit(rewritten)  # they stop counting before they do
        for name, (start, columns) in appended.items():
            self._append(f.require_group(name), start, columns)
            self._ok()
        for name, columns in replaced.items():
            self._replace(name, columns)
            self._ok()
        for name, extra in table_attrs.items():
            write_attrs(f.require_group(name), extra)
        self._ok()
        completed = attrs.get("status") == "completed"  # said only once its last rows count
        write_attrs(f, {**attrs, "status": "running"} if completed else attrs)
        self._commit({name: start + _length(columns) for name, (start, columns) in appended.items()})
        if completed:
            f.attrs["status"] = "completed"
            self._ok()
            self._sync()
        if checkpoint is not None:  # after the rows it resumes from are committed
            self._checkpoint(*checkpoint)
            self._ok()
            f.flush()
        if self.creating is not None:
            f.close()
            os.replace(self.creating, self.path)
            sync_folder(self.path.parent)
            self.file, self.creating = h5py.File(self.path, "r+", locking=False), None
        self.kept = (self.rows.get("rounds", 0), checkpoint[0] if checkpoint is not None else
                     self.kept[1] if self.kept is not None else None)

    def _commit(self, rows: dict[str, int]) -> None:
        """Make ``rows`` (table → its row count) the committed counts: what the file holds is on disk first (one
        flush), then the counts (one write of one small dataset, flushed)."""
        self.rows.update(rows)
        self._ok()
        self.file.flush()
        self.file[COMMITTED][...] = [self.rows.get(name, 0) for name in APPENDED]
        self._ok()
        self.file.flush()

    def _append(self, group: h5py.Group, start: int, columns: dict[str, np.ndarray]) -> None:
        """Rows ``start`` on become ``columns`` (rows past them, uncommitted or from before a resume, go); a
        column new to the table starts with NaN (missing) in the rows before."""
        end = start + _length(columns)
        for key, values in columns.items():
            if key not in group:
                chunk = LEDGER_CHUNK if values.dtype.itemsize <= 8 and group.name == "/ledger" else CHUNK
                group.create_dataset(key, shape=(start,), maxshape=(None,), chunks=(chunk,), dtype=values.dtype,
                                     fillvalue=missing(values.dtype))
            column = group[key]
            column.resize((end,))
            if len(values):
                column[start:end] = values
            del column
            self._ok()
        for key in set(group) - set(columns):  # a column these rows lack
            group[key].resize((end,))
            if end > start:
                group[key][start:end] = missing(group[key].dtype)
            self._ok()

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
        write_table(self.file.create_group(name), columns)

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
        if SHARDS in blobs:  # committed, on the disk: the files of checkpoints no longer kept (and unfinished ones)
            self._sync()    # can go, not those of later rounds (a resumed run's redone rounds write them again)
            prune_checkpoints(self.path, blobs, round_)

    def _sync(self) -> None:
        """What the file holds, on the disk and not only in the page cache: before a commit's older checkpoint
        files go, and once the run completes, so that a node that loses power keeps a checkpoint it can resume
        from (the checkpoint files are synced as they are written). Once per checkpoint, not per round."""
        self.file.flush()
        os.fsync(self.file.id.get_vfd_handle())

    def close(self) -> None:
        if not self.broken:  # a file whose write failed is left to the process's end (see write)
            self.file.close()
        if self.creating is not None:  # closed before its first write (a failure): nothing to keep
            with contextlib.suppress(OSError):  # (a read-only or failing file system keeps it)
                self.creating.unlink(missing_ok=True)


def prune_checkpoints(path: Path, blobs: dict[str, np.ndarray] | None, up_to: int | None = None) -> None:
    """Delete the checkpoint files beside results file ``path`` that the committed checkpoint ``blobs`` (its
    manifest; ``None``: none) does not keep: of rounds up to ``up_to``, or, at the end of a run (``None``), of
    any round (an unfinished checkpoint of a segment killed past the round its resume started from); the
    folder goes too when nothing is left in it."""
    keep: set[str] = set()
    if blobs is not None and SHARDS in blobs:
        kept = [json.loads(blobs[SHARDS].tobytes())]
        kept += [k["shards"] for k in json.loads(blobs[KEPT].tobytes())] if KEPT in blobs else []
        keep = {entry["file"] for entries in kept for entry in entries}
    folder = shard_dir(path)
    for file in folder.glob("*"):
        written = re.fullmatch(r"\.?round(\d+)-(rank\d+|server|runtime)\.h5(\.tmp)?", file.name)
        if written and (up_to is None or int(written.group(1)) <= up_to) and file.name not in keep:
            file.unlink(missing_ok=True)
    if up_to is None:
        with contextlib.suppress(OSError):  # not empty, or not there
            folder.rmdir()


def _write_bytes(appended: dict[str, tuple[int, dict[str, np.ndarray]]], replaced: dict[str, dict[str, np.ndarray]],
                 checkpoint: tuple[int, dict[str, np.ndarray]] | None) -> int:
    """An upper estimate of what a write adds to the file: the small tables and the checkpoint's arrays, and the
    chunks the appended rows start (a column's space grows a whole chunk at a time)."""
    need = sum(arrays_bytes(columns.values()) for columns in replaced.values())
    for name, (start, columns) in appended.items():
        rows = LEDGER_CHUNK if name == "ledger" else CHUNK
        chunks = -(-(start + _length(columns)) // rows) - -(-start // rows)
        need += sum(chunks * rows * np.asarray(c).dtype.itemsize for c in columns.values())
    return need + (arrays_bytes(checkpoint[1].values()) if checkpoint is not None else 0)


def _length(columns: dict[str, np.ndarray]) -> int:
    return len(next(iter(columns.values()))) if columns else 0
