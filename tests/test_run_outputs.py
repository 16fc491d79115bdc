"""Never lose a run: ``mpifl run`` replaces no file it should not, two runs never share a results file, a
stopped or killed run continues from its results file alone, bitwise, and its checkpoints stay bounded.

Each test of a refusal checks that the file's bytes are unchanged afterwards."""

import hashlib
import json
import os
import platform
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest
import yaml

from mpifl.cli import main
from mpifl.results import read_results, shard_dir
from mpifl.results.layout import rounds_completed
from tests.conftest import HANG_S, REPO, TINY, _merge, assert_same, deterministic, mpi_env, mpirun_cmd, run_mpifl
from tests.test_checkpoint import kill_job

LONG = _merge(TINY, {"model": {"name": "logistic"}, "rounds": 120, "eval_every": 50, "checkpoint_every": 5})
"""A run that is still under way when a test acts on its first checkpoints (round 5 or 10): 110 rounds more, many
times what noticing the checkpoint and signalling take, however loaded the machine (the job slows with it). Each
resume runs the rest in this process, so more rounds only cost time (400 cost a minute in this file)."""


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def start(args: list[str], ranks: int = 0) -> subprocess.Popen:
    cmd = (mpirun_cmd(ranks) if ranks else []) + [sys.executable, "-m", "mpifl", "run", *args]
    return subprocess.Popen(cmd, env=mpi_env(), cwd=REPO, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for_checkpoint(job: subprocess.Popen, out: Path, at_least: int = 1) -> None:
    """Until the running job has committed a checkpoint (of round ``at_least`` or later) in ``out``."""
    deadline = time.monotonic() + HANG_S
    while True:
        assert job.poll() is None, job.communicate()
        assert time.monotonic() < deadline, "no checkpoint committed in two minutes"
        if out.exists():
            try:
                with h5py.File(out, "r", locking=False) as f:
                    if "checkpoint" in f and int(f["checkpoint"].attrs["round"]) >= at_least:
                        return
            except OSError:  # between the writer's flushes
                pass
        time.sleep(0.05)


@pytest.fixture(scope="module")
def long_config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("long") / "long.yaml"
    path.write_text(yaml.safe_dump(LONG))
    return path


@pytest.fixture(scope="module")
def uninterrupted(long_config) -> dict:
    out = long_config.parent / "whole.h5"
    assert main(["run", str(long_config), "--out", str(out), "--quiet"]) == 0
    return deterministic(out)


def test_a_file_that_is_not_a_results_file_is_never_replaced(write_config, tmp_path, capsys):
    config = write_config()
    notes = tmp_path / "notes.md"
    notes.write_text("# my notes\n")
    for target in (config, notes):
        before = digest(target)
        for flag in ([], ["--overwrite"]):
            assert main(["run", str(config), "--out", str(target), "--quiet", *flag]) == 2
            assert "is a file that is not an mpifl results file" in capsys.readouterr().err
            assert digest(target) == before
    assert not (tmp_path / ".notes.md.lock").exists() and not shard_dir(notes).exists()


def test_a_completed_run_is_replaced_only_with_overwrite(write_config, tmp_path, capsys):
    config, out = write_config(), tmp_path / "r.h5"
    assert main(["run", str(config), "--out", str(out), "--quiet"]) == 0
    before = digest(out)
    assert main(["run", str(config), "--out", str(out), "--quiet", "--set", "client.lr=0.2"]) == 2
    assert "holds a completed run (3 rounds); --overwrite replaces it" in capsys.readouterr().err
    assert digest(out) == before
    assert main(["run", str(config), "--out", str(out), "--quiet", "--set", "client.lr=0.2", "--overwrite"]) == 0
    assert read_results(out).config["client"]["lr"] == 0.2


def test_the_same_command_after_a_kill_refuses_and_says_how_to_resume_then_resume_alone_is_bitwise(
        long_config, uninterrupted, tmp_path):
    """The first row of the issue: a 3-rank run killed (SIGKILL) mid-way, then the same command again."""
    out = tmp_path / "r.h5"
    command = [str(long_config), "--out", str(out), "--quiet"]
    job = start(command, ranks=3)
    wait_for_checkpoint(job, out, at_least=10)
    kill_job(job)
    before, shards = digest(out), {p.name: digest(p) for p in shard_dir(out).iterdir()}
    again = subprocess.run([sys.executable, "-m", "mpifl", "run", *command], env=mpi_env(), cwd=REPO,
                           capture_output=True, text=True)
    assert again.returncode == 2 and again.stderr.count("\n") == 1, again.stderr
    with h5py.File(out, "r") as f:
        done, checkpoint = rounds_completed(f), int(f["checkpoint"].attrs["round"])
    # where the run stands, as report says it, and how to continue it launched as before (issue 50 rows 2, 5)
    assert again.stderr == (f"mpifl: error: output {out} holds an unfinished run: stopped at round {done} of "
                            f"{LONG['rounds']}, resumable from round {checkpoint}: mpirun -n 3 --oversubscribe python "
                            f"-m mpifl run --resume {out} (any rank count); or --overwrite starts it again\n")
    assert digest(out) == before and {p.name: digest(p) for p in shard_dir(out).iterdir()} == shards
    assert main(["run", "--resume", str(out), "--quiet"]) == 0  # the file alone, on another rank count
    assert_same(uninterrupted, deterministic(out))


def test_a_second_run_on_the_same_output_refuses_at_once(long_config, tmp_path, capsys):
    out = tmp_path / "r.h5"
    first = start([str(long_config), "--out", str(out), "--quiet"])
    wait_for_checkpoint(first, out)
    assert main(["run", str(long_config), "--out", str(out), "--quiet", "--overwrite",
                 "--set", "client.lr=0.3"]) == 2
    err = capsys.readouterr().err
    assert f"output {out} is being written by another run (pid {first.pid} on" in err
    assert first.poll() is None  # untouched by the refused one
    kill_job(first)
    assert read_results(out).config["client"]["lr"] == LONG["client"]["lr"]


@pytest.mark.parametrize(("ranks", "sig", "to_ranks"), [(0, signal.SIGINT, False), (0, signal.SIGTERM, False),
                                                       (3, signal.SIGUSR1, False), (3, signal.SIGINT, True)],
                         ids=["ctrl-c", "sigterm", "sigusr1-under-mpirun", "sigint-to-the-ranks-under-mpirun"])
def test_a_signal_stops_after_the_round_with_a_checkpoint_and_the_file_alone_resumes_bitwise(
        long_config, uninterrupted, tmp_path, ranks, sig, to_ranks):
    """SIGINT and SIGTERM to a single process, SIGUSR1 to mpirun (which forwards it to every rank; it kills the
    ranks a moment after SIGTERM or SIGINT), SIGINT to mpirun's ranks themselves (each in a process group of its
    own, so a terminal's Ctrl-C reaches only mpirun): the job ends after the round under way, saves a checkpoint
    there even between two of ``checkpoint_every``'s, marks the file interrupted and prints, once, the exact
    command that continues it."""
    out = tmp_path / "r.h5"
    job = start([str(long_config), "--out", str(out)], ranks=ranks)
    wait_for_checkpoint(job, out)
    if to_ranks:  # mpirun's children are the ranks
        for pid in Path(f"/proc/{job.pid}/task/{job.pid}/children").read_text().split():
            os.kill(int(pid), sig)
    else:
        job.send_signal(sig)
    stdout, stderr = job.communicate(timeout=HANG_S)
    assert job.returncode == 128 + sig, stderr
    assert stderr.count("and saved a checkpoint; continue with: ") == 1, stderr
    saved = read_results(out, checkpoint=True)
    stopped = int(saved.table_attrs["checkpoint"]["round"])
    assert saved.attrs["status"] == "interrupted" and saved.attrs["rounds_completed"] == stopped < LONG["rounds"]
    launch = f"mpirun -n {ranks} --oversubscribe " if ranks else ""  # as it was launched (issue 50 row 5)
    assert (f"mpifl: {sig.name}: stopped after round {stopped} of {LONG['rounds']} and saved a checkpoint; "
            f"continue with: {launch}python -m mpifl run --resume {out} (any rank count)") in stderr
    assert "Traceback" not in stderr
    assert main(["run", "--resume", str(out), "--quiet"]) == 0
    assert_same(uninterrupted, deterministic(out))
    segments = read_results(out).table("segments")
    assert segments["first_round"].tolist() == [1, stopped + 1]
    assert segments["last_round"].tolist() == [stopped, LONG["rounds"]]
    assert segments["world_size"].tolist() == [max(ranks, 1), 1]


def test_resuming_names_each_changed_key_and_both_values(write_config, tmp_path, capsys):
    out = tmp_path / "r.h5"
    assert main(["run", str(write_config({"checkpoint_every": 1})), "--out", str(out), "--quiet"]) == 0
    before = digest(out)
    assert main(["run", "--resume", str(out), "--set", "rounds=5", "--set", "client.lr=0.3",
                 "--set", "model.fc_hidden=8"]) == 2
    err = capsys.readouterr().err
    assert "client.lr: 0.1 in the file, 0.3 given; model.fc_hidden: 16 in the file, 8 given" in err
    assert digest(out) == before
    assert main(["run", "--resume", str(out), "--set", "rounds=5", "--quiet"]) == 0  # rounds may change
    assert main(["run", "--resume", str(tmp_path / "nothing.h5")]) == 2
    assert "--resume: " + str(tmp_path / "nothing.h5") + " does not exist" in capsys.readouterr().err
    assert main(["run"]) == 2
    assert "give a CONFIG file, or --resume RESULTS.h5" in capsys.readouterr().err


def test_report_shows_each_segment_and_the_total(write_config, tmp_path, capsys):
    out = tmp_path / "r.h5"
    assert main(["run", str(write_config({"checkpoint_every": 1, "rounds": 2})), "--out", str(out), "--quiet"]) == 0
    assert main(["run", "--resume", str(out), "--set", "rounds=4", "--quiet"]) == 0
    capsys.readouterr()
    assert main(["report", str(out)]) == 0
    text = capsys.readouterr().out
    assert "run in 2 segments" in text and "rounds 1-2 on 1 rank(s)" in text and "rounds 3-4 on 1 rank(s)" in text
    assert main(["report", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    walls = [s["wall_time_s"] for s in summary["segments"]]
    assert summary["wall_time_s"] == pytest.approx(sum(walls))


def test_checkpoints_stay_bounded_and_an_older_one_resumes_when_the_newest_is_lost(write_config, tmp_path, capsys):
    """Every checkpoint's files live in the shard folder, the newest ``checkpoint_keep`` of them; the results file
    holds only their manifest, so it is no larger with a checkpoint every round than with none at all (HDF5 would
    keep the space of every replaced checkpoint)."""
    config = write_config({"rounds": 8, "model": {"name": "cnn", "channels": [16], "fc_hidden": 64}})
    plain, out = tmp_path / "plain.h5", tmp_path / "r.h5"
    assert main(["run", str(config), "--out", str(plain), "--quiet"]) == 0
    assert main(["run", str(config), "--out", str(out), "--quiet", "--set", "checkpoint_every=1",
                 "--set", "checkpoint_keep=3"]) == 0
    assert out.stat().st_size < plain.stat().st_size + 64 * 1024
    kept = sorted(p.name for p in shard_dir(out).iterdir())
    assert kept == sorted(f"round{r}-{who}.h5" for r in (6, 7, 8) for who in ("rank0", "server"))
    for name in ("round8-server.h5", "round7-rank0.h5"):  # the two newest are lost: the third resumes
        (shard_dir(out) / name).unlink()
    whole = tmp_path / "whole.h5"
    assert main(["run", str(config), "--out", str(whole), "--quiet", "--set", "rounds=10"]) == 0
    assert main(["run", "--resume", str(out), "--set", "rounds=10"]) == 0
    assert "from round 7, 10 rounds" in capsys.readouterr().out
    assert_same(deterministic(whole), deterministic(out))


def test_a_heartbeat_between_evaluations(write_config, capsys, tmp_path):
    config = write_config({"rounds": 6, "eval_every": 100, "model": {"name": "logistic"}})
    assert main(["run", str(config), "--out", str(tmp_path / "r.h5"), "--heartbeat", "1e-9"]) == 0
    beats = [line for line in capsys.readouterr().out.splitlines() if "rounds/s" in line]
    assert [line.split(" | ")[0] for line in beats] == [f"round {r}/6" for r in range(1, 7)]  # 6: the evaluation's
    assert all(re.search(r" \| elapsed (\d+h)?\d+m\d\ds \| ETA ", line) for line in beats)  # any minutes: a busy host
    assert " | loss " in beats[-1] and beats[-1].endswith("ETA 0m00s")
    assert main(["run", str(config), "--out", str(tmp_path / "q.h5"), "--heartbeat", "1e-9", "--quiet"]) == 0
    assert "rounds/s" not in capsys.readouterr().out


def test_every_evaluation_line_says_the_pace_and_eta(write_config, capsys, tmp_path):
    """With evaluations more often than the heartbeat, the evaluation lines are the only progress: each says when
    the run ends."""
    config = write_config({"rounds": 4, "eval_every": 2, "model": {"name": "logistic"}})
    assert main(["run", str(config), "--out", str(tmp_path / "r.h5"), "--heartbeat", "1e9"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("round ")]
    assert [line.split(" | ")[0] for line in lines] == ["round 2/4", "round 4/4"]
    assert all(" seen acc " in line and " rounds/s | elapsed " in line and " | ETA " in line for line in lines)


def test_more_worker_ranks_than_clients_at_once_says_some_idle(write_config, tmp_path):
    config = write_config({"clients_per_round": 2, "rounds": 1})
    notes = []
    for ranks in (4, 3):
        proc = run_mpifl(["run", str(config), "--out", str(tmp_path / f"r{ranks}.h5")], ranks=ranks)
        assert proc.returncode == 0, proc.stderr
        notes.append([line for line in proc.stdout.splitlines() if line.startswith("mpifl: note:")])
    assert notes == [["mpifl: note: 3 worker ranks, but at most 2 clients train at once: 1 rank(s) idle every "
                      "round (at most 3 ranks keep every worker busy)"], []]


@pytest.mark.parametrize("seconds", ["-5", "0", "nan"])
def test_a_heartbeat_that_is_not_positive_is_one_line_and_exit_2(write_config, capsys, tmp_path, seconds):
    out = tmp_path / "r.h5"
    assert main(["run", str(write_config()), "--out", str(out), "--heartbeat", seconds]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mpifl: error: --heartbeat: expected a positive number")
    assert not out.exists()


def test_report_of_a_file_a_run_is_creating_says_so(tmp_path, capsys):
    """In a run's first seconds its results file exists only under a temporary name, its lock held: report names
    the run that is creating it, not "does not exist"."""
    out = tmp_path / "new.h5"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from mpifl.results.guard import OutputLock; "
                               f"OutputLock.acquire({str(out)!r}); print('locked', flush=True); time.sleep(600)"],
                              stdout=subprocess.PIPE, text=True, env=mpi_env(), cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert main(["report", str(out)]) == 2
        err = capsys.readouterr().err
        assert err == (f"mpifl: error: results file {out} is being created by a run (pid {holder.pid} on "
                       f"{platform.node()}): it appears once the run's first results are written (after the first "
                       "evaluation or checkpoint); try again then\n")
    finally:
        holder.kill()
        holder.wait()
    assert main(["report", str(out)]) == 2
    assert capsys.readouterr().err == f"mpifl: error: results file {out} does not exist\n"
