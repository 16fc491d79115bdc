"""Emulated faults (drop-out, deadlines, non-finite updates) and real ones (a worker rank killed)."""

import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from mpifl.cli import main
from mpifl.registry import known_algorithms, parse_config
from mpifl.results import read_results
from tests.conftest import HANG_S, REPO, TINY, _merge, mpi_env, mpirun_cmd, run_mpifl
from tests.test_checkpoint import CONFIGS, assert_same, deterministic


def run(write_config, tmp_path, overrides, name="r"):
    out = tmp_path / f"{name}.h5"
    assert main(["run", str(write_config(overrides, name=f"{name}.yaml")), "--out", str(out), "--quiet"]) == 0
    return read_results(out)


def test_dropout_sends_nothing_and_is_rank_invariant(write_config, tmp_path):
    overrides = {"rounds": 6, "clients_per_round": 6, "faults": {"dropout": 0.4}}
    res = run(write_config, tmp_path, overrides)
    participants = res.table("rounds")["participants"]
    assert participants.min() < 6 and participants.sum() > 0
    ledger, names = res.table("ledger"), res.table_attrs["ledger"]["message_names"]
    for round_, count in enumerate(participants, 1):
        for name in ("model", "delta"):
            rows = (ledger["round"] == round_) & (ledger["stage"] == 0) & (ledger["message"] == names.index(name))
            assert rows.sum() == count  # dropped clients neither receive nor send
    proc = run_mpifl(["run", str(write_config(overrides)), "--out", str(tmp_path / "p3.h5"), "--quiet"], ranks=3)
    assert proc.returncode == 0, proc.stderr
    assert_same(deterministic(tmp_path / "r.h5"), deterministic(tmp_path / "p3.h5"))


def test_deadline_and_over_selection_use_expected_times(write_config, tmp_path):
    slow_links = {"distribution": "lognormal", "sigma": 1.0, "latency_s": 0.1, "up_mbps": 1, "down_mbps": 1,
                  "seconds_per_sample": 0.001}
    over = run(write_config, tmp_path, {"rounds": 4, "clients_per_round": 4, "network": slow_links,
                                        "faults": {"over_selection": 0.5}}, "over")
    assert np.all(over.table("rounds")["participants"] == 4)
    cfg = parse_config(_merge(TINY, {"network": slow_links}))
    from mpifl.comm.network import NetworkModel

    net = NetworkModel.from_config(cfg.network, 10, cfg.seed)
    d = over.table("model")["global_model"].size
    expected = 2 * net.latency_s + 4 * d / net.down_bytes_per_s + 4 * d / net.up_bytes_per_s
    deadline = float(np.median(expected))
    cut = run(write_config, tmp_path, {"rounds": 4, "clients_per_round": 6, "network": slow_links,
                                       "faults": {"deadline_s": deadline}}, "cut")
    assert cut.table("rounds")["participants"].max() < 6
    assert np.all(cut.table("rounds")["sim_time_s"] - cut.table("rounds")["server_time_s"] <= deadline + 1.0)


def test_over_selection_past_the_seen_clients_is_one_line_before_training(write_config, tmp_path, capsys):
    """6 of TINY's 8 seen clients a round, over-selected by half: 9 would be asked of 8; one line, exit code 2, and
    no results file."""
    out = tmp_path / "never.h5"
    config = write_config({"clients_per_round": 6, "faults": {"over_selection": 0.5}})
    assert main(["run", str(config), "--out", str(out)]) == 2
    assert capsys.readouterr().err == ("mpifl: error: faults.over_selection: selecting 9 clients per round exceeds "
                                       "the 8 seen clients of the data\n")
    assert not out.exists()


def test_non_finite_updates_are_rejected_or_abort(write_config, tmp_path, capsys):
    res = run(write_config, tmp_path, {"rounds": 3, "client": {"lr": 1e12}}, "skip")
    assert res.table("rounds")["rejected_updates"].sum() > 0
    assert "rejected non-finite delta" in capsys.readouterr().err
    out = tmp_path / "abort.h5"  # a real 3-rank job: the server's abort ends every rank, with one message
    config = write_config({"rounds": 3, "client": {"lr": 1e12}, "faults": {"nonfinite": "abort"}}, name="abort.yaml")
    proc = run_mpifl(["run", str(config), "--out", str(out), "--quiet"], ranks=3, own_launch=True)
    assert proc.returncode != 0 and proc.stderr.count("is not finite") == 1
    assert "mpifl: error: rank 0 of 3 failed: FloatingPointError: round 1: delta of client(s)" in proc.stderr


@pytest.mark.parametrize("algorithm", sorted(set(known_algorithms()) - {"local"}))  # Local uploads nothing
def test_nonfinite_abort_stops_every_algorithm_at_the_first_broken_update(algorithm, tmp_path):
    """``faults.nonfinite: abort``: the first broken upload ends the run with an error naming it, before the
    server uses any of it (in one process; the 3-rank job's abort path is the test above's)."""
    from mpi4py import MPI

    from mpifl.runtime.engine import Engine

    cfg = parse_config(_merge(CONFIGS[algorithm], {"rounds": 3, "faults": {"nonfinite": "abort", "corrupt": 0.5}}))
    engine = Engine(cfg, MPI.COMM_SELF, tmp_path / "r.h5")
    engine.prepare()
    with pytest.raises(FloatingPointError, match=r"round \d+: .* of client\(s\) \[\d+.*\] is not finite"):
        engine.run(progress=False)


def test_a_killed_worker_ends_the_job_quickly_and_keeps_the_results(write_config, tmp_path):
    config = write_config({"rounds": 400, "eval_every": 1, "client": {"epochs": 3}})
    out = tmp_path / "r.h5"
    cmd = mpirun_cmd(3) + [sys.executable, "-m", "mpifl", "run", str(config), "--out", str(out), "--quiet"]
    job = subprocess.Popen(cmd, env=mpi_env(), cwd=REPO, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + HANG_S
    while not out.exists():
        assert job.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    worker = _pid_of_rank(1, str(out))
    os.kill(worker, signal.SIGKILL)
    try:
        _, stderr = job.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        job.kill()
        pytest.fail("the job hung after a worker died")
    # quickly: it ended (well within HANG_S, a hang's bound) with rounds left of its 400, not by finishing them
    assert job.returncode != 0 and "rank 1" in stderr
    with h5py.File(out) as f:
        assert f.attrs["status"] == "running" and f.attrs["rounds_completed"] >= 1


def _pid_of_rank(rank: int, marker: str) -> int:
    """The process of ``rank`` in the job whose command line mentions ``marker``."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read().decode()
            environ = open(f"/proc/{pid}/environ", "rb").read().decode()
        except OSError:
            continue
        if marker in cmdline and "mpifl" in cmdline and f"OMPI_COMM_WORLD_RANK={rank}\0" in environ:
            return int(pid)
    raise AssertionError(f"rank {rank} not found")
