"""Checkpoint shards: every rank writes its own clients' state beside the results file; a real 3-rank job
SIGKILLed at random moments (often while the shards are written) always leaves a complete checkpoint to
resume from, and the resumed run ends bitwise where an uninterrupted one ends, on another rank count too."""

import random
import sys
from pathlib import Path

import h5py
import yaml

from mpifl.cli import main
from mpifl.results import read_results, shard_dir
from mpifl.state_io import read_client_states
from tests.conftest import TINY, _merge, assert_same, deterministic, mpirun_cmd, run_mpifl
from tests.test_append_only import check_committed, kill_at_random

# FedDeper keeps a personal model per client (300k parameters: 1.2 MB each), checkpointed every other round
STATEFUL = _merge(TINY, {"algorithm": "feddeper", "rounds": 11, "eval_every": 1, "checkpoint_every": 2,
                         "clients_per_round": 8, "model": {"name": "mlp", "hidden": [512, 512]},
                         "client": {"steps": 2}})


def complete_checkpoint(path: Path) -> int:
    """The committed checkpoint's round; every shard it names exists and holds whole client states."""
    saved = read_results(path, checkpoint=True)
    if "checkpoint" not in saved.tables:
        return 0
    states = read_client_states(path)  # one line naming a missing shard; h5py fails on a partial one
    assert states and all(len(s) for s in states.values())
    for clients in states.values():
        for state in clients.values():
            assert state["personal"].size > 250_000
    return int(saved.table_attrs["checkpoint"]["round"])


def test_killed_while_writing_shards_resumes_bitwise_on_another_rank_count(tmp_path):
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(STATEFUL))
    assert main(["run", str(config), "--out", str(tmp_path / "full.h5"), "--quiet"]) == 0
    part = tmp_path / "part.h5"
    rng, rounds = random.Random(4), []
    for _ in range(5):
        resumable = part.exists() and complete_checkpoint(part) > 0
        where = ["--resume", str(part)] if resumable else ["--out", str(part)]
        kill_at_random([*mpirun_cmd(3), sys.executable, "-m", "mpifl", "run", str(config), *where, "--quiet"], part,
                       rng, latest=2.0)
        if part.exists():
            check_committed(part)
            rounds.append(complete_checkpoint(part))
            if read_results(part).attrs["status"] == "completed":
                break
            names = {p.name for p in shard_dir(part).glob("*") if not p.name.startswith(".")}
            assert len(names) >= 2  # the committed checkpoint's shards (one per worker) at least
    assert max(rounds) > 0, "no checkpoint was committed before the kills"
    proc = run_mpifl(["run", str(config), "--resume", str(part), "--quiet"], ranks=2)  # 1 worker holds them all
    assert proc.returncode == 0, proc.stderr
    assert_same(deterministic(tmp_path / "full.h5"), deterministic(part))
    with h5py.File(part) as f:
        manifest = f["checkpoint"]["shards"][()].tobytes().decode()
        assert f.attrs["world_size"] == 2
    # round 10's checkpoint, written by two workers, was read by the one worker of the 2-rank resume
    assert '"rank": 1' in manifest and '"rank": 2' in manifest
    assert sorted(p.name for p in shard_dir(part).iterdir()) == ["round10-rank1.h5", "round10-rank2.h5"]


def test_a_missing_shard_is_one_line(tmp_path):
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump({**STATEFUL, "rounds": 3, "checkpoint_every": 2}))
    out = tmp_path / "r.h5"
    proc = run_mpifl(["run", str(config), "--out", str(out), "--quiet", "--set", "rounds=2"], ranks=3)
    assert proc.returncode == 0, proc.stderr
    next(shard_dir(out).glob("round2-rank2.h5")).unlink()
    proc = run_mpifl(["run", str(config), "--resume", str(out)], ranks=3)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mpifl")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert "round2-rank2.h5, a checkpoint shard of" in lines[0] and "is missing" in lines[0]
