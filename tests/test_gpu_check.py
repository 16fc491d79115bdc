"""scripts/gpu_check.sh, the check step of a GPU lease: its comparisons, its profiles' time budgets against the
lease's caps, how it stops what it runs, and its option errors. Its dry run end to end, in an emulation of the GPU
image, is the lease's rehearsal (tests/test_gpu_lease.py), which also checks that installed packages named tests
and benchmarks shadow nothing."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

import benchmarks.gpu_check
from benchmarks.gpu_check import (
    KILLED,
    PROFILES,
    RUNS,
    Case,
    Check,
    Report,
    bitwise,
    case_table,
    checkout_commit,
    compare,
    difference,
    gpu_test_files,
    junit_rows,
    launch,
    model_kinds,
    parse,
    within_tolerance,
)
from tests.conftest import HANG_S, REPO, TINY, _merge, mpi_env, run_config

SCRIPT = REPO / "scripts" / "gpu_check.sh"
CAP_S = 10.0
"""A job's cap in the tests that stop one: far past a tiny 2-round job's own seconds on a busy machine (the launch's
imports are not the job's), far short of a 10,000-round one's."""


def gpu_check(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=mpi_env(),
                          cwd=REPO)


def test_differences_against_the_cpu_run_by_hand():
    """model/a: |Δ| = (0.1, 0.3), largest |reference| entry 2: abs 0.3, rel 0.15. model/b: |Δ| 0.5 over 10: rel
    0.05. An eval NaN on both sides is no difference; on one side it is an infinite one."""
    reference = {"model/a": np.array([1.0, -2.0]), "model/b": np.array([10.0]), "eval/loss": np.array([np.nan, 1.0]),
                 "eval/round": np.array([1, 2])}
    other = {"model/a": np.array([1.1, -2.3]), "model/b": np.array([9.5]), "eval/loss": np.array([np.nan, 1.0]),
             "eval/round": np.array([1, 2])}
    absolute, relative, where = difference(reference, other, "model/")
    assert (absolute, where) == (0.5, "model/a") and relative == pytest.approx(0.15)
    assert difference(reference, other, "eval/") == (0.0, 0.0, "eval/loss")
    assert difference(reference, {**other, "eval/loss": np.array([0.5, 1.0])}, "eval/")[:2] == (np.inf, np.inf)
    assert not within_tolerance(reference, other)  # 0.3 > 1e-3 + 1e-3 · 2
    close = {**other, "model/a": np.array([1.0015, -2.0]), "model/b": np.array([10.0])}
    assert within_tolerance(reference, close)  # 0.0015 <= 1e-3 + 1e-3 · 1


def test_bitwise_names_the_arrays_that_differ():
    a = {"model/w": np.array([1.0, 2.0]), "eval/acc": np.array([np.nan]), "ledger/client": np.array([3, 4])}
    assert bitwise(a, {k: v.copy() for k, v in a.items()}) == "bitwise"  # NaN equals NaN here
    b = {**a, "model/w": np.array([1.0, 2.25])}
    assert bitwise(a, b) == "1 of 3 arrays differ: model/w (max |Δ| 0.25)"
    assert bitwise(a, {"model/w": a["model/w"]}).startswith("different arrays: eval/acc, ledger/client")


def test_the_gpu_tests_are_the_files_that_mark_them():
    files = {path.relative_to(REPO).as_posix() for path in gpu_test_files()}
    assert {"tests/test_device.py", "tests/test_syncs.py", "tests/algorithms/test_pefll_baselines.py"} <= files


def test_the_docs_table_of_stages_has_the_profiles_budgets():
    text = (REPO / "docs" / "how-to" / "gpus.md").read_text().split("## What the check runs")[1]
    rows = [[cell.strip(" `") for cell in line.split("|")[1:-1]] for line in text.splitlines()
            if line.startswith("| ") and line.rstrip().endswith(" |")]
    rows = [cells for cells in rows if cells[-1].isdigit()]
    for column, profile in ((-2, "lease"), (-1, "rest")):
        assert {cells[0]: float(cells[column]) for cells in rows} == PROFILES[profile].budgets
        assert [cells[0] for cells in rows if cells[-3] in (profile, "both")] == sorted(
            PROFILES[profile].stages, key=[cells[0] for cells in rows].index)


def lease_caps(key: str) -> tuple[int, dict[str, int]]:
    """scripts/gpu_lease.sh's limit and step caps for ``PROFILE/DEVICE``."""
    script = (REPO / "scripts" / "gpu_lease.sh").read_text()
    line = re.search(rf"^  {re.escape(key)}\) LIMIT=(\d+).*\n\s+CAP=\(([^)]*)\)", script, re.M)
    return int(line[1]), {step: int(cap) for step, cap in re.findall(r"\[([\w-]+)\]=(\d+)", line[2])}


@pytest.mark.parametrize("profile", list(PROFILES))
def test_each_profiles_stages_fit_the_check_step_of_its_lease_command(profile):
    """A GPU lease command may run 10 minutes and the first is meant for 7: its check step's cap holds the
    profile's stages, the check's own probes (about 10 s) and the 20 s that gpu_lease.sh keeps for stopping them;
    the steps' caps fit the command's limit (more-tests, the second command's last step, takes what is left)."""
    limit, caps = lease_caps(f"{profile}/cuda")
    stages = PROFILES[profile].stages
    assert sum(PROFILES[profile].budgets[stage] for stage in stages) + 10 + 20 <= caps["check"]
    meant = {"lease": 420, "rest": 290}[profile]
    assert sum(cap for step, cap in caps.items() if step != "more-tests") <= limit <= meant


def test_the_first_command_checks_every_model_kind():
    assert sorted(PROFILES["lease"].models) == sorted(model_kinds()) and not PROFILES["rest"].models


def test_a_command_past_its_deadline_is_stopped_with_all_it_started(tmp_path):
    """The stage's deadline ends the command and what it started, in process groups of their own as Open MPI's
    ranks are (``set -m``): exit code KILLED, in time."""
    args = parse(["--device", "cpu", "--out", str(tmp_path)])
    check = Check(args, Report(tmp_path, tmp_path, "test", "cpu"), tmp_path)
    pids = tmp_path / "pids"
    began = time.monotonic()
    script = f"set -m; for i in 1 2; do sleep {2 * HANG_S} & echo $! >> {pids}; done; wait"
    code = check.run(["bash", "-c", script], tmp_path / "log", time.monotonic() + 1)
    assert code == KILLED and time.monotonic() - began < HANG_S  # long before the sleeps would end
    assert "stopped at its stage's deadline" in (tmp_path / "log").read_text()
    time.sleep(0.5)
    assert not [pid for pid in map(int, pids.read_text().split()) if running(pid)]


def test_a_check_killed_from_outside_stops_its_runs_and_says_so(tmp_path):
    """SIGTERM (the machine's time is up) while a run goes on: the check stops every command it started and
    leaves a report that says it was stopped, with exit code 128 + 15."""
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.Popen([str(SCRIPT), "--device", "cpu", "--only", "algorithms", "--algorithms", "pefll", "--jobs",
                             "1", "--out", str(out), "--work", str(work)], env=mpi_env(), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + HANG_S
    while not list((work / "raw" / "algorithms" / "logs").glob("*.log")):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=HANG_S) == 128 + signal.SIGTERM
    assert "**stopped by SIGTERM**" in (out / "report.md").read_text()
    assert not json.loads((out / "gpu_check.json").read_text())["complete"]
    time.sleep(0.5)
    assert not [pid for pid in Path("/proc").iterdir() if pid.name.isdigit() and running(int(pid.name))
                and str(work).encode() in _cmdline(pid)]


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def running(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie, killed and not yet reaped by its new parent, does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # gone
        return False


@pytest.mark.parametrize(("args", "message"), [
    (["--only", "tests,gpus"], "--only tests,gpus: no stage gpus"),
    (["--budget", "bench=0"], "--budget bench=0: give STAGE=SECONDS"),
    (["--device", "tpu"], "argument --device: invalid choice"),
    (["--wheelhouse", "/nonexistent/wheels"], "--wheelhouse /nonexistent/wheels: no such folder"),
])
def test_bad_options_are_one_line_and_exit_code_2(args, message, tmp_path):
    proc = gpu_check(*args, "--out", str(tmp_path / "out"), timeout=HANG_S)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"gpu_check: error: {message}") and not (tmp_path / "out").exists()


def test_the_tests_stage_selects_the_gpu_tests_and_a_stage_without_time_left_is_reported_not_run(tmp_path):
    """`--only tests,syncs` (the check run alone on a GPU node; a lease runs the tests itself): pytest -m cuda
    selects the GPU tests, skipped here for want of a GPU and listed from the JUnit file, then the 3-rank device
    test; syncs, with a budget of 1 s, is below MIN_SECONDS: reported not run, the one failure."""
    proc = gpu_check("--device", "cpu", "--only", "tests,syncs", "--budget", "syncs=1", "--out", str(tmp_path),
                     timeout=600)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert [(s["stage"], s["status"]) for s in steps] == [("install", "ok"), ("versions", "ok"), ("tests", "ok"),
                                                          ("tests", "ok"), ("syncs", "not run")]
    rows = steps[2]["data"]["tests"]
    assert len(rows) > 50 and all(outcome == "skipped" and "CUDA" in message for _, outcome, _, message in rows)
    report = (tmp_path / "report.md").read_text()
    assert "- Failures: 1" in report and "**syncs**" in report and "time budget" in report


def test_an_interpreter_without_torch_stops_at_the_install_with_setups_line(tmp_path):
    """The GPU image's python3 lacking torch: setup.sh (MPIFL_INSTALL=current) refuses in one line, the report
    shows it and what does not import, and nothing else runs."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "bare")], check=True)
    wheelhouse = tmp_path / "wheels"
    wheelhouse.mkdir()
    (wheelhouse / "pot-0.9.7-py3-none-any.whl").touch()
    bare = tmp_path / "bare" / "bin" / "python"
    proc = subprocess.run([str(SCRIPT), "--wheelhouse", str(wheelhouse), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=HANG_S, env={**mpi_env(), "PYTHON": str(bare)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    steps = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["steps"]
    assert [(s["stage"], s["status"], s["exit_code"]) for s in steps] == [("install", "failed", 2)]
    assert steps[0]["command"].startswith(f"MPIFL_INSTALL=current MPIFL_WHEELHOUSE={wheelhouse} PYTHON=")
    report = (tmp_path / "out" / "report.md").read_text()
    assert "mpifl setup: MPIFL_INSTALL=current: " in report and "cannot import torch" in report
    assert "| torch | ModuleNotFoundError: No module named 'torch' |" in report


def test_pytest_stopped_at_its_deadline_still_writes_its_junit_file(tmp_path):
    """The tests stage stops pytest with SIGINT (SIGTERM would end it without a JUnit file): the tests that ended
    are in the file, the one stopped is not. The deadline falls well after test_quick, however loaded the machine:
    twice what pytest takes here and now to start and run test_quick alone, and 5 s."""
    tests = tmp_path / "test_stopped.py"
    tests.write_text("import time\n\n\ndef test_quick():\n    pass\n\n\ndef test_slow():\n    time.sleep(300)\n")
    pytest_run = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    began = time.monotonic()
    subprocess.run([*pytest_run, f"{tests}::test_quick"], cwd=REPO, capture_output=True, check=True)  # as Check runs it
    startup = time.monotonic() - began
    args = parse(["--device", "cpu", "--out", str(tmp_path)])
    check = Check(args, Report(tmp_path, tmp_path, "test", "cpu"), tmp_path)
    junit = tmp_path / "junit.xml"
    # gpu_check's main handles SIGINT itself, so what it starts gets SIGINT at its default; a test session started
    # in the background (nohup, &) ignores SIGINT, and its children would inherit that
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code = check.run([*pytest_run, f"--junitxml={junit}", tests], tmp_path / "log",
                         time.monotonic() + 2 * startup + 5, interrupt=signal.SIGINT)
    finally:
        signal.signal(signal.SIGINT, previous)
    log = (tmp_path / "log").read_text()[-2000:]  # what the stopped pytest printed, should this fail again
    assert code == KILLED, log
    rows = [(name.split("::")[1], outcome) for name, outcome, _, _ in junit_rows(junit)]
    assert rows == [("test_quick", "passed")], log


def test_a_comparison_that_raises_leaves_a_row_the_table_shows(tmp_path, monkeypatch):
    """A comparison that raises (an import that fails, as when an installed package shadowed tests/) fails its case
    alone: the table still shows the case's exit codes, not a KeyError."""
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(_merge(TINY, {"rounds": 1})))
    run_config(config, tmp_path / "run.h5")
    case = Case("fedavg", {})
    for run in RUNS:
        case.exit_codes[run], case.results[run] = 0, tmp_path / "run.h5"

    def shadowed(*_):
        raise ModuleNotFoundError("No module named 'benchmarks.gpu_check'")

    monkeypatch.setattr(benchmarks.gpu_check, "within_tolerance", shadowed)
    with pytest.raises(ModuleNotFoundError):
        compare(case)
    assert case_table([case], "cuda")[-1] == "| fedavg | 0 0 0 0 | | | | | | |"
    monkeypatch.undo()
    assert compare(case) == [] and case_table([case], "cuda")[-1].startswith("| fedavg | 0 0 0 0 | bitwise | bitwise |")


