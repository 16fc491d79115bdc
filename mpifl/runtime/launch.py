"""Running a job on every rank with the failure behaviour a batch system needs.

* Bad input (config, data) is found during set-up, which runs before any training collective.
  Ranks agree on the outcome with one small ``allgather``; rank 0 prints the first error as one
  line and every rank exits with code 2. Nothing is written.
* Any exception during training, on any rank, prints one line naming that rank and calls
  ``MPI_Abort``, which ends every process of the job at once (no hang, one message). The results
  file keeps the last completed evaluation.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

from mpifl.registry import load_config
from mpifl.schema import ConfigError

EXIT_BAD_INPUT = 2
EXIT_FAILURE = 1


def _error(message: str) -> None:
    sys.stderr.write(f"mpifl: error: {message}\n")
    sys.stderr.flush()


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ConfigError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def _prepare_everywhere(engine, comm) -> int | None:  # noqa: ANN001 - an Engine, an mpi4py Comm
    """Prepare the engine on every rank; the ranks agree on the outcome (one small ``allgather``) and rank 0
    reports the first failure as one line. Returns the exit code of a failed set-up, ``None`` when all went well."""
    rank, size = comm.Get_rank(), comm.Get_size()
    failure = None
    try:
        engine.prepare()
    except Exception as exc:  # noqa: BLE001 - reported once, below, for whichever rank raised
        failure = (rank, isinstance(exc, ConfigError), _describe(exc), traceback.format_exc())
    failures = [f for f in (comm.allgather(failure) if size > 1 else [failure]) if f is not None]
    if not failures:
        return None
    first = failures[0]
    if rank == 0:
        where = f" (rank {first[0]})" if size > 1 and not first[1] else ""
        _error(f"{first[2]}{where}")
        if os.environ.get("MPIFL_DEBUG"):
            sys.stderr.write(first[3])
    return EXIT_BAD_INPUT if all(f[1] for f in failures) else EXIT_FAILURE


def run_job(config_path: str, overrides: list[str], output: str | None, quiet: bool = False,
            resume: str | None = None, profile: bool = False) -> int:
    from mpi4py import MPI

    from mpifl.runtime.engine import Engine

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        cfg = load_config(config_path, overrides)
    except ConfigError as exc:  # identical on every rank: only rank 0 speaks
        if rank == 0:
            _error(str(exc))
        return EXIT_BAD_INPUT

    if resume and output and Path(output) != Path(resume):
        if rank == 0:
            _error("--resume continues writing the file it resumes from; drop --out or make them equal")
        return EXIT_BAD_INPUT
    output = resume or output
    engine = Engine(cfg, comm, output or cfg.output, resume=bool(resume), profile=profile)
    failed = _prepare_everywhere(engine, comm)
    if failed is not None:
        return failed
    if rank == 0 and not quiet:
        start = f"from round {engine.start_round}, " if resume else ""
        print(f"mpifl: {cfg.algorithm} on {cfg.data.source}, {engine.layout.num_clients} clients, "
              f"{size} rank(s), {start}{cfg.rounds} rounds -> {Path(output or cfg.output)}", flush=True)
    try:
        engine.run(progress=not quiet)
    except BaseException as exc:  # noqa: BLE001 - any failure must end the whole job
        engine.settle()
        _error(f"rank {rank} of {size} failed: {_describe(exc)}")
        if os.environ.get("MPIFL_DEBUG"):
            traceback.print_exc()
        if size > 1:
            comm.Abort(EXIT_FAILURE)
        return EXIT_FAILURE
    return 0
