"""Shared fixtures: a tiny digits config and helpers to run mpifl in-process or under mpirun."""

from __future__ import annotations

import copy
import functools
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch
import yaml

from benchmarks.gpu_check import kill_session
from mpifl.comm.transport import arrive_together

REPO = Path(__file__).resolve().parents[1]

LOCAL_MPI = {"OMPI_MCA_btl": "self,vader,tcp", "OMPI_MCA_btl_tcp_if_include": "lo", "OMPI_MCA_oob_tcp_if_include": "lo",
             "OMPI_MCA_mpi_yield_when_idle": "1"}
"""Open MPI on shared memory and TCP loopback, in pytest's processes and every one the tests start (where neither
the caller nor a test sets its own): no test depends on the host's network, and no MPI start-up waits the second
that the Open MPI wheel's libfabric transport (btl ofi) sleeps in when MPI_Init closes it (`python -c "from mpi4py
import MPI"`: 1.1 s, 0.09 s without it). A rank that waits yields its core, as Open MPI's ranks do by default only
where they outnumber the cores: a 2-rank job's waiting rank took a quarter of the CPU from a process beside it."""
for _name, _value in LOCAL_MPI.items():
    os.environ.setdefault(_name, _value)

TINY = {
    "algorithm": "fedavg",
    "rounds": 3,
    "clients_per_round": 4,
    "seed": 7,
    "eval_every": 1,
    "data": {"dataset": "digits", "num_clients": 10, "partition": "iid", "unseen_fraction": 0.2},
    "model": {"name": "cnn", "channels": [4], "fc_hidden": 16},
    "client": {"lr": 0.1, "epochs": 1, "batch_size": 16},
}


HANG_S = 600
"""The bound on every wait in the tests (a subprocess, a job's next write, a daemon coming up): what catches a
hang, never a pace. The suite runs on shared 2-core machines where a job can take many times its quiet-machine
time, so no test asserts how long something took."""


CUDA_ONLY = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
"""The marks of a test (or a ``pytest.param``) that needs a CUDA GPU: skipped without one, and selected by
``pytest -m cuda``, which is how scripts/gpu_check.sh runs exactly the GPU tests."""


def needs_cuda(test: Callable) -> Callable:
    """``@needs_cuda``: :data:`CUDA_ONLY` on a test function."""
    for mark in CUDA_ONLY:
        test = mark(test)
    return test


def rank_dependent(column: str) -> bool:
    """Results columns that legitimately differ with the rank count or the machine: timings, where
    clients lived, and how evenly a round's work was spread."""
    return column in ("owner", "load_imbalance") or column.endswith(("time_s", "seconds"))


LAUNCH = re.compile(r"subprocess|Popen|run_mpifl|mpirun|\branks=[1-9]|assert_rank_invariant|_offline\(|_setup\(|"
                    r"\bgpu_check\(")
"""What a test's own source says when it starts processes (mpirun, ``python -m mpifl``, setup.sh): such a
test is marked ``launches`` and left out of the quick tier (scripts/test_quick.sh), as is every test that
shares a fixture built once per module or session, and the :data:`SERIAL` ones."""
RUNS = re.compile(r"\brun\w*\(|main\(\[\"(run|sweep|prepare)\"|\bEngine\(|\bload_sweep\(")
"""What a test's own source says when it runs a whole job in this process (``main(["run", ...])``,
``run_engine``, ``run_algo``, a file's own ``run(...)`` helper, an evidence sweep's smoke runs): such a test is
marked ``runs`` and left out of the quick tier too, which keeps the unit-level tests."""
ALONE = ("tests/multinode/test_netmodel.py",)
"""Tests that measure wall time against a model (shaped links): marked ``alone``, which scripts/test.sh runs
after the two-worker run, with nothing else of the suite beside them."""
SERIAL = ("tests/slurm/", "tests/multinode/")
"""Tests that start daemons on fixed ports (a local Slurm) or build network-namespace nodes and measure shaped
links: under pytest-xdist they run one at a time, on one worker (:func:`pytest_collection_modifyitems`)."""


