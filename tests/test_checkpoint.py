"""Checkpoint and exact resume: an interrupted run, resumed, ends bitwise equal to one never interrupted."""

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest
import torch
import yaml

from benchmarks.gpu_check import kill_session
from mpifl.cli import main
from mpifl.registry import known_algorithms
from mpifl.results import read_results, shard_dir
from mpifl.results.guard import inspect_output, lock_file
from mpifl.results.layout import rounds_completed
from mpifl.schema import ConfigError
from mpifl.state_io import read_client_states, read_state, write_object, write_state
from tests.algorithms.conftest import KARULA, RIDGE, SHARDS
from tests.algorithms.test_pefll import PEFLL
from tests.algorithms.test_pfedhn import PFEDHN
from tests.conftest import (
    HANG_S,
    REPO,
    _merge,
    assert_same,
    deterministic,
    mpi_env,
    mpirun_cmd,
    run_engine,
    run_mpifl_batch,
)
from tests.multinode.netns import peek

CONFIGS = {name: {**SHARDS, "algorithm": name} for name in known_algorithms()}
CONFIGS.update(pefll=PEFLL, pfedhn=PFEDHN, karula=_merge(RIDGE, KARULA))
CONFIGS["feddeper"] = _merge(CONFIGS["feddeper"], {"clients_per_round": 3})  # partial participation
# asynchronous: 4 of the 6 clients training at once on lognormal links, a server step every 3 arrivals
ASYNCHRONOUS_NETWORK = {"compute": "model", "seconds_per_sample": 0.001, "distribution": "lognormal", "sigma": 1.0}
CONFIGS["fedbuff"] = _merge(CONFIGS["fedbuff"], {"clients_per_round": 4, "fedbuff": {"buffer_size": 3},
                                                 "network": ASYNCHRONOUS_NETWORK})
# one arrival per round, 3 clients in flight, hinge staleness so that stale models are damped; seed 4 (the shards'
# 3 draws no corrupt upload among its first arrivals, which the fault matrix needs)
CONFIGS["fedasync"] = _merge(CONFIGS["fedasync"], {"clients_per_round": 3, "seed": 4, "network": ASYNCHRONOUS_NETWORK,
                                                   "fedasync": {"staleness": "hinge", "a": 1.0, "b": 1}})
for _name in ("perfedavg", "fedrep", "knnper"):  # PeFLL's baselines: evaluated on unseen clients too
    CONFIGS[_name] = _merge(CONFIGS[_name], {"clients_per_round": 3, "data": {"unseen_fraction": 0.34}})
# the adaptive server optimizers (server.optimizer) on each kind of server step: the whole model (FedAvg), a part
# at its own period (FedALS), beside control variates (SCAFFOLD), asynchronous (FedBuff), one row per cluster
# (IFCA), the body alone (FedRep)
SERVER_OPTIMIZERS = {f"{name}_{optimizer}": _merge(CONFIGS[name], {"server": {"optimizer": optimizer, "lr": 0.05}})
                     for name, optimizer in (("fedavg", "adam"), ("fedals", "yogi"), ("scaffold", "adagrad"),
                                             ("fedbuff", "yogi"), ("ifca", "adam"), ("fedrep", "adagrad"))}
RUNS = {**CONFIGS, **SERVER_OPTIMIZERS}


def write(tmp_path, cfg, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(_merge(cfg, {"rounds": 5, "checkpoint_every": 2, "eval_every": 1})))
    return path


@pytest.mark.parametrize("algorithm", sorted(RUNS))
def test_resume_after_a_failure_is_bitwise_identical(algorithm, tmp_path, monkeypatch):
    config = write(tmp_path, RUNS[algorithm])
    full, part = tmp_path / "full.h5", tmp_path / "part.h5"
    assert main(["run", str(config), "--out", str(full), "--quiet"]) == 0
    monkeypatch.setenv("MPIFL_INJECT_FAULT", "0:4")  # dies in round 4; the last checkpoint is round 2
    assert main(["run", str(config), "--out", str(part), "--quiet"]) == 1
    with h5py.File(part) as f:
        assert f["checkpoint"].attrs["round"] == 2 and f.attrs["rounds_completed"] == 3
    monkeypatch.delenv("MPIFL_INJECT_FAULT")
    assert main(["run", str(config), "--resume", str(part), "--quiet"]) == 0
    assert_same(deterministic(full), deterministic(part))
    for table in ("rounds", "eval"):  # which columns are the algorithm's own diagnostics survives a resume
        assert read_results(part).diagnostics(table) == read_results(full).diagnostics(table)


