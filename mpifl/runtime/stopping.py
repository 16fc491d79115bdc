"""Stopping a job cleanly when asked to: SIGINT (Ctrl-C), SIGTERM (Slurm's time limit or a preemption under
``srun``, ``kill``) or SIGUSR1 (what ``sbatch --signal=USR1@SECONDS`` sends ahead of the time limit).

Open MPI's ``mpirun`` (5.0.11) forwards SIGUSR1 to every rank and lets the job finish, but answers SIGTERM and
SIGINT (a terminal's Ctrl-C reaches only ``mpirun``: each rank runs in a process group of its own) by ending the
job: it stops forwarding the ranks' output at once, sends them SIGCONT, SIGTERM 0.25 s later and SIGKILL 0.25 s
after that, and exits with code 1. The ranks see SIGTERM right after SIGCONT (:attr:`StopRequest.launcher_ending`):
rank 0 then writes to the terminal itself (``/dev/tty``: the ranks share ``mpirun``'s session, so its controlling
terminal) that the stop is under way and, if the checkpoint is saved before the SIGKILL, the command that
continues the run; what the SIGKILL cuts short is bounded by ``checkpoint_minutes``, and the next ``run`` of the
same command, like ``report``, says where the run stands. A signal only marks the request; the ranks agree at
the end of each round whether any of them was asked (one small all-reduce), so every rank stops after the same
round, saves a checkpoint there and the job can be continued from its results file alone. A second signal stops
at once, as a failure (the last checkpoint then counts).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


LAUNCHER_GAP_S = 2.0
"""At most this long between the SIGCONT and the SIGTERM of ``mpirun`` ending the job (0.25 s measured)."""


def to_terminal(line: str) -> bool:
    """Write ``line`` to this process's controlling terminal, past a launcher that no longer forwards output;
    whether there was one to write to (none under a batch system, or in a session without a terminal)."""
    try:
        fd = os.open("/dev/tty", os.O_WRONLY | os.O_NOCTTY)
    except OSError:
        return False
    try:
        os.write(fd, f"{line}\n".encode())
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


class StopRequest:
    """Whether this process was asked to stop, and by which signal."""

    def __init__(self, announce: bool):
        self.announce = announce  # print one line when asked (rank 0 only: one message per job)
        self.signum = 0  # the first signal received; 0: none
        self.continued_at = -float("inf")  # when the last SIGCONT came (monotonic seconds)
        self.launcher_ending = False  # the stop came from Open MPI's mpirun ending the job (see the module's doc)
        # what rank 0 writes to the terminal then, worked out when it happens (set once the output is known)
        self.terminal_note: Callable[[], str] | None = None
        self.on_request: Callable[[], None] | None = None  # told first when a stop is asked (from the handler)

    @property
    def requested(self) -> bool:
        return self.signum != 0

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "no signal"

    @contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Handle SIGINT, SIGTERM and SIGUSR1 while the block runs (the previous handlers come back after it).
        Only the main thread may install handlers; elsewhere (a test's thread) signals keep their usual effect."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.getsignal(s) for s in (*HANDLED, signal.SIGCONT)}
        for s in HANDLED:
            signal.signal(s, self._handle)
        signal.signal(signal.SIGCONT, self._continued)  # the kernel continues the process whatever the handler
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _continued(self, signum: int, frame: FrameType | None) -> None:
        self.continued_at = time.monotonic()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt(f"a second {signal.Signals(signum).name}: stopped at once")
        self.signum = signum
        if self.on_request is not None:
            self.on_request()
        self.launcher_ending = ("OMPI_TOOL_NAME" in os.environ and signum != signal.SIGUSR1
                                and time.monotonic() - self.continued_at < LAUNCHER_GAP_S)
        if self.launcher_ending and self.terminal_note is not None:
            to_terminal(self.terminal_note())
        if self.announce:
            sys.stderr.write(f"mpifl: {self.signal_name}: stopping after the round under way and saving a "
                             "checkpoint (send it again to stop at once)\n")
            sys.stderr.flush()
