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

import errno
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

STORAGE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO}
"""The errors of the storage itself (full, over quota, read-only, failing), not of the path or the program."""
MARGIN, SLACK = 1.25, 1 << 20
"""A write is started only when the free space holds its estimate times MARGIN plus SLACK bytes (HDF5's metadata,
the chunks a column grows by)."""


class StorageFull(OSError):
    """A write the file system could not take, or would not have room for: one line for the user."""


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


def size(amount: float) -> str:
    """Bytes as a person reads them (1.2 MB, 300 kB)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if amount >= scale:
            return f"{amount / scale:.1f} {unit}"
    return f"{int(amount)} B"


def arrays_bytes(arrays: Iterable[np.ndarray]) -> int:
    return sum(int(np.asarray(a).nbytes) for a in arrays)


def ensure_room(path: str | Path, need: float, what: str) -> None:
    """Raise :class:`StorageFull` unless the file system of ``path`` has room for ``need`` bytes of ``what`` (with
    :data:`MARGIN` and :data:`SLACK`)."""
    wanted = need * MARGIN + SLACK
    free = free_bytes(path)
    if free < wanted:
        raise StorageFull(errno.ENOSPC, f"the file system at {mount_point(path)} has {size(free)} free; {what} needs "
                          f"about {size(wanted)}")


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
    return StorageFull(code, f"the file system at {mount_point(path)} could not take {what}: {os.strerror(code)} "
                       f"({size(free_bytes(path))} free)")
