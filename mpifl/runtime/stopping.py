"""Stopping a job cleanly when asked to: SIGINT (Ctrl-C), SIGTERM (Slurm's time limit or a preemption under
``srun``, ``kill``) or SIGUSR1 (what ``sbatch --signal=USR1@SECONDS`` sends ahead of the time limit).

Open MPI's ``mpirun`` (5.0.11) forwards SIGUSR1 to every rank and lets the job finish, but answers SIGTERM and
SIGINT by killing the ranks (SIGCONT, SIGTERM 0.25 s later, SIGKILL soon after; exit code 1): under ``mpirun``, ask
with SIGUSR1 (``jobs/*.sbatch`` do), or send SIGINT to the ranks, each in a process group of its own (a terminal's
Ctrl-C reaches only ``mpirun``); what such a kill loses is bounded by ``checkpoint_minutes``. A signal
only marks the request; the ranks agree at the end of each round whether any of them was asked (one
small all-reduce), so every rank stops after the same round, saves a checkpoint there and the job can be continued
from its results file alone. A second signal stops at once, as a failure (the last checkpoint then counts).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Whether this process was asked to stop, and by which signal."""

    def __init__(self, announce: bool):
        self.announce = announce  # print one line when asked (rank 0 only: one message per job)
        self.signum = 0  # the first signal received; 0: none

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
        previous = {s: signal.getsignal(s) for s in HANDLED}
        for s in HANDLED:
            signal.signal(s, self._handle)
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            raise KeyboardInterrupt(f"a second {signal.Signals(signum).name}: stopped at once")
        self.signum = signum
        if self.announce:
            sys.stderr.write(f"mpifl: {self.signal_name}: stopping after the round under way and saving a "
                             "checkpoint (send it again to stop at once)\n")
            sys.stderr.flush()
