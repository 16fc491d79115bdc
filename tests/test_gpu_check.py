"""scripts/gpu_check.sh, the one command for a GPU machine: its dry run (--device cpu --quick) end to end, so that
the check's own failures show here rather than in the GPU machine's few minutes; its comparisons, its time
budgets, and its option errors."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

from benchmarks.gpu_check import (
    BUDGETS,
    KILLED,
    Check,
    Report,
    bitwise,
    difference,
    gpu_test_files,
    parse,
    within_tolerance,
)
from tests.conftest import REPO, mpi_env

SCRIPT = REPO / "scripts" / "gpu_check.sh"


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


def test_the_docs_table_of_stages_has_the_budgets():
    text = (REPO / "docs" / "how-to" / "gpus.md").read_text().split("## Checking a GPU machine")[1]
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| ") and line.rstrip().endswith(" |")]
    documented = {cells[1].strip(" `"): float(cells[-2]) for cells in rows if cells[-2].strip().isdigit()}
    assert documented == BUDGETS


def test_a_command_past_its_deadline_is_stopped_with_all_it_started(tmp_path):
    """The stage's deadline ends the command and what it started, in process groups of their own as Open MPI's
    ranks are (``set -m``): exit code KILLED, in time."""
    args = parse(["--device", "cpu", "--out", str(tmp_path)])
    check = Check(args, Report(tmp_path, tmp_path, "test", "cpu"), tmp_path)
    pids = tmp_path / "pids"
    began = time.monotonic()
    script = f"set -m; for i in 1 2; do sleep 60 & echo $! >> {pids}; done; wait"
    code = check.run(["bash", "-c", script], tmp_path / "log", time.monotonic() + 1)
    assert code == KILLED and time.monotonic() - began < 20
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
    deadline = time.monotonic() + 120
    while not list((work / "raw" / "algorithms" / "logs").glob("*.log")):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
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
    proc = gpu_check(*args, "--out", str(tmp_path / "out"), timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"gpu_check: error: {message}") and not (tmp_path / "out").exists()


def test_a_stage_without_time_left_is_reported_not_run(tmp_path):
    proc = gpu_check("--device", "cpu", "--out", str(tmp_path), "--only", "syncs", "--budget", "syncs=1", timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    assert [(s["stage"], s["status"]) for s in steps] == [("install", "ok"), ("versions", "ok"), ("syncs", "not run")]
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
                          capture_output=True, text=True, timeout=60, env={**mpi_env(), "PYTHON": str(bare)})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    steps = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["steps"]
    assert [(s["stage"], s["status"], s["exit_code"]) for s in steps] == [("install", "failed", 2)]
    assert steps[0]["command"].startswith(f"MPIFL_INSTALL=current MPIFL_WHEELHOUSE={wheelhouse} PYTHON=")
    report = (tmp_path / "out" / "report.md").read_text()
    assert "mpifl setup: MPIFL_INSTALL=current: " in report and "cannot import torch" in report
    assert "| torch | ModuleNotFoundError: No module named 'torch' |" in report


def test_the_dry_run_runs_every_stage_end_to_end(tmp_path):
    """`scripts/gpu_check.sh --device cpu --quick`: every stage, on the CPU, with no failure; every step of the
    report with its command, exit code and duration; the CPU runs bitwise run to run and on 1 vs 3 ranks."""
    out = tmp_path / "out"
    proc = gpu_check("--device", "cpu", "--quick", "--jobs", "2", "--out", str(out), "--work", str(tmp_path / "w"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.json", "raw.tar.gz", "report.md"]
    data = json.loads((out / "gpu_check.json").read_text())
    assert data["complete"] and data["device"] == "cpu"
    stages = [step["stage"] for step in data["steps"]]
    assert stages[:2] == ["install", "versions"]
    assert {"tests", "syncs", "algorithms", "models", "bench.w2", "bench.b1", "bench.server"} <= set(stages)
    assert all(step["status"] in ("ok", "not run") and not step["failures"] for step in data["steps"])
    report = (out / "report.md").read_text()
    assert "- Failures: 0" in report and "## Failures\n\nNone." in report and "Status: complete" in report
    tests = next(step for step in data["steps"] if step["title"] == "the tests marked cuda")
    assert len(tests["data"]["tests"]) > 50  # pytest -m cuda selected the GPU tests; here they are listed skipped
    syncs = next(step for step in data["steps"] if step["stage"] == "syncs")
    assert {case[2] for case in syncs["data"]["cases"]} >= {"cnn epochs", "simple_cnn crop_flip", "char_lstm fresh"}
    for stage, cases in (("algorithms", {"pfedhn", "pfedhn, server.device cpu"}),
                         ("models", {"cnn, one at a time", "cnn, vectorized"})):
        rows = next(step for step in data["steps"] if step["stage"] == stage)["data"]["cases"]
        assert set(rows) == cases
        for row in rows.values():
            assert (row["P1 run to run"], row["P3 run to run"], row["P1 vs P3"]) == ("bitwise",) * 3
            assert row["model"][:2] == [0.0, 0.0] and row["within tolerance"]
    assert rows["cnn, vectorized"]["vectorized"] == 1.0 and rows["cnn, one at a time"]["vectorized"] == 0.0
    for stage in ("bench.w2", "bench.b1", "bench.server"):
        bench = next(step for step in data["steps"] if step["stage"] == stage)
        assert bench["command"].startswith(sys.executable.replace(str(REPO) + "/", "")) and bench["exit_code"] == 0
        assert any(line.startswith("| 1 |") or line.startswith("| pefll |") for line in bench["data"]["table"])
    with tarfile.open(out / "raw.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"tests/junit.xml", "syncs/syncdebug.log", "bench/w2.log", "algorithms/configs/pfedhn_cpu.yaml",
            "models/logs/cnn_vectorized_dev_p3b.log"} <= names
