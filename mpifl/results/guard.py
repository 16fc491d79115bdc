"""Claiming an output before anything is written to it: no command replaces a user's file, a completed run or an
unfinished one unless told to, and two runs never write one results file at once.

A run's results file is claimed by :func:`claim_results` on rank 0 during set-up, before any training: the path
must be free, or hold an mpifl results file that the command may take (``--resume`` an unfinished run,
``--overwrite`` any run). The claim holds an exclusive lock (``fcntl.lockf`` on a lock file beside the output, so
it also works on NFS and Lustre with locking enabled) for the run's whole life; the kernel drops it when the
process ends, however it ends, so a killed run never leaves a stale lock. Other outputs (a prepared dataset, a
plot, an export) are refused when they exist unless ``--overwrite`` is given (:func:`refuse_existing`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import platform
import shlex
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import h5py

from mpifl.results.layout import CHECKPOINT_PENDING, open_results_file, plain, rounds_completed, shard_dir
from mpifl.results.writing import check_names, check_writable, creating_name
from mpifl.schema import ConfigError

UNFINISHED = ("running", "interrupted", "failed")
"""The statuses of a run that did not complete: its file is the only record of the rounds it did."""

CHECKPOINT_DEFAULTS = {"checkpoint_every": 0, "checkpoint_minutes": 10}
"""What a results file written before a checkpoint setting existed ran with."""


@dataclass(frozen=True)
class OutputState:
    """What a path holds, as far as claiming it is concerned, and where the run in it stands: the one account
    that ``run`` (its refusals, ``--resume``), ``report`` (text, ``--json``, a folder's summary) and ``sweep``
    give."""

    path: Path
    kind: str  # "absent", "foreign" (a file that is not an mpifl results file) or "results"
    status: str | None = None  # a results file's attribute: running | completed | interrupted | failed
    config: str | None = None  # the YAML config it was written with
    rounds_completed: int = 0
    checkpoint_round: int | None = None  # the round of the checkpoint it holds, if any
    launcher: str = ""  # how its last segment was launched ("mpirun -n 3 --oversubscribe"; "": one process)

    @property
    def unfinished(self) -> bool:
        return self.kind == "results" and self.status in UNFINISHED

    @functools.cached_property  # a snapshot, as the rest of the state is
    def condition(self) -> str | None:
        """The run's status as it really is: the file's, except that a file still marked "running" whose lock no
        live process holds was stopped without a word (``kill -9``, a lost node, mpirun's Ctrl-C): "stopped"."""
        if self.status == "running" and not being_written(self.path):
            return "stopped"
        return self.status

    @functools.cached_property
    def settings(self) -> dict[str, object]:
        """The run's config as stored (a mapping; empty if it does not parse)."""
        import yaml

        try:
            raw = yaml.safe_load(self.config or "")
        except yaml.YAMLError:
            raw = None
        return raw if isinstance(raw, dict) else {}

    def where(self) -> str:
        """``stopped at round R of N`` (or ``running, R of N rounds so far``): the start of :meth:`standing`."""
        of = f" of {self.settings['rounds']}" if "rounds" in self.settings else ""
        if self.condition == "running":
            return f"running, {self.rounds_completed}{of} rounds so far"
        return f"{self.condition} at round {self.rounds_completed}{of}"

    def standing(self) -> str | None:
        """Where an unfinished run stands, as one sentence that names the cure: still running, or stopped and
        resumable from which round (with the command), or stopped and not resumable (``None``: completed)."""
        if not self.unfinished:
            return None
        if self.condition == "running":
            return f"{self.where()}: a process holds its lock"
        if self.checkpoint_round is None:
            return f"{self.where()}, not resumable (no checkpoint): --overwrite starts it again"
        return (f"{self.where()}, resumable from round {self.checkpoint_round}: "
                f"{resume_command(self.path, self.launcher)} (any rank count)")

    def without_checkpoint(self) -> str:
        """Why ``--resume`` cannot continue this run (it holds no checkpoint), with the settings that would have
        saved one and what is lost."""
        settings = {key: self.settings.get(key, default) for key, default in CHECKPOINT_DEFAULTS.items()}
        minutes, every = f"{float(str(settings['checkpoint_minutes'])):g}", settings["checkpoint_every"]
        taken = (f"checkpoint_minutes: {minutes} takes one after each {minutes} minutes of training"
                 if minutes != "0" else "checkpoint_minutes: 0 takes none by time")
        taken += f", checkpoint_every: {every} " + (f"one every {every} rounds" if every else "none by round")
        if self.status == "completed":
            return (f"--resume: {self.path} holds a completed run of {self.rounds_completed} rounds but no checkpoint "
                    f"to extend it from ({taken}); --overwrite with --set rounds=N runs it again, longer")
        return (f"--resume: {self.path} holds no checkpoint: the run {self.where()}, before its first ({taken}); "
                f"its {self.rounds_completed} rounds are lost: --overwrite starts it again (a smaller "
                "checkpoint_minutes or a checkpoint_every > 0 loses less next time)")


def inspect_output(path: str | Path) -> OutputState:
    """Look at ``path`` without changing it (read-only, no HDF5 file lock: a running job may be writing it). A read
    that falls in a running job's write (a torn read: h5py fails) is tried again, twice at most, as
    ``read_results`` does: a live run's file is never taken for a foreign one."""
    path = Path(path)
    if not path.exists():
        return OutputState(path, "absent")
    if path.is_dir() or not h5py.is_hdf5(path):
        return OutputState(path, "foreign")
    for attempt in range(3):
        try:
            attrs, done, round_ = _state_of(path)
            break
        except (OSError, KeyError, RuntimeError, ValueError):  # h5py's errors for a damaged (truncated) file
            if attempt == 2 or not being_written(path):
                return OutputState(path, "foreign")
            time.sleep(0.2)
    if "config" not in attrs or "status" not in attrs:  # an HDF5 file, but not one of mpifl's results
        return OutputState(path, "foreign")
    ranks = int(attrs.get("world_size", 1))  # a file written before the launcher was recorded: mpirun -n P
    launcher = str(attrs.get("launcher", f"mpirun -n {ranks}" if ranks > 1 else ""))
    return OutputState(path, "results", str(attrs["status"]), str(attrs["config"]),
                       done, round_, launcher)


def _state_of(path: Path) -> tuple[dict, int, int | None]:
    """A results file's attributes, rounds completed and complete checkpoint's round (None: none)."""
    with open_results_file(path, "r", locking=False) as f:
        attrs = {k: plain(v) for k, v in f.attrs.items()}
        old = attrs.get("layout") != "append"  # its checkpoints were written whole, unmarked
        checkpoint = next((f[name] for name in ("checkpoint", CHECKPOINT_PENDING)
                           if name in f and f[name].attrs.get("complete", old)), None)
        round_ = int(checkpoint.attrs["round"]) if checkpoint is not None else None
        return attrs, rounds_completed(f), round_


def resume_command(path: str | Path, launcher: str) -> str:
    """The command that continues the run in results file ``path`` (on any rank count), launched as before
    (``launcher``: the words before ``python``, with the options the run was started with)."""
    return f"{launcher + ' ' if launcher else ''}python -m mpifl run --resume {shlex.quote(str(path))}"


def refusal(state: OutputState, resume: bool, overwrite: bool) -> str | None:
    """Why a run may not write results file ``state.path`` with these flags (``None``: it may)."""
    path = state.path
    if state.kind == "foreign":
        what = "a directory" if path.is_dir() else "a file that is not an mpifl results file"
        return f"output {path}: is {what}; it is never replaced: give another --out"
    if resume:
        if state.kind != "results":
            return f"--resume: results file {path} does not exist"
        return state.without_checkpoint() if state.checkpoint_round is None else None
    if state.kind == "absent" or overwrite:
        return None
    if state.status == "completed":
        return (f"output {path} holds a completed run ({state.rounds_completed} rounds); --overwrite replaces it, "
                "or give another --out")
    if state.checkpoint_round is not None:
        return f"output {path} holds an unfinished run: {state.standing()}; or --overwrite starts it again"
    return f"output {path} holds an unfinished run: {state.standing()}, or give another --out"


def lock_file(path: Path) -> Path:
    """The hidden file beside an output whose lock a writing run holds."""
    return path.with_name(f".{path.name}.lock")


def results_names(path: str | Path, resume: bool) -> tuple[tuple[str, str], ...]:
    """What a run writes beside its results file ``path``, named: the lock, the checkpoint folder and (a new
    file) the temporary name it is created under."""
    path = Path(path)
    names = (("lock file", lock_file(path).name), ("checkpoint folder", shard_dir(path).name))
    return names if resume else (*names, ("temporary file", creating_name(path).name))


def being_written(path: str | Path) -> bool:
    """Whether a live process holds the lock of the run writing ``path``: the kernel drops a killed run's lock, so
    a file whose status still says "running" with no holder was stopped (kill -9, a lost node)."""
    try:
        fd = os.open(lock_file(Path(path)), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        return exc.errno in (errno.EACCES, errno.EAGAIN)
    finally:
        os.close(fd)  # also drops the lock just taken
    return False


class OutputLock:
    """An exclusive lock on an output path, held until :meth:`release` or the end of the process.

    The lock lives on a hidden file beside the output (the output itself is replaced by a rename when it is
    first written, which would leave a lock on the old inode behind). The file is removed on release; a
    claimer that locked a file just removed by its releaser notices (the path no longer names its inode) and
    locks again."""

    def __init__(self, path: Path, fd: int, lock_path: Path):
        self.path, self.fd, self.lock_path = path, fd, lock_path

    @classmethod
    def acquire(cls, path: str | Path) -> OutputLock:
        path = Path(path)
        lock_path = lock_file(path)
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.EACCES, errno.EAGAIN):
                    holder = lock_path.read_text().strip() if lock_path.exists() else "another process"
                    raise ConfigError(f"output {path} is being written by another run ({holder}); wait for it, "
                                      "or give another --out") from None
                if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):  # a file system without locks
                    return cls(path, -1, lock_path)
                raise
            with contextlib.suppress(FileNotFoundError):
                if os.stat(lock_path).st_ino == os.fstat(fd).st_ino:
                    break
            os.close(fd)  # removed by the run that held it, between our open and our lock: lock the new one
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {platform.node()}\n".encode())
        return cls(path, fd, lock_path)

    def release(self) -> None:
        if self.fd >= 0:
            # (a read-only or failing file system keeps the file; closing below frees the lock all the same, and
            # a lock file no process holds is taken over by the next run)
            with contextlib.suppress(OSError):
                self.lock_path.unlink()
            os.close(self.fd)
            self.fd = -1


class ResultsClaim:
    """Rank 0's hold on a run's results file, from set-up to the end of the run: the lock, and what the path held
    before (another run's results, which ``--overwrite`` replaces, checkpoint files and all)."""

    def __init__(self, lock: OutputLock, previous: OutputState, resume: bool):
        self.lock, self.previous = lock, previous
        self.replaces_run = previous.kind == "results" and not resume

    def remove_replaced_checkpoints(self) -> None:
        """The checkpoint files of the run this one replaces, which nothing refers to any more; call it before
        any rank writes a checkpoint of its own."""
        if self.replaces_run:
            for file in shard_dir(self.previous.path).glob("*round*-*.h5*"):
                file.unlink(missing_ok=True)
            self.replaces_run = False

    def release(self) -> None:
        self.lock.release()


def claim_results(path: str | Path, resume: bool, overwrite: bool) -> ResultsClaim:
    """Check that a run may write results file ``path`` (writable, and see :func:`refusal`) and lock it; raises
    :class:`ConfigError` (one line) otherwise, leaving the file untouched."""
    if resume and overwrite:
        raise ConfigError("--resume continues a run and --overwrite starts it again: give one of them")
    check_writable(path, results_names(path, resume))  # first: the lock file is created beside it
    lock = OutputLock.acquire(path)
    state = inspect_output(path)  # under the lock: no other run changes it now
    reason = refusal(state, resume, overwrite)
    if reason is not None:
        lock.release()
        raise ConfigError(reason)
    return ResultsClaim(lock, state, resume)


def refuse_existing(path: str | Path, overwrite: bool, option: str = "--overwrite",
                    ours: Callable[[Path], bool] | None = None) -> None:
    """Refuse to replace an existing file (or a directory) at ``path`` unless ``overwrite``, and, whatever the
    flags, one that ``ours`` does not recognize as this command's own output (a run's results, a README, a CSV of
    the user's under a prepared dataset's name): one line."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"output {path}: is a directory, not a file")
    if path.exists() and ours is not None and not ours(path):
        raise ConfigError(f"output {path}: is not what this command writes; it is never replaced (not even with "
                          f"{option}): give another path")
    if path.exists() and not overwrite:
        raise ConfigError(f"output {path} exists; {option} replaces it, or give another path")


def writable_directory(path: str | Path, what: str) -> Path:
    """Make sure ``path`` is a directory this process can create files in (created if missing), by creating one
    there: permission bits alone say nothing for root, who is refused only by a read-only file system. One line
    (:class:`ConfigError`) otherwise; nothing is left behind."""
    path = Path(path)
    check_names(path, what=what)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what} {path}: is a file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot be written: {exc.strerror or exc}") from None
    return path


def refuse_unless_ours(path: str | Path, ours: str) -> None:
    """Refuse (one line) to replace a file at ``path`` that does not start with ``ours``, the mark that the command
    about to write it wrote it: a user's file of the same name is never replaced."""
    path = Path(path)
    if not path.exists():
        return
    try:
        with open(path, "rb") as f:
            mine = not path.is_dir() and f.read(len(ours.encode())) == ours.encode()
    except OSError:
        mine = False
    if not mine:
        raise ConfigError(f"output {path}: was not written by this command; it is never replaced: move it, or "
                          "report a copy of the results elsewhere")