def keeps_client_state(algorithm: str, tmp_path) -> bool:  # noqa: ANN001
    """Whether ``algorithm``'s clients write state (observed in a one-round run's checkpoint)."""
    from mpi4py import MPI

    path = run_engine(_merge(CONFIGS[algorithm], {"rounds": 1, "eval_every": 1, "checkpoint_every": 1}),
                      MPI.COMM_SELF, tmp_path / "probe.h5")
    return any(read_client_states(path).values())


def kill_at_a_checkpoint(config: Path, part: Path) -> int:
    """A 2-rank job of ``config`` writing ``part`` (one worker holds every client), SIGKILLed once its file holds a
    checkpoint; that checkpoint's round."""
    cmd = mpirun_cmd(2) + [sys.executable, "-m", "mpifl", "run", str(config), "--out", str(part), "--quiet"]
    job = subprocess.Popen(cmd, env=mpi_env(), cwd=REPO, start_new_session=True, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + HANG_S
    while not peek(part)[1]:  # a plain h5py read fails now and then: it may fall in one of the job's writes
        assert job.poll() is None, "the job finished before it could be killed; make it longer"
        assert time.monotonic() < deadline
        time.sleep(0.05)
    kill_job(job)
    with h5py.File(part) as f:
        assert f.attrs["status"] == "running"
        return int(f["checkpoint"].attrs["round"])


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory) -> dict[str, tuple[Path, list[str], subprocess.CompletedProcess]]:
    """For each algorithm whose clients keep state: a 2-rank job SIGKILLed after a checkpoint, then resumed on 3
    ranks for 3 more rounds, where two workers share the clients; the resumes share one 3-rank launch
    (tests/batch.py). ``{algorithm: (folder, the resume's --set, its result)}``."""
    folder = tmp_path_factory.mktemp("killed")
    killed = {}
    for algorithm in known_algorithms():
        (folder / algorithm).mkdir()
        if keeps_client_state(algorithm, folder / algorithm):
            config = folder / algorithm / "cfg.yaml"
            config.write_text(yaml.safe_dump(_merge(CONFIGS[algorithm], {"rounds": 1000, "checkpoint_every": 2,
                                                                         "eval_every": 1})))
            checkpoint = kill_at_a_checkpoint(config, folder / algorithm / "part.h5")
            killed[algorithm] = folder / algorithm, [f"--set=rounds={checkpoint + 3}"]
    resumes = run_mpifl_batch([["run", str(where / "cfg.yaml"), "--resume", str(where / "part.h5"), "--quiet",
                                *rounds] for where, rounds in killed.values()], 3, folder / "batch")
    return {algorithm: (*killed[algorithm], proc) for algorithm, proc in zip(killed, resumes)}


@pytest.mark.parametrize("algorithm", known_algorithms())
def test_sigkill_of_the_whole_job_then_resume_on_another_rank_count(algorithm, killed_and_resumed):
    """Clients keep state on their worker (SCAFFOLD's cᵢ, FedDeper's vᵢ, ...): a 2-rank job killed with
    SIGKILL after a checkpoint resumes on 3 ranks, where the clients are split over two workers, and ends
    bitwise where an uninterrupted run of the same length ends."""
    if algorithm not in killed_and_resumed:
        pytest.skip(f"{algorithm}'s clients keep no state (its resume on 2 ranks: tests/mpi/test_fault_matrix_mpi.py)")
    folder, rounds, proc = killed_and_resumed[algorithm]
    assert proc.returncode == 0, proc.stderr
    full = folder / "full.h5"
    assert main(["run", str(folder / "cfg.yaml"), "--out", str(full), "--quiet", *rounds]) == 0
    assert_same(deterministic(full), deterministic(folder / "part.h5"))


def kill_job(job: subprocess.Popen) -> None:
    """SIGKILL a whole job started in a session of its own at once: the launcher and every rank (Open MPI's
    ranks live in process groups of their own, but in the launcher's session)."""
    kill_session(job.pid)
    job.wait()


