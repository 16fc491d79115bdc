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
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import TracebackType

import numpy as np

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

    hdf5_unsafe = False  # an HDF5 file's write failed half-way: end the process without freeing it (see _unsafe)
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


@contextlib.contextmanager
def written_whole(path: str | Path, what: str, temporary: Path | None = None,
                  storage: set[int] = NAMED_TARGET_ERRNOS) -> Iterator[Path]:
    """A temporary name beside ``path`` (``temporary``, else ``.NAME.tmp-PID``) to write a file under; renamed to
    ``path`` once written, removed if the write fails, so ``path`` is the old file or the whole new one, never a
    part (a plot, a summary, a CSV export, a checkpoint file on a file system that fills). An error of ``storage``
    becomes :class:`StorageFull`."""
    path = Path(path)
    tmp = temporary or path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):  # (a read-only or failing file system keeps it: nothing removes it)
            tmp.unlink(missing_ok=True)
        if storage_errno(exc) in storage:
            raise storage_full(exc, path, f"{what} {path.name}") from None
        raise


@contextlib.contextmanager
def storage_failures(path: str | Path, what: str) -> Iterator[list[BaseException]]:
    """Around a write into an HDF5 file kept open: the storage errors HDF5 reports in this thread while h5py frees
    its objects ("Exception ignored in ObjectID.__dealloc__", dozens of tracebacks on a full disk) are collected
    instead of printed, beside any the block appends to the list it is given; if there were any, whatever the block
    raises, or its end, raises :class:`StorageFull` for them, marked unsafe (:func:`_unsafe`). Other errors pass as
    they are. Other threads' reports go to the hooks as before."""
    failed: list[BaseException] = []
    writer = threading.get_ident()
    previous, printed = sys.unraisablehook, sys.excepthook

    def ours(error: BaseException | None) -> bool:
        return threading.get_ident() == writer and error is not None and storage_errno(error) is not None

    def collect(unraisable: sys.UnraisableHookArgs) -> None:
        if ours(unraisable.exc_value):
            failed.append(unraisable.exc_value)  # type: ignore[arg-type]
        else:
            previous(unraisable)

    def quiet(kind: type[BaseException], value: BaseException, trace: TracebackType | None) -> None:
        # Cython prints a freed object's error in full (PyErr_PrintEx, through sys.excepthook) before the hook above
        if not ours(value):
            printed(kind, value, trace)

    sys.unraisablehook, sys.excepthook = collect, quiet
    try:
        yield failed
    except Exception as exc:  # after HDF5 has failed, h5py may raise anything (an invalid identifier: KeyError...)
        storage = [error for error in (exc, *failed) if storage_errno(error) is not None]
        if not storage:
            sys.unraisablehook, sys.excepthook = previous, printed
            raise
        raise _unsafe(storage_full(storage[0], path, what)) from None
    storage = [error for error in failed if storage_errno(error) is not None]
    if storage:
        raise _unsafe(storage_full(storage[0], path, what))
    # (after a failure both stay: HDF5 reports more as the file's objects go, until the process ends)
    sys.unraisablehook, sys.excepthook = previous, printed


def _unsafe(error: StorageFull) -> StorageFull:
    """``error``, marked as leaving an HDF5 file that must not be touched again, not even by the interpreter's
    garbage collection at exit (:attr:`StorageFull.hdf5_unsafe`: the process ends at once after reporting it)."""
    error.hdf5_unsafe = True
    return error