def test_the_report_names_the_commit_sent_never_a_parent_repositorys(tmp_path, monkeypatch):
    """MPIFL_COMMIT (scripts/gpu_lease.sh sets it from the wheels' COMMIT) first; else the checkout's own HEAD; a
    tree without .git inside another repository has no commit, not that repository's."""
    monkeypatch.delenv("MPIFL_COMMIT", raising=False)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    assert checkout_commit() == head
    (tmp_path / "tree").mkdir()
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "init", "-q"], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                    "--allow-empty", "-m", "parent"], check=True)
    monkeypatch.setattr(benchmarks.gpu_check, "REPO", tmp_path / "tree")
    assert checkout_commit() is None
    monkeypatch.setenv("MPIFL_COMMIT", "1234abc")
    assert checkout_commit() == "1234abc"


def _cases(tmp_path: Path, check: Check, **configs: dict) -> list[Case]:
    """A case per TINY variant, its "dev" config on --device (cpu here), with the paths run_cases gives its runs."""
    cases = []
    for name, extra in configs.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(_merge(TINY, {"rounds": 2, **extra})))
        case = Case(name, {"dev": path})
        for run in RUNS:
            stem = tmp_path / f"{name}_{run[1]}{run[2]}"
            case.logs[run], case.results[run] = stem.with_suffix(".log"), stem.with_suffix(".h5")
        cases.append(case)
    return cases


