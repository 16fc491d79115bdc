"""How this job was launched, so that the command printed to continue it launches it the same way.

Open MPI's ``mpirun`` passes its options to no rank (its environment names the tool, ``OMPI_TOOL_NAME``, and the
rank count, but not ``--oversubscribe``, ``--bind-to`` or ``--host``), so rank 0 reads them from the launcher's
own command line: Linux's ``/proc/PPID/cmdline`` of its parent, which is ``mpirun`` (exec'd as ``prterun``) when
rank 0 runs on the node ``mpirun`` was started on, as it does by default. The options are what stands between
the launcher's name and this process's own command (``sys.orig_argv``). Elsewhere (rank 0 on another node,
``srun``, another MPI) the command falls back to ``mpirun -n P`` or ``srun -n P``. Recorded in the results file
(``launcher``), so ``report`` and a refused re-run print the same command.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path


def _parent_argv() -> list[str]:
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return []
    return [os.fsdecode(a) for a in raw.split(b"\0")[:-1]]


def launcher_prefix(size: int) -> str:
    """The words before ``python -m mpifl ...`` that launched this job of ``size`` ranks: ``mpirun`` with the
    options it was given (``mpirun -n 3 --oversubscribe``), ``mpirun -n P`` or ``srun -n P`` where they cannot
    be read, ``""`` for a single process."""
    if size == 1:
        return ""
    tool = os.environ.get("OMPI_TOOL_NAME")
    if tool is None:
        return f"srun -n {size}" if "SLURM_STEP_ID" in os.environ else f"mpirun -n {size}"
    parent, own = _parent_argv(), list(sys.orig_argv)
    app = len(parent) - len(own)
    if app >= 1 and parent[app + 1:] == own[1:] and Path(parent[app]).name == Path(own[0]).name:
        return shlex.join([tool, *parent[1:app]])
    return f"{tool} -n {size}"
