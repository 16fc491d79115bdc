"""Room on the file system for what a run writes, checked before each write.

HDF5 does not survive a full disk: once a write into a file it keeps open fails (``ENOSPC``), its metadata cache
holds blocks it cannot write, h5py reports them as "exceptions ignored" when objects are freed, and the next flush
may crash the process (a segmentation fault after every round had trained: issue 57). So the results file's
writes and the checkpoints' files are measured first (:func:`ensure_room`): a write that would not fit in the
free space, with a margin, is not started, and the run ends with one line (:class:`StorageFull`) while its file
still holds every committed row and checkpoint. A fresh file whose write fails anyway (the space went between the
check and the write, a quota, a read-only or failing file system) is removed and reported the same way.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import threading
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import h5py

STORAGE_EXIT = 75
"""The exit code of a command the file system stopped (sysexits.h's EX_TEMPFAIL: free space, or mend the file
system, then run it again or --resume)."""
STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO}
"""The errors of the storage itself (full, over quota, read-only, failing), not of the path or the program."""
NAMED_TARGET_ERRNOS = STORAGE_ERRNOS - {errno.EROFS}
"""Those that are the machine's fault where a command writes a file the user named (a plot, an export): a
read-only target there is the user's choice, bad input (exit 2) like any other unwritable path."""
MARGIN, SLACK = 1.25, 1 << 20
"""A write is started only when the free space holds its estimate times MARGIN plus SLACK bytes (HDF5's metadata,
the chunks a column grows by)."""


class StorageFull(OSError):
    """A write the file system could not take, or would not have room for: one line for the user."""

    kept: tuple[int, int | None] | None = None  # (rounds, checkpoint round) the file held at its last commit, if known


def free_bytes(path: str | Path) -> int:
    """The bytes an unprivileged process may still write on the file system of ``path`` (its nearest existing
    folder)."""
    folder = next(p for p in (Path(path), *Path(path).parents) if p.exists())
    stats = os.statvfs(folder)
    return stats.f_bavail * stats.f_frsize


def mount_point(path: str | Path) -> Path:
    """The mount point of the file system that holds ``path``."""
    folder = next(p for p in (Path(path).absolute(), *Path(path).absolute().parents) if p.exists())
    while not os.path.ismount(folder):
        folder = folder.parent
    return folder


