"""Whole jobs under a real ``mpirun``: rank-count invariance, one-line errors, aborts, idle server.

The jobs of this file run in two launches (tests/batch.py, built once by :func:`jobs`): one of 3 ranks, one of a
single process; each test asserts on its own jobs there. Start-ups, not training, are what such small jobs cost."""

import subprocess
import sys
import time
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import yaml

from benchmarks.gpu_check import SESSION, processes
from mpifl.results import read_results
from tests.conftest import (
    HANG_S,
    REPO,
    TINY,
    _merge,
    assert_same,
    deterministic,
    mpi_env,
    run_config,
    run_mpifl_batch,
)
from tests.test_append_only import check_committed

BITWISE = {"rounds": 2, "clients_per_round": 5, "client": {"momentum": 0.9, "weight_decay": 1e-4}}
THREADS = {"rounds": 2, "model": {"channels": [16], "fc_hidden": 64}, "client": {"momentum": 0.9, "batch_size": 32}}
DIRICHLET = {"rounds": 4, "clients_per_round": 8, "data": {"num_clients": 16, "partition": "dirichlet", "alpha": 0.3}}
IDLE = {"rounds": 4, "eval_every": 4, "clients_per_round": 8, "model": {"name": "mlp", "hidden": [256, 256]},
        "client": {"epochs": 20}}
FAULT = "2:3"  # rank 2 raises at the start of round 3


def write(folder: Path, name: str, overrides: dict) -> str:
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(_merge(TINY, overrides)))
    return str(path)


def refusals(folder: Path) -> dict[str, list[str]]:
    """The jobs that must stop with one line before training, as either launch runs them (``folder``: its own)."""
    folder.mkdir()
    blocker = folder / "a_file"
    blocker.write_text("")
    missing = {"data": {"dataset": "mnist", "root": str(folder / "nowhere")}}
    return {"unwritable": ["run", write(folder, "long", {"rounds": 20}), "--out", str(blocker / "sub" / "run.h5")],
            "bad_config": ["run", write(folder, "bad", {"client": {"lr": -1}}), "--out", str(folder / "never.h5")],
            "missing_data": ["run", write(folder, "missing", missing), "--out", str(folder / "x.h5")]}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory) -> tuple[Path, dict[int, dict[str, subprocess.CompletedProcess]]]:
    """Every job of this file that needs no launch of its own: ``(folder, {ranks: {name: result}})`` for one
    3-rank launch and one single process (ranks 0). The 3-rank job that fails on a worker has a launch of its
    own: its ``MPI_Abort`` ends the launch, and with it what coverage.py had recorded of the jobs before."""
    folder = tmp_path_factory.mktemp("jobs")
    three = {name: ["run", write(folder, name, overrides), "--out", str(folder / f"{name}3.h5"), "--quiet"]
             for name, overrides in (("bitwise", BITWISE), ("threads", {**THREADS, "threads_per_rank": 2}))}
    dirichlet = write(folder, "dirichlet", DIRICHLET)
    three.update({placement: ["run", dirichlet, "--out", str(folder / f"{placement}.h5"), "--quiet", "--set",
                              f"placement={placement}"] for placement in ("static", "dynamic")})
    three["idle"] = ["run", write(folder, "idle", IDLE), "--out", str(folder / "idle.h5"), "--quiet", "--profile"]
    three.update(refusals(folder / "three"))
    results = {3: dict(zip(three, run_mpifl_batch(list(three.values()), 3, folder / "batch3")))}
    fault = ["run", write(folder, "fault", {"rounds": 50}), "--out", str(folder / "fault.h5")]
    [results[3]["fault"]] = run_mpifl_batch([fault], 3, folder / "fault", [{"MPIFL_INJECT_FAULT": FAULT}])
    tiny, nine = write(folder, "tiny", {}), write(folder, "nine", {"clients_per_round": 9})
    one = {"bitwise": ["run", str(folder / "bitwise.yaml"), "--out", str(folder / "bitwise1.h5"), "--quiet"],
           **refusals(folder / "one"),
           "report": ["report", str(folder / "idle.h5")],
           "valid": ["validate", tiny],
           "too_many": ["validate", nine, "--set", "data.unseen_fraction=0.5"],
           "stateful": ["validate", tiny, "--set", "algorithm=scaffold", "--set", "placement=dynamic"],
           "no_config": ["run"]}
    results[0] = dict(zip(one, run_mpifl_batch(list(one.values()), 0, folder / "batch0")))
    return folder, results


def mpifl_lines(stderr: str) -> list[str]:
    """Our own stderr lines (mpirun may add its own notice about a non-zero exit status)."""
    assert "Traceback" not in stderr
    return [line for line in stderr.splitlines() if line.startswith("mpifl")]