def test_resume_refuses_a_different_config_or_no_checkpoint(write_config, tmp_path, capsys):
    out = tmp_path / "r.h5"
    assert main(["run", str(write_config({"checkpoint_every": 1, "rounds": 2})), "--out", str(out), "--quiet"]) == 0
    other = write_config({"checkpoint_every": 1, "rounds": 3, "client": {"lr": 0.3}}, name="other.yaml")
    assert main(["run", str(other), "--resume", str(out)]) == 2
    err = capsys.readouterr().err
    assert "config differs" in err and "client.lr: 0.1 in the file, 0.3 given" in err
    plain = tmp_path / "plain.h5"
    assert main(["run", str(write_config()), "--out", str(plain), "--quiet"]) == 0
    before = plain.read_bytes()
    assert main(["run", str(write_config()), "--resume", str(plain)]) == 2
    assert capsys.readouterr().err == (
        f"mpifl: error: --resume: {plain} holds a completed run of 3 rounds but no checkpoint to extend it from "
        "(checkpoint_minutes: 10 takes one after each 10 minutes of training, checkpoint_every: 0 none by round); "
        "--overwrite with --set rounds=N runs it again, longer\n")
    assert plain.read_bytes() == before


def test_checkpoints_hold_no_pickle(write_config, tmp_path):
    out = tmp_path / "r.h5"
    assert main(["run", str(write_config({"checkpoint_every": 1})), "--out", str(out), "--quiet"]) == 0
    magic = b"\x89HDF\r\n\x1a\n"  # each rank's state is itself an HDF5 tree
    with h5py.File(out) as f:
        shards = json.loads(f["checkpoint"]["shards"][()].tobytes())
    assert any(s.get("server") for s in shards) and any(not s.get("server") for s in shards)
    assert all((shard_dir(out) / s["file"]).read_bytes()[:8] == magic for s in shards)


def test_a_kill_9_of_a_run_that_checkpoints_by_time_resumes_and_report_says_where(write_config, tmp_path, capsys):
    """Issue 45 rows 6-7, issue 50 rows 2-3 and 5: without checkpoint_every, checkpoint_minutes still saves
    checkpoints (here every 0.03 s); report calls the run running while it holds its lock, and after a SIGKILL of
    the whole job calls it stopped, in its first line and its --json too, and says whence it resumes, with the
    launcher's own options; the resume then completes it. A run that never checkpointed is "not resumable", and
    ``--resume`` says why: the settings that would have saved it, and the rounds lost."""
    config = write_config({"rounds": 100_000, "eval_every": 1, "checkpoint_minutes": 0.0005,
                           "model": {"name": "logistic"}})
    part = tmp_path / "part.h5"
    cmd = mpirun_cmd(2) + [sys.executable, "-m", "mpifl", "run", str(config), "--out", str(part), "--quiet"]
    job = subprocess.Popen(cmd, env=mpi_env(), cwd=REPO, start_new_session=True, stderr=subprocess.DEVNULL)
    try:  # a failed assertion leaves no job training beside the rest of the suite
        deadline = time.monotonic() + HANG_S
        while not peek(part)[1]:
            assert job.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        assert main(["report", str(part), "--json"]) == 0
        live = json.loads(capsys.readouterr().out)
        assert live["status"] == "running"
        assert live["standing"].endswith(" of 100000 rounds so far: a process holds its lock")
    finally:
        kill_job(job)
    with h5py.File(part) as f:
        done, checkpoint = rounds_completed(f), int(f["checkpoint"].attrs["round"])
    standing = (f"stopped at round {done} of 100000, resumable from round {checkpoint}: mpirun -n 2 --oversubscribe "
                f"python -m mpifl run --resume {part} (any rank count)")
    assert main(["report", str(part)]) == 0
    first, second = capsys.readouterr().out.splitlines()[:2]
    assert first.startswith(f"{part}: fedavg, stopped, {done} rounds on 2 rank(s)") and second == standing
    assert main(["report", str(part), "--json"]) == 0
    dead = json.loads(capsys.readouterr().out)
    assert (dead["status"], dead["standing"], dead["resumable_from"]) == ("stopped", standing, checkpoint)
    assert main(["run", "--resume", str(part), "--quiet", f"--set=rounds={checkpoint + 2}"]) == 0
    assert read_results(part).attrs["status"] == "completed"

    never = tmp_path / "never.h5"
    config = write_config({"rounds": 100_000, "eval_every": 1, "model": {"name": "logistic"}}, name="never.yaml")
    job = subprocess.Popen([sys.executable, "-m", "mpifl", "run", str(config), "--out", str(never), "--quiet"],
                           env=mpi_env(), cwd=REPO, start_new_session=True, stderr=subprocess.DEVNULL)
    try:
        while peek(never)[0] < 2:
            assert job.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        kill_job(job)
    done = read_results(never).attrs["rounds_completed"]
    assert main(["report", str(never)]) == 0
    first, second = capsys.readouterr().out.splitlines()[:2]
    assert first.startswith(f"{never}: fedavg, stopped, {done} rounds") and second == (
        f"stopped at round {done} of 100000, not resumable (no checkpoint): --overwrite starts it again")
    before = never.read_bytes()
    assert main(["run", "--resume", str(never), "--quiet"]) == 2
    assert capsys.readouterr().err == (
        f"mpifl: error: --resume: {never} holds no checkpoint: the run stopped at round {done} of 100000, before its "
        "first (checkpoint_minutes: 10 takes one after each 10 minutes of training, checkpoint_every: 0 none by "
        f"round); its {done} rounds are lost: --overwrite starts it again (a smaller checkpoint_minutes or a "
        "checkpoint_every > 0 loses less next time)\n")
    assert never.read_bytes() == before


