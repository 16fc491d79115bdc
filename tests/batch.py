"""Many ``mpifl`` command lines in one launch, one after another in this process on every rank, so that a family
of test cases pays the interpreter's, torch's and MPI's start once (as ``benchmarks/gpu_runs.py`` batches the
GPU check's jobs):

    python -m tests.batch MANIFEST STATUS            (under mpirun -n P for P ranks)
    python -m tests.batch --serve FOLDER OWNER       (the same, for jobs handed over one at a time)

MANIFEST: a JSON list of {"argv", "env", "log"} (and "cwd", where a job runs in another folder). Each job is
``mpifl ARGV`` as the command line runs it, with the environment variables ENV set for it; every rank's stdout
and stderr (file descriptors 1 and 2, so native writes too) go to LOG.RANK.out and LOG.RANK.err. Rank 0 appends
``end I CODE`` to STATUS after job I, CODE being the worst exit code of the ranks. A job that ends the launch
(``MPI_Abort``) leaves no ``end`` line: :func:`tests.conftest.run_mpifl_batch` then starts the jobs after it in a
new launch.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.gpu_runs import output_to, run_mpifl
from mpifl.comm.transport import wait_without_spinning


def run(argv: list[str], env: dict[str, str], cwd: str | None = None) -> int:
    """One job, as ``python -m mpifl ARGV`` would run it (in folder ``cwd``, if given, with the variables ``env``
    set for it)."""
    before = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    folder = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        return run_mpifl(argv)
    finally:
        os.chdir(folder)
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


IDLE_POLL_S = 0.01
"""How often a serving launch looks for its next job: each of its ranks wakes a hundred times a second, a
fraction of a percent of a core, however long the tests between its jobs take."""


def run_everywhere(job: dict) -> int:
    """``job`` on every rank of the world, its output to its logs; the worst exit code of the ranks, known to each
    when all are done with it."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    with output_to(Path(f"{job['log']}.{comm.rank}.out"), Path(f"{job['log']}.{comm.rank}.err")):
        code = run(job["argv"], job.get("env", {}), job.get("cwd"))
    gc.collect()  # an engine's reference cycles hold its data and models until a full collection: not into the next job
    return comm.allreduce(code, op=MPI.MAX)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def serve(folder: Path, owner: int) -> int:
    """Run FOLDER/job0.json, job1.json, ... as they appear, until FOLDER/stop does or process ``owner`` ends
    (module docstring)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    index = 0
    while True:
        job_file = folder / f"job{index}.json"
        if comm.rank == 0:
            while not job_file.exists() and not (folder / "stop").exists() and alive(owner):
                time.sleep(IDLE_POLL_S)
        wait_without_spinning(comm.Ibarrier(), longest=IDLE_POLL_S)  # the others wait for rank 0 asleep
        job = comm.bcast(json.loads(job_file.read_text()) if comm.rank == 0 and job_file.exists() else None)
        if job is None:
            return 0
        code = run_everywhere(job)
        if comm.rank == 0:
            (folder / f"end{index}.part").write_text(str(code))
            (folder / f"end{index}.part").rename(folder / f"end{index}")
        index += 1


def main(argv: list[str]) -> int:
    if argv[0] == "--serve":
        return serve(Path(argv[1]), int(argv[2]))
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    manifest, status = Path(argv[0]), Path(argv[1])
    for index, job in enumerate(json.loads(manifest.read_text())):
        code = run_everywhere(job)  # every rank is done with the job before the next starts
        if comm.rank == 0:
            with open(status, "a") as out:
                out.write(f"end {index} {code}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