def final_state(path):
    with h5py.File(path) as f:
        return f["model/global_model"][()], {k: f["eval"][k][()] for k in f["eval"]}


def test_global_model_is_bitwise_identical_for_1_to_4_ranks(jobs, tmp_path):
    folder, results = jobs
    assert results[0]["bitwise"].returncode == 0 and results[3]["bitwise"].returncode == 0, results[3]["bitwise"].stderr
    outputs = {1: folder / "bitwise1.h5", 3: folder / "bitwise3.h5"}
    for ranks in (2, 4):
        outputs[ranks] = tmp_path / f"p{ranks}.h5"
        run_config(folder / "bitwise.yaml", outputs[ranks], ranks=ranks)
    model, metrics = final_state(outputs[1])
    for ranks in (2, 3, 4):
        other_model, other_metrics = final_state(outputs[ranks])
        assert np.array_equal(other_model, model), f"P={ranks} differs from P=1"
        for key, values in metrics.items():
            assert np.array_equal(other_metrics[key], values, equal_nan=True), key
    with h5py.File(outputs[3]) as f:
        assert sorted(f["ranks/clients"][()]) == [0, 5, 5]


def test_threads_per_rank_keep_results_bitwise_identical_on_1_and_3_ranks(jobs, tmp_path):
    """Two torch threads on every rank (what --cpus-per-task=2 gives under jobs/mpifl.sbatch): a client's
    arithmetic depends on its rank's thread count, which is the same on every rank, never on the rank count."""
    folder, results = jobs
    assert results[3]["threads"].returncode == 0, results[3]["threads"].stderr
    before = torch.get_num_threads()
    try:
        run_config(folder / "threads.yaml", tmp_path / "p1.h5")  # in this process: 1 rank
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    two_threads = deterministic(tmp_path / "p1.h5")
    assert_same(two_threads, deterministic(folder / "threads3.h5"))
    run_config(Path(write(tmp_path, "one", THREADS)), tmp_path / "one.h5")  # the default: 1 thread
    # the thread count reaches the bits here, so a rank computing with another count would show above
    one_thread = deterministic(tmp_path / "one.h5")
    assert not np.array_equal(two_threads["model/global_model"], one_thread["model/global_model"])


@pytest.mark.parametrize("ranks", [0, 3])
def test_unwritable_output_is_refused_before_training(jobs, ranks):
    """As root too (where permissions do not stop writes): the results path runs through a regular file."""
    proc = jobs[1][ranks]["unwritable"]
    out = Path(proc.args[3])
    blocker = out.parent.parent
    assert blocker.is_file()
    assert proc.returncode == 2
    assert mpifl_lines(proc.stderr) == [f"mpifl: error: output {out}: cannot be written: Not a directory ({blocker})"]
    assert "round" not in proc.stdout  # nothing trained


def test_dynamic_placement_balances_rounds_without_changing_results(jobs):
    """Unequal clients (Dirichlet sizes): re-spreading each round's clients over the workers evens
    their work, and the results are bitwise those of static ownership."""
    folder, results = jobs
    runs = {}
    for placement in ("static", "dynamic"):
        assert results[3][placement].returncode == 0, results[3][placement].stderr
        with h5py.File(folder / f"{placement}.h5") as f:
            runs[placement] = final_state(folder / f"{placement}.h5"), f["rounds/load_imbalance"][()]
    (model, metrics), static_imbalance = runs["static"]
    (dynamic_model, dynamic_metrics), dynamic_imbalance = runs["dynamic"]
    assert np.array_equal(model, dynamic_model)
    for key, values in metrics.items():
        assert np.array_equal(dynamic_metrics[key], values, equal_nan=True), key
    assert np.all(dynamic_imbalance <= static_imbalance) and dynamic_imbalance.mean() < static_imbalance.mean()


@pytest.mark.parametrize("ranks", [0, 3])
def test_bad_config_is_one_line_and_exit_code_2(jobs, ranks):
    proc = jobs[1][ranks]["bad_config"]
    assert proc.returncode == 2
    assert mpifl_lines(proc.stderr) == ["mpifl: error: client.lr: must be > 0, got -1.0"]
    assert not Path(proc.args[3]).exists()


@pytest.mark.parametrize("ranks", [0, 3])
def test_missing_data_is_one_line_and_exit_code_2(jobs, ranks):
    proc = jobs[1][ranks]["missing_data"]
    assert proc.returncode == 2
    errors = mpifl_lines(proc.stderr)
    assert len(errors) == 1 and errors[0].startswith("mpifl: error:") and "nowhere" in errors[0]


def test_validate_command(jobs):
    results = jobs[1][0]
    ok = results["valid"]
    assert ok.returncode == 0 and "valid: 10 clients (8 seen)" in ok.stdout
    bad = results["too_many"]
    assert bad.returncode == 2
    assert bad.stderr.strip() == "mpifl: error: clients_per_round: 9 exceeds the 5 seen clients of the data"
    assert results["stateful"].returncode == 0  # a visiting client takes its state along
    assert results["no_config"].returncode == 2