def test_a_read_that_falls_in_a_running_jobs_write_is_tried_again_not_taken_for_a_foreign_file(write_config,
                                                                                                  tmp_path):
    """``report`` on a run that writes every 0.03 s once said status None (in the clean clone at cf45f6f): its
    look at the file fell in a write, failed, and the file was taken for a foreign one. Here the file is torn (cut
    short) while another process holds the run's lock, and mended 0.1 s later: the look tries again and sees the
    run; with no live holder a torn file is foreign at once."""
    out = tmp_path / "r.h5"
    assert main(["run", str(write_config({"rounds": 2})), "--out", str(out), "--quiet"]) == 0
    whole = out.read_bytes()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({str(lock_file(out))!r}, os.O_RDWR | os.O_CREAT)\n"
                               "fcntl.lockf(fd, fcntl.LOCK_EX); print(flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        holder.stdout.readline()  # type: ignore[union-attr]
        out.write_bytes(whole[:4096])
        threading.Timer(0.1, out.write_bytes, [whole]).start()
        state = inspect_output(out)
    finally:
        holder.kill()
        holder.wait()
    assert (state.kind, state.status, state.rounds_completed) == ("results", "completed", 2)
    out.write_bytes(whole[:4096])
    assert inspect_output(out).kind == "foreign"


def test_state_round_trips_every_kind_a_checkpoint_holds_and_refuses_what_it_cannot(tmp_path):
    """write_state and read_state over the kinds algorithms keep: a numpy and a torch generator go on where they
    stopped, a module's and an optimizer's state load in place, a tuple stays a tuple; a dict key or a value a
    checkpoint cannot hold, a class outside mpifl and a kind it does not know are refused, naming what."""
    rng, gen = np.random.default_rng(3), torch.Generator().manual_seed(4)
    rng.random(5), torch.rand(3, generator=gen)
    module = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    module(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    with h5py.File(tmp_path / "state.h5", "w") as f:
        write_state(f, "v", {"rng": rng, "gen": gen, "pair": (1, "a"), "module": module, "optimizer": optimizer})
    fresh = torch.nn.Linear(3, 2)
    fresh_optimizer = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    with h5py.File(tmp_path / "state.h5") as f:
        back = read_state(f["v"], {"module": fresh, "optimizer": fresh_optimizer})
    assert np.array_equal(back["rng"].random(4), rng.random(4))
    assert torch.equal(torch.rand(2, generator=back["gen"]), torch.rand(2, generator=gen))
    assert back["pair"] == (1, "a") and back["module"] is fresh and torch.equal(fresh.weight, module.weight)
    momentum = [optimizer.state_dict()["state"][0], fresh_optimizer.state_dict()["state"][0]]
    assert back["optimizer"] is fresh_optimizer and torch.equal(*(m["momentum_buffer"] for m in momentum))
    with h5py.File(tmp_path / "refused.h5", "w") as f:
        with pytest.raises(TypeError, match="dict key 1.5 of type float cannot be checkpointed"):
            write_state(f, "keys", {1.5: 0})
        with pytest.raises(TypeError, match="SimpleNamespace.kept: cannot checkpoint 'kept' of type builtins.set"):
            write_object(f.create_group("object"), SimpleNamespace(kept={1, 2}))
        foreign = f.create_group("foreign")
        foreign.attrs["kind"], foreign.attrs["class"] = "object", "collections:OrderedDict"
        with pytest.raises(ConfigError, match="class collections.OrderedDict, which is not mpifl's own"):
            read_state(foreign)
        unknown = f.create_dataset("unknown", data=1)
        unknown.attrs["kind"] = "pickle"
        with pytest.raises(ConfigError, match="unknown kind 'pickle'"):
            read_state(unknown)