@functools.cache
def _what_it_starts(function: Callable) -> tuple[bool, bool]:
    """Whether a test function's source starts processes (:data:`LAUNCH`) and runs a whole job (:data:`RUNS`):
    read once per function, not once per parametrized case (every pytest process collects the suite)."""
    source = inspect.getsource(function)
    return bool(LAUNCH.search(source)), bool(RUNS.search(source))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups into the test ids (its own hook)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The ``launches`` mark (see :data:`LAUNCH`), and groups for ``pytest -n 2 --dist loadgroup`` (how
    scripts/test.sh runs this suite): the tests that share a fixture built once per module or session (a
    wheelhouse, a reference run, a prepared image) go to one worker, so it is still built once; the
    :data:`SERIAL` tests go to one worker together. Without xdist the groups do nothing."""
    parent: dict[str, str] = {}

    def root(name: str) -> str:
        while parent.setdefault(name, name) != name:
            name = parent[name]
        return name

    shared: dict[str, list[str]] = {}
    for item in items:
        path = item.path.relative_to(REPO).as_posix() if item.path.is_relative_to(REPO) else ""
        names = ["serial"] if path.startswith(SERIAL) else []
        if path.startswith(ALONE):
            item.add_marker(pytest.mark.alone)
        info = getattr(item, "_fixtureinfo", None)
        for name, defs in (info.name2fixturedefs.items() if info is not None else ()):
            if defs[-1].scope != "function" and defs[-1].baseid:  # built once, by a test file (not pytest's own)
                names.append(f"{defs[-1].baseid}::{name}")
        for name in names[1:]:
            parent[root(name)] = root(names[0])
        shared[item.nodeid] = names
        function = getattr(item, "function", None)
        launches, runs = _what_it_starts(function) if function is not None else (False, False)
        if names or launches:
            item.add_marker(pytest.mark.launches)
        if runs:
            item.add_marker(pytest.mark.runs)
    for item in items:
        if shared[item.nodeid]:
            item.add_marker(pytest.mark.xdist_group(root(shared[item.nodeid][0])))
    if config.getoption("dist", "no") == "loadgroup":
        # the groups are the longest units of work (a Slurm, namespace nodes, a wheelhouse, a GPU image): handed
        # out first, they run beside the many short tests instead of leaving one worker busy at the end
        items.sort(key=lambda item: not shared[item.nodeid])


@pytest.fixture(autouse=True)
def _no_stale_mpi_session_dirs() -> Iterator[None]:
    """After each test, remove the session folders (``ompi.<pid>`` in the temporary folder) of mpiruns that are
    gone: a SIGKILLed mpirun leaves its PMIx files there, and a later mpirun that happens to get the same pid
    then fails to start ("The PMIx server's listener thread failed to start"; seen once in a clean-clone run)."""
    yield
    for folder in Path(tempfile.gettempdir()).glob("ompi.*"):
        pid = folder.name.removeprefix("ompi.")
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def mpi_env() -> dict[str, str]:
    env = dict(os.environ)
    # the checkout first; what PYTHONPATH held stays after it (packages installed with pip --target, as on a GPU
    # image whose environment is read-only: docs/how-to/gpus.md)
    pythonpath = os.pathsep.join(path for path in (str(REPO), os.environ.get("PYTHONPATH")) if path)
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONPATH=pythonpath)
    return env  # with LOCAL_MPI


def mpirun_cmd(n: int) -> list[str]:
    mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""))
    if mpirun is None:
        pytest.skip("mpirun not found (run scripts/setup.sh)")
    return [mpirun, "-n", str(n), "--oversubscribe"]


def run_mpifl(args: list[str], ranks: int = 0, timeout: float = HANG_S,
              own_launch: bool = False) -> subprocess.CompletedProcess:
    """Run ``python -m mpifl ARGS`` as a process of its own, or on ``ranks`` > 0 ranks: in this pytest process's
    :class:`Launch` of that many, or with ``own_launch`` under an ``mpirun -n ranks`` of its own (a job that ends
    its launch with ``MPI_Abort``, which loses what coverage.py had recorded of the launch's jobs before it)."""
    if ranks and not own_launch:
        return Launch.run(args, ranks)
    cmd = (mpirun_cmd(ranks) if ranks else []) + [sys.executable, "-m", "mpifl", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=mpi_env(), cwd=REPO)


def run_mpifl_batch(jobs: list[list[str]], ranks: int, folder: Path,
                    env: list[dict[str, str]] | None = None) -> list[subprocess.CompletedProcess]:
    """``python -m mpifl JOB`` for every job, as :func:`run_mpifl` runs one, but all in one launch (``mpirun -n
    ranks``, or one process when ranks = 0): one result per job, its stdout and stderr every rank's (tests/batch.py).
    A job that ends its launch (``MPI_Abort``) gets the launch's exit code and output, and the jobs after it run
    in a new launch. Jobs on ranks > 0 with no environment of their own run in this pytest process's
    :class:`Launch` of that many ranks."""
    if ranks and env is None:
        return [Launch.run(job, ranks) for job in jobs]
    folder.mkdir(parents=True, exist_ok=True)
    envs = env or [{}] * len(jobs)

    def logs(i: int) -> tuple[str, str]:
        ranks_logs = sorted(folder.glob(f"job{i}.*"))
        return tuple("".join(p.read_text() for p in ranks_logs if p.suffix == kind) for kind in (".out", ".err"))

    results: list[subprocess.CompletedProcess] = []
    while len(results) < len(jobs):
        first = len(results)
        manifest, status = folder / f"manifest{first}.json", folder / f"status{first}"
        manifest.write_text(json.dumps([{"argv": jobs[i], "env": envs[i], "log": str(folder / f"job{i}")}
                                        for i in range(first, len(jobs))]))
        cmd = (mpirun_cmd(ranks) if ranks else []) + [sys.executable, "-m", "tests.batch", str(manifest), str(status)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, env=mpi_env(), cwd=REPO)
        for line in status.read_text().splitlines() if status.exists() else []:
            i = first + int(line.split()[1])
            results.append(subprocess.CompletedProcess(jobs[i], int(line.split()[2]), *logs(i)))
        if len(results) < len(jobs):  # the next job ended the launch (or the launch never started)
            assert proc.returncode != 0, proc.stderr
            out, err = logs(len(results))
            results.append(subprocess.CompletedProcess(jobs[len(results)], proc.returncode, out + proc.stdout,
                                                       err + proc.stderr))
    return results


class Launch:
    """One ``mpirun -n ranks`` of ``python -m tests.batch --serve`` that this pytest process keeps and hands jobs
    to, one at a time, as the tests come: each job is ``python -m mpifl ARGS`` as :func:`run_mpifl` runs it,
    without a new launch's start (every rank's imports of torch and MPI, two seconds of CPU each). The launch ends
    with the test session (:func:`pytest_sessionfinish`), or with a job that ends it (``MPI_Abort``): the next job
    then gets a new one."""

    running: dict[int, Launch] = {}
    """The live launch of each rank count."""

    def __init__(self, ranks: int):
        self.folder = Path(tempfile.mkdtemp(prefix=f"mpifl-launch{ranks}-"))
        self.ranks, self.jobs = ranks, 0
        with open(self.folder / "launch.out", "w") as out, open(self.folder / "launch.err", "w") as err:
            self.proc = subprocess.Popen(mpirun_cmd(ranks) + [sys.executable, "-m", "tests.batch", "--serve",
                                                             str(self.folder), str(os.getpid())],
                                         stdout=out, stderr=err, env=mpi_env(), cwd=REPO, start_new_session=True)

    @classmethod
    def run(cls, args: list[str], ranks: int, cwd: Path | None = None) -> subprocess.CompletedProcess:
        """``python -m mpifl ARGS`` on ``ranks`` ranks (in folder ``cwd``, else the checkout), in this process's
        launch of that many (started if none)."""
        launch = cls.running.get(ranks)
        if launch is None or launch.proc.poll() is not None:
            if launch is not None:  # a job ended it: its folder goes too
                launch.close()
            launch = cls.running[ranks] = cls(ranks)
        return launch.job(args, cwd)

    def job(self, args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
        index, self.jobs = self.jobs, self.jobs + 1
        log = self.folder / f"log{index}"
        (self.folder / "next").write_text(json.dumps({"argv": args, "log": str(log), "cwd": str(cwd or REPO)}))
        (self.folder / "next").rename(self.folder / f"job{index}.json")
        end, deadline = self.folder / f"end{index}", time.monotonic() + HANG_S
        while not end.exists() and self.proc.poll() is None:
            if time.monotonic() > deadline:  # a hung job: the launch goes with it, and the next job gets a new one
                kill_session(self.proc.pid)
                raise AssertionError(f"job {args} did not end in {HANG_S} s")
            time.sleep(0.01)
        logs = sorted(self.folder.glob(f"log{index}.*"))
        out, err = ("".join(p.read_text() for p in logs if p.suffix == kind) for kind in (".out", ".err"))
        if end.exists():
            return subprocess.CompletedProcess(args, int(end.read_text()), out, err)
        self.proc.wait()  # the job ended the launch: its code and output, as a launch of its own would give
        launched = ((self.folder / name).read_text() for name in ("launch.out", "launch.err"))
        return subprocess.CompletedProcess(args, self.proc.returncode, out + next(launched), err + next(launched))

    def close(self) -> None:
        """End the launch between jobs (so that each rank exits as a finished job does, coverage data written)."""
        (self.folder / "stop").touch()
        try:
            self.proc.wait(timeout=HANG_S)
        finally:
            shutil.rmtree(self.folder, ignore_errors=True)


def pytest_sessionfinish(session: pytest.Session) -> None:  # noqa: ARG001 - pytest's hook signature
    for launch in Launch.running.values():
        launch.close()
    Launch.running.clear()


def run_config(config: Path, out: Path, ranks: int = 0) -> None:
    """``mpifl run CONFIG --out OUT --quiet`` in this process (ranks = 0) or on ``ranks`` ranks (in this pytest
    process's :class:`Launch` of that many); it must succeed."""
    args = ["run", str(config), "--out", str(out), "--quiet"]
    if ranks:
        proc = run_mpifl(args, ranks=ranks)
        assert proc.returncode == 0, proc.stderr
    else:
        from mpifl.cli import main

        assert main(args) == 0


@pytest.fixture
def write_config(tmp_path: Path):
    def write(overrides: dict | None = None, name: str = "cfg.yaml") -> Path:
        cfg = _merge(TINY, overrides or {})
        path = tmp_path / name
        path.write_text(yaml.safe_dump(cfg))
        return path

    return write


def shared_dir(tmp_path_factory, name: str) -> Path:  # noqa: ANN001
    """One directory every rank of the world communicator agrees on (rank 0's), for pytest-mpi tests. The ranks
    meet asleep first: the workers of the test before may be here long before rank 0 ends that test's
    one-process reference run, and a blocking broadcast would poll a core all the while (most of the workers'
    CPU in tests/mpi, measured with py-spy), a core the other phases of scripts/test.sh need."""
    from mpi4py import MPI

    arrive_together(MPI.COMM_WORLD)
    path = str(tmp_path_factory.mktemp(name)) if MPI.COMM_WORLD.Get_rank() == 0 else None
    return Path(MPI.COMM_WORLD.bcast(path, root=0))


def _merge(base: dict, extra: dict) -> dict:
    """``base`` with ``extra`` merged in, nested mappings too; a deep copy, so callers may mutate the result."""
    out = copy.deepcopy(base)
    for key, value in extra.items():
        out[key] = (_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict)
                    else copy.deepcopy(value))  # else ``extra``'s own nested mapping would be shared, and mutated
    return out


def run_engine(cfg, comm, out: Path, resume: bool = False) -> Path:  # noqa: ANN001
    """Run ``cfg`` (a RunConfig or a raw mapping) on communicator ``comm`` in this process; returns the results
    file, which is how tests look at a run (never the engine's insides)."""
    from mpifl.registry import parse_config
    from mpifl.runtime.engine import Engine

    engine = Engine(cfg if not isinstance(cfg, dict) else parse_config(cfg), comm, out, resume=resume)
    engine.prepare()
    engine.run(progress=False)
    return Path(out)


def deterministic(path) -> dict[str, np.ndarray]:  # noqa: ANN001
    """Everything a run computes, from its results file: the server's final state, every evaluation, the
    rounds' deterministic columns and the ledger (in (round, stage, message, client) order, as evaluation
    chunks record their rows in turn); not timings, rank placement or load balance."""
    out = {}
    with h5py.File(path) as f:
        for table in ("model", "eval"):
            for key in f[table]:
                out[f"{table}/{key}"] = f[table][key][()]
        order = np.lexsort([f["ledger"][k][()] for k in ("client", "message", "stage", "round")])
        for key in f["ledger"]:
            out[f"ledger/{key}"] = f["ledger"][key][()][order]
        for key in f["rounds"]:
            if not rank_dependent(key):
                out[f"rounds/{key}"] = f["rounds"][key][()]
    return out


def assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert np.array_equal(a[key], b[key], equal_nan=a[key].dtype.kind == "f"), key


@pytest.fixture
def read_only_dir(tmp_path: Path):
    """A directory no file can be created in, even by root (CI runs as root, whom permission bits do not stop):
    a read-only bind mount as root, mode 0o555 otherwise; ``make(dir)`` makes ``dir`` so, until the test ends."""
    mounted: list[Path] = []

    def make(path: Path) -> Path:
        path.mkdir(parents=True, exist_ok=True)
        if os.geteuid() != 0:
            path.chmod(0o555)
            return path
        done = subprocess.run(["mount", "--bind", "-o", "ro", str(path), str(path)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"root without a read-only bind mount: {done.stderr.strip()}")
        mounted.append(path)
        return path

    yield make
    for path in mounted:
        subprocess.run(["umount", str(path)], check=True)
    for path in tmp_path.rglob("*"):
        if path.is_dir():
            path.chmod(0o755)


@contextmanager
def sweep_runs_in_this_process() -> Iterator[None]:
    """``mpifl sweep``'s local runs in this process instead of each in a new one (its start-up costs more than a
    tiny run): each command line the sweep would start is checked and given to ``main``, a run of several ranks
    (``mpirun --oversubscribe -n N python -m mpifl ...``) on this one, as it gives the same bits on any rank count.
    The tests that kill, interrupt or submit a sweep keep the real processes (tests/test_sweep.py's killed sweep
    launches its runs on 2 ranks)."""
    from mpifl import sweep
    from mpifl.cli import main

    launcher = [shutil.which("mpirun") or "mpirun", "--oversubscribe", "-n"]

    def run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
        if cmd[:3] == launcher and cmd[3].isdigit():
            cmd = cmd[4:]
        assert cmd[:3] == [sys.executable, "-m", "mpifl"] and env["PATH"] == os.environ["PATH"], cmd
        return subprocess.CompletedProcess(cmd, main(cmd[3:]))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sweep, "subprocess", SimpleNamespace(run=run))
        yield


@pytest.fixture
def runs_in_this_process() -> Iterator[None]:
    """:func:`sweep_runs_in_this_process` for one test."""
    with sweep_runs_in_this_process():
        yield