def test_exception_on_a_worker_aborts_the_job_with_one_message(jobs):
    """Rank 2 raises at the start of round 3 of 50: the job ends (a job that waited on rank 2 instead would
    hang to the timeout) with one line naming it, and keeps the last results write that was committed."""
    proc = jobs[1][3]["fault"]
    out = Path(proc.args[3])
    assert proc.returncode != 0
    # a worker does not read the file rank 0 writes: it points to report, which reads it
    assert mpifl_lines(proc.stderr) == [
        f"mpifl: error: rank 2 of 3 failed: RuntimeError: fault injected by MPIFL_INJECT_FAULT={FAULT}; python -m "
        f"mpifl report {out} says what the results file keeps; continue from its last checkpoint, if it holds one, "
        f"with: mpirun -n 3 --oversubscribe python -m mpifl run --resume {out}"
    ], proc.stderr
    # Rank 0 writes beside the rounds, so the abort may come before its first write committed (no file: a new
    # file appears only once its first write is whole) or while it writes round 1 or 2: the file then holds the
    # last committed write, intact, and never a round past the fault.
    if out.exists():
        assert check_committed(out) in (1, 2)
        assert read_results(out).attrs["status"] == "running"


def test_idle_server_does_not_spin(jobs):
    """Oversubscribed (3 ranks on this machine's cores): rank 0 waits while workers train."""
    folder, results = jobs
    assert results[3]["idle"].returncode == 0, results[3]["idle"].stderr
    with h5py.File(folder / "idle.h5") as f:
        r = {k: f["ranks"][k][()] for k in f["ranks"]}
        profile = {k: f["profile"][k][()] for k in f["profile"]}
    # rank 0's own work: its server step, evaluation, results file, and packing (folding a few workers' rows
    # into an exact sum when they are cheaper to move than the sums' words)
    busy = r["server_seconds"][0] + r["eval_seconds"][0] + r["io_seconds"][0] + r["serialization_seconds"][0]
    idle_cpu_share = (r["loop_cpu_seconds"][0] - busy) / r["loop_wall_seconds"][0]
    assert r["loop_wall_seconds"][0] > 1.0, "workload too small to measure"
    assert idle_cpu_share < 0.05, f"rank 0 used {idle_cpu_share:.1%} of a core while waiting"

    # --profile: every rank's breakdown per round; the parts never overlap, so they fit in the round,
    # and they add up to the run's totals
    assert sorted(zip(profile["round"], profile["rank"])) == [(n, k) for n in range(1, 5) for k in range(3)]
    parts = [k for k in profile if k.endswith("_seconds") and k != "wall_seconds"]
    assert set(parts) == {k for k in r if k.endswith("_seconds") and not k.startswith(("loop_", "setup_"))}
    assert np.all(r["setup_wall_seconds"] > 0) and np.all(r["peak_rss_bytes"] > 50e6)
    assert np.all(sum(profile[k] for k in parts) <= profile["wall_seconds"] * 1.001 + 1e-4)
    assert r["compute_seconds"][1:].min() > 0.5 * r["loop_wall_seconds"][1:].max()  # workers were busy training
    for k in parts:
        np.testing.assert_allclose([profile[k][profile["rank"] == rank].sum() for rank in range(3)], r[k])
    text = results[0]["report"].stdout
    assert "time by rank" in text and "median round by rank" in text


def test_a_kept_launch_runs_job_after_job_and_ends_with_the_process_that_keeps_it(tmp_path):
    """tests/conftest.py's Launch: one launch runs a pytest process's jobs of a rank count one after another (a
    job that fails leaves it running for the next), and a pytest process that dies without closing it leaves no
    rank behind."""
    keeper = ("import os; from tests.conftest import Launch, REPO; quickstart = str(REPO / 'configs/quickstart.yaml'); "
              "codes = [Launch.run(args, 2).returncode for args in (['validate', quickstart], "
              "['run', str(REPO / 'configs/nothing.yaml')], ['validate', quickstart])]; "
              "print(*codes, Launch.running[2].proc.pid, Launch.running[2].jobs, flush=True); os._exit(0)")
    proc = subprocess.run([sys.executable, "-c", keeper], capture_output=True, text=True, timeout=HANG_S,
                          env=mpi_env(), cwd=REPO)
    *codes, launch, jobs = map(int, proc.stdout.split())
    assert (codes, jobs) == ([0, 2, 0], 3), proc.stderr
    deadline = time.monotonic() + HANG_S
    while processes(SESSION, launch):  # its ranks see the keeper gone within a poll
        assert time.monotonic() < deadline
        time.sleep(0.05)
