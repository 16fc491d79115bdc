"""Whole jobs under a real ``mpirun``: rank-count invariance, one-line errors, aborts, idle server."""

import os

import h5py
import numpy as np
import pytest
import torch

from mpifl.results import read_results
from tests.conftest import HANG_S, assert_same, deterministic, run_config, run_mpifl
from tests.test_append_only import check_committed


def mpifl_lines(stderr: str) -> list[str]:
    """Our own stderr lines (mpirun may add its own notice about a non-zero exit status)."""
    assert "Traceback" not in stderr
    return [line for line in stderr.splitlines() if line.startswith("mpifl")]


def final_state(path):
    with h5py.File(path) as f:
        return f["model/global_model"][()], {k: f["eval"][k][()] for k in f["eval"]}


def test_global_model_is_bitwise_identical_for_1_to_4_ranks(write_config, tmp_path):
    config = write_config({"rounds": 2, "clients_per_round": 5, "client": {"momentum": 0.9, "weight_decay": 1e-4}})
    results = {}
    for ranks in (1, 2, 3, 4):
        out = tmp_path / f"p{ranks}.h5"
        proc = run_mpifl(["run", str(config), "--out", str(out), "--quiet"], ranks=ranks)
        assert proc.returncode == 0, proc.stderr
        results[ranks] = final_state(out)
    model, metrics = results[1]
    for ranks in (2, 3, 4):
        assert np.array_equal(results[ranks][0], model), f"P={ranks} differs from P=1"
        for key, values in metrics.items():
            assert np.array_equal(results[ranks][1][key], values, equal_nan=True), key
    with h5py.File(tmp_path / "p3.h5") as f:
        assert sorted(f["ranks/clients"][()]) == [0, 5, 5]


def test_threads_per_rank_keep_results_bitwise_identical_on_1_and_3_ranks(write_config, tmp_path):
    """Two torch threads on every rank (what --cpus-per-task=2 gives under jobs/mpifl.sbatch): a client's
    arithmetic depends on its rank's thread count, which is the same on every rank, never on the rank count."""
    settings = {"rounds": 2, "model": {"channels": [16], "fc_hidden": 64},
                "client": {"momentum": 0.9, "batch_size": 32}}
    config = write_config({**settings, "threads_per_rank": 2})
    before = torch.get_num_threads()
    try:
        run_config(config, tmp_path / "p1.h5")  # in this process: 1 rank
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    run_config(config, tmp_path / "p3.h5", ranks=3)
    two_threads = deterministic(tmp_path / "p1.h5")
    assert_same(two_threads, deterministic(tmp_path / "p3.h5"))
    run_config(write_config(settings, name="one.yaml"), tmp_path / "one.h5")  # the default: 1 thread
    # the thread count reaches the bits here, so a rank computing with another count would show above
    one_thread = deterministic(tmp_path / "one.h5")
    assert not np.array_equal(two_threads["model/global_model"], one_thread["model/global_model"])


