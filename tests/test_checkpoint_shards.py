"""Checkpoint shards: every rank writes its own clients' state beside the results file; a real 3-rank job
SIGKILLed at random moments (often while the shards are written) always leaves a complete checkpoint to
resume from, and the resumed run ends bitwise where an uninterrupted one ends, on another rank count too."""

import random
import sys
from pathlib import Path

import yaml

from mpifl.cli import main
from mpifl.results import read_results, shard_dir
from mpifl.state_io import manifests, read_client_states
from tests.conftest import TINY, _merge, assert_same, deterministic, mpirun_cmd, run_mpifl
from tests.test_append_only import check_committed, kill_in_a_random_round

# FedDeper keeps a personal model per client (300k parameters: 1.2 MB each), checkpointed every other round
STATEFUL = _merge(TINY, {"algorithm": "feddeper", "rounds": 11, "eval_every": 1, "checkpoint_every": 2,
                         "clients_per_round": 8, "model": {"name": "mlp", "hidden": [512, 512]},
                         "client": {"steps": 2}})


def complete_checkpoint(path: Path) -> tuple[int, list[str]]:
    """The committed checkpoint's round and the files its manifest names ((0, []) without one); every worker's
    shard it names exists and holds whole client states."""
    saved = read_results(path, checkpoint=True)
    if "checkpoint" not in saved.tables:
        return 0, []
    states = read_client_states(path)  # one line naming a missing shard; h5py fails on a partial one
    assert states and all(len(s) for s in states.values())
    for clients in states.values():
        for state in clients.values():
            assert state["personal"].size > 250_000
    newest = manifests(saved.tables["checkpoint"])[0][1]
    return int(saved.table_attrs["checkpoint"]["round"]), sorted(entry["file"] for entry in newest)


def files_of(round_: int, workers: int) -> list[str]:
    """The files of a checkpoint of round ``round_`` taken by a job with ``workers`` workers (ranks 1..): the
    server's and one shard per worker."""
    return sorted([f"round{round_}-server.h5", *(f"round{round_}-rank{rank}.h5" for rank in range(1, workers + 1))])


def test_killed_while_writing_shards_resumes_bitwise_on_another_rank_count(tmp_path):
    """Where the kills land decides which checkpoint the 2-rank resume starts from; whichever it is, the resumed
    file ends bitwise where an uninterrupted run ends and names the files of the last checkpoint taken."""
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(STATEFUL))
    assert main(["run", str(config), "--out", str(tmp_path / "full.h5"), "--quiet"]) == 0
    part = tmp_path / "part.h5"
    rng, resumed_from, files = random.Random(4), 0, []
    for _ in range(5):
        where = ["--resume", str(part)] if resumed_from else ["--out", str(part)]
        # the first job dies in round 4 at the earliest, after round 2's checkpoint is written (round 3 is written
        # after it), so that the 2-rank resume reads 3-rank shards; later kills land anywhere, shard writes included
        kill_in_a_random_round([*mpirun_cmd(3), sys.executable, "-m", "mpifl", "run", str(config), *where, "--quiet"],
                               part, rng, STATEFUL["rounds"], earliest=3)
        check_committed(part)
        resumed_from, files = complete_checkpoint(part)
        assert resumed_from > 0 and files == files_of(resumed_from, 2)  # taken by a 3-rank job
        if read_results(part).attrs["status"] == "completed":
            break
    proc = run_mpifl(["run", str(config), "--resume", str(part), "--quiet"], ranks=2)  # 1 worker holds them all
    assert proc.returncode == 0, proc.stderr
    assert_same(deterministic(tmp_path / "full.h5"), deterministic(part))
    assert read_results(part).attrs["world_size"] == 2
    last = STATEFUL["rounds"] - STATEFUL["rounds"] % STATEFUL["checkpoint_every"]
    # round 10's checkpoint: the 3-rank job's if the kills left it (the resume's one worker read both shards and
    # took none), else the resume's own, with its one worker's shard
    expected = files if resumed_from == last else files_of(last, 1)
    assert complete_checkpoint(part) == (last, expected), resumed_from
    # the folder holds the files of the checkpoints the results file lists (the newest and those kept), no others
    listed = manifests(read_results(part, checkpoint=True).tables["checkpoint"])
    assert sorted(p.name for p in shard_dir(part).iterdir()) == sorted(e["file"] for _, es in listed for e in es)


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


def test_a_checkpoint_is_on_the_disk_before_the_one_it_replaces_goes(tmp_path, monkeypatch):
    """A node that loses power keeps what was fsynced, not what was in its page cache: before a commit's older
    checkpoint files are removed, the results file naming the new checkpoint is synced, and so is every file the
    new one is made of, with the folder that names them (a file's own fsync does not cover its rename); the
    results file's folder once it is created, and the results file when the run completes."""
    import os

    import mpifl.results.writing as writing
    import mpifl.runtime.engine as engine

    events: list[tuple[str, str]] = []
    fsync, prune = os.fsync, writing.prune_checkpoints

    def recorded_fsync(handle: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{handle}")))
        fsync(handle)

    def recorded_prune(path, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        events.append(("prune", str(shard_dir(path))))
        prune(path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    for module in (writing, engine):
        monkeypatch.setattr(module, "prune_checkpoints", recorded_prune)
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(_merge(TINY, {"algorithm": "feddeper", "rounds": 3, "checkpoint_every": 1,
                                                   "checkpoint_keep": 1})))
    out = tmp_path / "r.h5"
    assert main(["run", str(config), "--out", str(out), "--quiet"]) == 0
    folder = shard_dir(out)
    prunes = [k for k, event in enumerate(events) if event[0] == "prune"]
    assert len(prunes) == 4  # each round's commit, and the run's end
    assert ("fsync", str(tmp_path)) in events[:prunes[1]]  # the results file's name, once created (the first
    previous = 0                                            # commit goes in under its temporary name)
    for end, round_ in zip(prunes, (1, 2, 3, 3)):
        synced = [Path(target) for kind, target in events[previous:end] if kind == "fsync"]
        assert synced[-1] == out or synced[-1].name.startswith(f".{out.name}.tmp-"), synced  # the commit, last
        if end != prunes[-1]:  # the files of this round's checkpoint (before their rename), then their folder
            names = [folder / f".round{round_}-server.h5.tmp", folder / f".round{round_}-rank0.h5.tmp"]
            last_folder_sync = len(synced) - 1 - synced[::-1].index(folder)
            assert max(synced.index(name) for name in names) < last_folder_sync, synced
        previous = end
