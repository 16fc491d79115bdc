"""The jobs of one gpu_check launch, one after another in this process (on every rank of the launch): a stage
pays the interpreter's, torch's, MPI's and CUDA's start once per launch instead of once per job (≈ 5 s each on
the lent GPU machine of 2026-11-28: issue 44).

    python benchmarks/gpu_runs.py MANIFEST STATUS            (under mpirun -n P for P ranks)

MANIFEST: a JSON list of {"config", "out", "log"}. Each job is ``mpifl run CONFIG --out OUT --quiet`` as the
command line runs it, its output (every rank's, native writes included) appended to LOG. Rank 0 appends
``start I`` before the manifest's job I and ``end I CODE SECONDS`` after it to STATUS: gpu_check reads it as it grows,
stops a job past its cap, and where a failure ended the whole launch (MPI_Abort) starts the jobs left in a new
one. Exit code 0 once every job has run (each job's own exit code is in STATUS); a job that fails or is stopped
by a signal ends the launch with its exit code, so that the jobs left start in a fresh process.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


@contextmanager
def output_to(log: Path, errors: Path | None = None) -> Iterator[None]:
    """This process's stdout and stderr (file descriptors 1 and 2, so C and MPI writes too) appended to ``log``
    (stderr to ``errors`` instead, if given: tests/batch.py keeps them apart)."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    targets = [os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) for path in (log, errors) if path]
    try:
        os.dup2(targets[0], 1)
        os.dup2(targets[-1], 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*targets, *saved):
            os.close(fd)


def run(job: dict[str, str]) -> int:
    """One job, as ``python -m mpifl run`` would run it."""
    return run_mpifl(["run", job["config"], "--out", job["out"], "--quiet"])


def run_mpifl(argv: list[str]) -> int:
    """``python -m mpifl ARGV`` in this process; an exception mpifl lets through is its failure."""
    from mpifl.cli import main

    try:
        return main(argv)
    except SystemExit as exc:  # argparse's
        return exc.code if isinstance(exc.code, int) else 1
    except Exception:  # noqa: BLE001 - written into the job's log, and the next job runs
        traceback.print_exc()
        return 1


def main(argv: list[str]) -> int:
    from mpi4py import MPI

    import mpifl.runtime.launch  # noqa: F401 - torch and mpifl's runtime: the launch's start, not its first job's

    comm = MPI.COMM_WORLD
    manifest, status = Path(argv[0]), Path(argv[1])
    for index, job in enumerate(json.loads(manifest.read_text())):
        if comm.rank == 0:
            with open(status, "a") as out:
                out.write(f"start {index}\n")
        began = time.monotonic()
        with output_to(Path(job["log"])):
            code = run(job)
        # every rank is done with this job before the next starts (and before rank 0 says so), and they agree on
        # its exit code (the worst), so that all go on or all stop
        code = comm.allreduce(code, op=MPI.MAX)
        if comm.rank == 0:
            with open(status, "a") as out:
                out.write(f"end {index} {code} {time.monotonic() - began:.2f}\n")
        if code:  # stopped at a signal (the launch is being ended), or failed: the jobs left start afresh, not in
            return code  # whatever state the failure left (a CUDA error spoils the process's context)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