@pytest.mark.parametrize("ranks", [0, 3])
def test_unwritable_output_is_refused_before_training(write_config, tmp_path, ranks):
    """As root too (where permissions do not stop writes): the results path runs through a regular file."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = blocker / "sub" / "run.h5"
    proc = run_mpifl(["run", str(write_config({"rounds": 20})), "--out", str(out)], ranks=ranks, timeout=HANG_S)
    assert proc.returncode == 2
    assert mpifl_lines(proc.stderr) == [f"mpifl: error: output {out}: cannot be written: Not a directory ({blocker})"]
    assert "round" not in proc.stdout  # nothing trained


def test_dynamic_placement_balances_rounds_without_changing_results(write_config, tmp_path):
    """Unequal clients (Dirichlet sizes): re-spreading each round's clients over the workers evens
    their work, and the results are bitwise those of static ownership."""
    config = write_config({"rounds": 4, "clients_per_round": 8,
                           "data": {"num_clients": 16, "partition": "dirichlet", "alpha": 0.3}})
    runs = {}
    for placement in ("static", "dynamic"):
        out = tmp_path / f"{placement}.h5"
        proc = run_mpifl(["run", str(config), "--out", str(out), "--quiet", "--set", f"placement={placement}"],
                         ranks=3)
        assert proc.returncode == 0, proc.stderr
        with h5py.File(out) as f:
            runs[placement] = final_state(out), f["rounds/load_imbalance"][()]
    (model, metrics), static_imbalance = runs["static"]
    (dynamic_model, dynamic_metrics), dynamic_imbalance = runs["dynamic"]
    assert np.array_equal(model, dynamic_model)
    for key, values in metrics.items():
        assert np.array_equal(dynamic_metrics[key], values, equal_nan=True), key
    assert np.all(dynamic_imbalance <= static_imbalance) and dynamic_imbalance.mean() < static_imbalance.mean()


@pytest.mark.parametrize("ranks", [0, 3])
def test_bad_config_is_one_line_and_exit_code_2(write_config, tmp_path, ranks):
    out = tmp_path / "never.h5"
    proc = run_mpifl(["run", str(write_config({"client": {"lr": -1}})), "--out", str(out)], ranks=ranks)
    assert proc.returncode == 2
    assert mpifl_lines(proc.stderr) == ["mpifl: error: client.lr: must be > 0, got -1.0"]
    assert not out.exists()


@pytest.mark.parametrize("ranks", [0, 3])
def test_missing_data_is_one_line_and_exit_code_2(write_config, tmp_path, ranks):
    config = write_config({"data": {"dataset": "mnist", "root": str(tmp_path / "nowhere")}})
    proc = run_mpifl(["run", str(config), "--out", str(tmp_path / "x.h5")], ranks=ranks)
    assert proc.returncode == 2
    errors = mpifl_lines(proc.stderr)
    assert len(errors) == 1 and errors[0].startswith("mpifl: error:") and "nowhere" in errors[0]


def test_validate_command(write_config, tmp_path):
    ok = run_mpifl(["validate", str(write_config())])
    assert ok.returncode == 0 and "valid: 10 clients (8 seen)" in ok.stdout
    bad = run_mpifl(["validate", str(write_config({"clients_per_round": 9})), "--set", "data.unseen_fraction=0.5"])
    assert bad.returncode == 2
    assert bad.stderr.strip() == "mpifl: error: clients_per_round: 9 exceeds the 5 seen clients of the data"
    stateful = run_mpifl(["validate", str(write_config()), "--set", "algorithm=scaffold", "--set", "placement=dynamic"])
    assert stateful.returncode == 0  # a visiting client takes its state along
    cli = run_mpifl(["run"])
    assert cli.returncode == 2


def test_exception_on_a_worker_aborts_the_job_with_one_message(write_config, tmp_path):
    """Rank 2 raises at the start of round 3 of 50: the job ends (a job that waited on rank 2 instead would
    hang to the timeout) with one line naming it, and keeps the last results write that was committed."""
    out = tmp_path / "r.h5"
    env_fault = {"MPIFL_INJECT_FAULT": "2:3"}
    os.environ.update(env_fault)
    try:
        proc = run_mpifl(["run", str(write_config({"rounds": 50})), "--out", str(out)], ranks=3)
    finally:
        del os.environ["MPIFL_INJECT_FAULT"]
    assert proc.returncode != 0
    assert mpifl_lines(proc.stderr) == [
        "mpifl: error: rank 2 of 3 failed: RuntimeError: fault injected by MPIFL_INJECT_FAULT=2:3; no checkpoint was "
        "taken yet: start again with --overwrite"
    ], proc.stderr
    # Rank 0 writes beside the rounds, so the abort may come before its first write committed (no file: a new
    # file appears only once its first write is whole) or while it writes round 1 or 2: the file then holds the
    # last committed write, intact, and never a round past the fault.
    if out.exists():
        assert check_committed(out) in (1, 2)
        assert read_results(out).attrs["status"] == "running"


def test_idle_server_does_not_spin(write_config, tmp_path):
    """Oversubscribed (3 ranks on this machine's cores): rank 0 waits while workers train."""
    config = write_config({
        "rounds": 4, "eval_every": 4, "clients_per_round": 8,
        "model": {"name": "mlp", "hidden": [256, 256]}, "client": {"epochs": 20},
    })
    out = tmp_path / "r.h5"
    proc = run_mpifl(["run", str(config), "--out", str(out), "--quiet", "--profile"], ranks=3)
    assert proc.returncode == 0, proc.stderr
    with h5py.File(out) as f:
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
    text = run_mpifl(["report", str(out)]).stdout
    assert "time by rank" in text and "median round by rank" in text