def test_a_job_that_ends_its_launch_hides_no_other_case(tmp_path):
    """3 ranks, one launch for three jobs: the second aborts the whole launch (MPI_Abort, after its NaN uploads
    with faults.nonfinite abort); it is recorded failed with the launch's exit code, and the third runs in a new
    launch: 2 process starts for 3 jobs, every row filled."""
    check = Check(parse(["--device", "cpu", "--out", str(tmp_path)]), Report(tmp_path, tmp_path, "test", "cpu"),
                  tmp_path)
    cases = _cases(tmp_path, check, first={}, aborts={"faults": {"corrupt": 1.0, "nonfinite": "abort"}}, third={})
    ended: dict[str, int | None] = {}
    run = ("dev", 3, "a")
    launches = launch(check, "algorithms", run, cases, "test", time.monotonic() + 300,
                      lambda case, _, code, seconds: ended.update({case.name: code}))
    assert launches == 2 and ended["first"] == 0 and ended["third"] == 0, (ended, check.report.raw)
    assert ended["aborts"] not in (0, None, KILLED)
    assert "is not finite" in cases[1].logs[run].read_text()


def test_a_job_past_its_cap_or_failing_ends_its_launch_and_the_next_runs_in_a_new_one(tmp_path, monkeypatch):
    """1 rank: a job that runs past CASE_CAP_S is stopped with its launch (exit code KILLED), and a failed job
    (exit code 1, no MPI_Abort alone) ends its launch too, so that what it left behind (a CUDA error spoils the
    context) reaches no other case: 3 launches, the jobs after each still run."""
    monkeypatch.setitem(benchmarks.gpu_check.CASE_CAP_S, "cpu", CAP_S)
    check = Check(parse(["--device", "cpu", "--out", str(tmp_path)]), Report(tmp_path, tmp_path, "test", "cpu"),
                  tmp_path)
    cases = _cases(tmp_path, check, fails={"faults": {"corrupt": 1.0, "nonfinite": "abort"}}, slow={"rounds": 10_000},
                   next={})
    ended: dict[str, int | None] = {}
    launches = launch(check, "algorithms", ("dev", 1, "a"), cases, "test", time.monotonic() + 300,
                      lambda case, _, code, seconds: ended.update({case.name: code}))
    assert (launches, ended) == (3, {"fails": 1, "slow": KILLED, "next": 0})