def readable_bytes(amount: float) -> str:
    """Bytes as a person reads them (1.2 MB, 300 kB)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if amount >= scale:
            return f"{amount / scale:.1f} {unit}"
    return f"{int(amount)} B"


def arrays_bytes(arrays: Iterable[np.ndarray]) -> int:
    return sum(int(np.asarray(a).nbytes) for a in arrays)


def ensure_room(path: str | Path, need: float, what: str) -> None:
    """Raise :class:`StorageFull` unless the file system of ``path`` has room for ``need`` bytes of ``what`` (with
    :data:`MARGIN` and :data:`SLACK`). ``MPIFL_SPACE_CHECK=off`` skips the check, for a file system whose free space
    ``statvfs`` does not tell (a quota it does not see): a write that fails is then caught as it fails."""
    if os.environ.get("MPIFL_SPACE_CHECK", "").lower() == "off":
        return
    wanted = need * MARGIN + SLACK
    free = free_bytes(path)
    if free < wanted:
        raise StorageFull(errno.ENOSPC, f"the file system at {mount_point(path)} has {readable_bytes(free)} free; "
                          f"{what} needs about {readable_bytes(wanted)}")


def storage_errno(exc: BaseException) -> int | None:
    """The storage error behind ``exc`` (an ``OSError``'s errno, or the ``errno = N`` HDF5 puts in its message),
    if it is one of :data:`STORAGE_ERRNOS`."""
    code = getattr(exc, "errno", None)
    if code not in STORAGE_ERRNOS:
        text = str(exc)
        found = [int(n) for n in text.split("errno = ")[1:2] for n in [n.split(",")[0].strip()] if n.isdigit()]
        code = found[0] if found else None
    return code if code in STORAGE_ERRNOS else None


def storage_full(exc: BaseException, path: str | Path, what: str) -> StorageFull:
    """``exc`` (a storage error) as one line: which file system, what failed, why."""
    code = storage_errno(exc) or errno.EIO
    return StorageFull(code, f"the file system at {mount_point(path)} could not take {what}: {cause(code, path)}")


def cause(code: int, path: str | Path) -> str:
    """What the file system of ``path`` said (``code``, one of :data:`STORAGE_ERRNOS`), with its free space where
    that tells something: not for a read-only or failing one, and for a quota, that it is not the disk that is
    full (``statvfs`` does not show a quota)."""
    said = os.strerror(code)
    if code not in (errno.ENOSPC, errno.EDQUOT):
        return said
    try:
        free = readable_bytes(free_bytes(path))
    except OSError:  # a file system that has gone on failing
        return said
    return f"{said} ({free} free)" if code == errno.ENOSPC else f"{said} (a quota: the file system has {free} free)"


CURES = {
    errno.ENOSPC: "free space",
    errno.EDQUOT: "free space within your quota (or have it raised)",
    errno.EROFS: "make the file system writable again (the kernel's log, dmesg, says why it went read-only)",
    errno.EIO: "mend the file system (the kernel's log, dmesg, says what failed)",
}
"""What a user does about each storage error before the command that continues."""


def cure(code: int | None) -> str:
    """What to do about storage error ``code`` before running the command again (a full disk's, where unknown)."""
    return CURES.get(code or errno.ENOSPC, CURES[errno.ENOSPC])


def sync_folder(folder: Path) -> None:
    """The names in ``folder`` (a rename, a new file), on the disk: a file's own fsync does not cover its name, so
    a node that loses power could keep a results file naming a checkpoint file whose rename was lost."""
    handle = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(handle)
    except OSError as exc:  # a file system that does not sync folders (some FUSE and network ones): its names are
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):  # as durable as it makes them
            raise
    finally:
        os.close(handle)


@contextlib.contextmanager
def written_whole(path: str | Path, what: str, temporary: Path | None = None,
                  storage: set[int] = NAMED_TARGET_ERRNOS, durable: bool = False) -> Iterator[Path]:
    """A temporary name beside ``path`` (``temporary``, else ``.NAME.tmp-PID``) to write a file under; renamed to
    ``path`` once written, removed if the write fails, so ``path`` is the old file or the whole new one, never a
    part (a plot, a summary, a CSV export, a checkpoint file on a file system that fills). An error of ``storage``
    becomes :class:`StorageFull`. ``durable``: the file's bytes are on the disk before its name, and its name once
    it has it (:func:`sync_folder`)."""
    path = Path(path)
    tmp = temporary or path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        if durable:
            with open(tmp, "rb") as written:
                os.fsync(written.fileno())
        os.replace(tmp, path)
        if durable:
            sync_folder(path.parent)
    except BaseException as exc:
        with contextlib.suppress(OSError):  # (a read-only or failing file system keeps it: nothing removes it)
            tmp.unlink(missing_ok=True)
        if storage_errno(exc) in storage:
            raise storage_full(exc, path, f"{what} {path.name}") from None
        raise


@contextlib.contextmanager
def written_hdf5(path: str | Path, what: str, temporary: Path | None = None, storage: set[int] = NAMED_TARGET_ERRNOS,
                 durable: bool = False) -> Iterator[h5py.File]:
    """A new HDF5 file at ``path``, open to write, written whole (:func:`written_whole`: a temporary name, renamed
    once closed) and with what HDF5 reports of a failed write collected into one :class:`StorageFull`
    (:func:`storage_failures`): one line, no part left, no crash."""
    import h5py  # noqa: F811 - loaded by the commands that write HDF5, not by every reader of this module

    with (written_whole(path, what, temporary, storage, durable) as tmp,
          storage_failures(path, f"{what} {Path(path).name}"), h5py.File(tmp, "w") as file):
        yield file


WRITING: dict[int, list[BaseException]] = {}
"""For each thread inside :func:`storage_failures` (a checkpoint file in the main thread, the results file in the
writer's), the storage errors HDF5 reported there as h5py freed its objects; a thread whose write failed keeps its
entry, since HDF5 goes on reporting as the file's objects go, until the process ends."""


def _collector(error: BaseException | None) -> list[BaseException] | None:
    """Where a storage error reported in this thread goes, if the thread is writing (else nowhere: printed)."""
    failed = WRITING.get(threading.get_ident())
    return failed if failed is not None and error is not None and storage_errno(error) is not None else None


def _inside_h5py(trace: TracebackType | None) -> bool:
    """Whether every frame of ``trace`` is h5py's own (its compiled modules': a freed object's report), so none is
    a caller's: an exception that reached the top of a thread has the thread's frames."""
    frames = list(traceback.walk_tb(trace))
    return bool(frames) and all("h5py" in Path(frame.f_code.co_filename).parts for frame, _ in frames)


def _collect_reports() -> None:
    """Python's hooks for errors it cannot raise (``sys.unraisablehook``, and ``sys.excepthook``, through which
    Cython prints a freed object's error in full first) routed through :data:`WRITING`, once: a hook pair saved
    and put back by each write would, for two threads' writes that overlap, put back the other's."""
    previous, printed = sys.unraisablehook, sys.excepthook
    if getattr(previous, "collects_storage_errors", False):
        return

    def collect(unraisable: sys.UnraisableHookArgs) -> None:
        failed = _collector(unraisable.exc_value)
        if failed is None:
            previous(unraisable)
        else:
            failed.append(unraisable.exc_value)  # type: ignore[arg-type]

    def quiet(kind: type[BaseException], value: BaseException, trace: TracebackType | None) -> None:
        # only what h5py prints of a freed object's error: an error that ends the thread is printed as always
        if _collector(value) is None or not _inside_h5py(trace):
            printed(kind, value, trace)

    collect.collects_storage_errors = True  # type: ignore[attr-defined]
    sys.unraisablehook, sys.excepthook = collect, quiet


@contextlib.contextmanager
def storage_failures(path: str | Path, what: str) -> Iterator[list[BaseException]]:
    """Around a write into an HDF5 file kept open: the storage errors HDF5 reports in this thread while h5py frees
    its objects ("Exception ignored in ObjectID.__dealloc__", dozens of tracebacks on a full disk) are collected
    instead of printed, beside any the block appends to the list it is given; if there were any, whatever the block
    raises, or its end, raises :class:`StorageFull` for them, marked unsafe (:func:`_unsafe`). Other errors pass as
    they are. Other threads' reports go where they went."""
    _collect_reports()
    thread, failed = threading.get_ident(), list[BaseException]()
    WRITING[thread] = failed
    try:
        yield failed
    except Exception as exc:  # after HDF5 has failed, h5py may raise anything (an invalid identifier: KeyError...)
        storage = [error for error in (exc, *failed) if storage_errno(error) is not None]
        if not storage:
            del WRITING[thread]
            raise
        raise _unsafe(storage_full(storage[0], path, what)) from None
    except BaseException:  # (KeyboardInterrupt, a stop): no write of this thread's is collected any more
        del WRITING[thread]
        raise
    storage = [error for error in failed if storage_errno(error) is not None]
    if storage:
        raise _unsafe(storage_full(storage[0], path, what))
    del WRITING[thread]


FAILED_HDF5: list[object] = []
"""What this process holds of HDF5 writes that failed half-way (an open results file, a checkpoint file's error with
the frames that hold its datasets): never freed, since HDF5 crashes freeing them, even in its own clean-up at exit."""


def _unsafe(error: StorageFull) -> StorageFull:
    """``error``, kept with the HDF5 objects its traceback holds (:data:`FAILED_HDF5`), so that the process ends
    through :func:`storage_exit`."""
    FAILED_HDF5.append(error)
    return error


def storage_exit(code: int) -> int:
    """``code``, the exit code of a command a failure ended; where an HDF5 write failed in this process (whatever
    caught it: a worker's checkpoint file on rank 0's process too), the process ends here at once, its output
    flushed, without the interpreter's and HDF5's clean-up: HDF5 crashes (a segmentation fault) closing a file whose
    write failed."""
    if FAILED_HDF5:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
