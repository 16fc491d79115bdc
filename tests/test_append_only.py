"""The append-only results file: a real job SIGKILLed at random moments leaves a file that reads, reports and
resumes up to its last committed write, and the resumed run ends bitwise where an uninterrupted one ends;
files written before the format still read."""

import json
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

from mpifl.cli import main
from mpifl.results import AppendOnlyFile, ledger_summaries, read_results
from mpifl.results.guard import inspect_output
from mpifl.results.layout import committed_rows
from tests.conftest import HANG_S, REPO, TINY, _merge, assert_same, deterministic, mpi_env, mpirun_cmd
from tests.multinode.netns import peek
from tests.test_checkpoint import kill_job

OLD_LAYOUT = REPO / "tests" / "data" / "results_before_append_only.h5"  # written by mpifl at 4c6c908
LOGISTIC = _merge(TINY, {"model": {"name": "logistic"}, "rounds": 40, "eval_every": 1, "checkpoint_every": 3})


def check_committed(path: Path) -> int:
    """A killed job's file: readable by ``read_results`` and ``mpifl report``, every table consistent up to
    the last committed round (which it returns)."""
    res = read_results(path)
    rounds = res.table("rounds").get("round", np.zeros(0, np.int64))
    last = len(rounds)
    assert rounds.tolist() == list(range(1, last + 1))  # every round once, in order, none half-written
    assert res.attrs["rounds_completed"] == last
    assert res.table("eval")["round"].tolist() == list(range(1, last + 1)) if last else not res.table("eval")
    ledger, totals = res.table("ledger"), res.table("ledger_totals")
    if last:
        assert set(np.unique(ledger["round"])) - {0} == set(range(1, last + 1))
        expected, spread = ledger_summaries(ledger, res.table_attrs["ledger"]["directions"])
        for key, values in expected.items():  # the per-round totals agree with the per-client rows
            assert np.array_equal(totals[key], values), key
        for key, values in spread.items():
            assert np.array_equal(res.table("ledger_clients")[key], values), key
        assert main(["report", str(path)]) == 0
    return last


def kill_in_a_random_round(cmd: list[str], out: Path, rng: random.Random, rounds: int, earliest: int = 2) -> bool:
    """Start ``cmd``, a job of ``rounds`` rounds that writes ``out`` every round, and SIGKILL it (every process of
    it) at a random moment of a random round beyond those ``out`` already holds: once round ``target`` is in the
    file, within as long again as round ``target`` took. Aimed by the job's own writes, not by a clock, the kill
    lands in the running job at whatever pace the machine's load allows. ``target`` (at least ``earliest``) is
    drawn from the first quarter of the rounds left, so that a series of kills keeps finding a job to kill.
    Whether the job was still running when killed (False: it ended first, or no round was left to aim at)."""
    held = peek(out)[0] if out.exists() else 0  # a resumed job redoes the rounds after its checkpoint first
    first = max(earliest, held + 2)
    if first > rounds - 1:
        return False
    target = first + rng.randrange(max(1, (rounds - first) // 4))
    job = subprocess.Popen(cmd, env=mpi_env(), cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    timeout = time.monotonic() + HANG_S  # a hung job's bound, not a pace: a loaded machine starts jobs slowly

    def reached(round_: int) -> float:
        while job.poll() is None and peek(out)[0] < round_:
            assert time.monotonic() < timeout, f"the job did not write round {round_} in three minutes"
            time.sleep(0.002)
        return time.monotonic()

    before = reached(target - 1)
    after = reached(target)
    deadline = after + rng.uniform(0, after - before)
    while time.monotonic() < deadline and job.poll() is None:
        time.sleep(0.002)
    running = job.poll() is None
    kill_job(job)
    return running


def kill_and_resume(tmp_path: Path, kills: int, ranks: int, seed: int) -> tuple[Path, int]:
    """One file, over and over: run (or resume from its checkpoint, with the results file alone: ``mpifl run
    --resume F.h5``), SIGKILL at a random moment, check what the kill left; then resume to the end in this
    process. Returns the file and how many kills hit a running job."""
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(LOGISTIC))
    part = tmp_path / "part.h5"
    rng, hits = random.Random(seed), 0
    for _ in range(kills):
        with_checkpoint = part.exists() and "checkpoint" in read_results(part, checkpoint=True).tables
        # the results file alone resumes; a killed run without a checkpoint is started again only when told to
        where = ["--resume", str(part)] if with_checkpoint else [str(config), "--out", str(part), "--overwrite"]
        cmd = (mpirun_cmd(ranks) if ranks else []) + [sys.executable, "-m", "mpifl", "run", *where, "--quiet"]
        hits += kill_in_a_random_round(cmd, part, rng, LOGISTIC["rounds"])
        if part.exists():
            check_committed(part)
        if part.exists() and read_results(part).attrs["status"] == "completed":
            break
    if read_results(part).attrs["status"] != "completed":
        assert main(["run", "--resume", str(part), "--quiet"]) == 0
    return part, hits


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("full")
    (directory / "cfg.yaml").write_text(yaml.safe_dump(LOGISTIC))
    assert main(["run", str(directory / "cfg.yaml"), "--out", str(directory / "full.h5"), "--quiet"]) == 0
    return directory / "full.h5"


@pytest.fixture(scope="module")
def uninterrupted(full_run) -> dict[str, np.ndarray]:
    return deterministic(full_run)


def test_sigkill_at_random_moments_then_resume_is_bitwise_identical(tmp_path, uninterrupted):
    """Each kill is aimed at a round by the job's own writes: delays in seconds, even scaled by an uninterrupted
    run's wall time, missed the job when the machine's load fell between that run and the kills (2 hits of 6)."""
    part, hits = kill_and_resume(tmp_path, kills=6, ranks=0, seed=1)
    assert hits >= 3, "too few kills hit a running job"
    assert check_committed(part) == LOGISTIC["rounds"]
    assert_same(uninterrupted, deterministic(part))


def test_sigkill_of_a_three_rank_job_then_resume_is_bitwise_identical(tmp_path, uninterrupted):
    part, hits = kill_and_resume(tmp_path, kills=2, ranks=3, seed=2)
    assert hits >= 1
    assert check_committed(part) == LOGISTIC["rounds"]
    assert_same(uninterrupted, deterministic(part))


WRITER = """
import sys
import numpy as np
from mpifl.results import AppendOnlyFile
f, rows = AppendOnlyFile(sys.argv[1], resume=False), 0
for r in range(1, 10**6):
    ledger = {"round": np.full(40, r), "client": np.arange(40), "bytes": np.arange(40) * r}
    f.write({"config": "{}", "status": "running"}, {"rounds": (r - 1, {"round": np.array([r])}),
            "physical": (rows, ledger)}, {}, {"rounds": {"diagnostics": [str(r)]}},
            (r, {"server": np.full(1000 + r, r % 256, np.uint8)}) if r % 3 == 0 else None)
    rows += 40
"""


def test_the_writer_killed_at_random_moments_leaves_committed_rows(tmp_path):
    """The writer alone (no training, so it starts fast and is mid-write most of the time), SIGKILLed 15 times
    at random moments: every file reads, holds whole writes only, and its checkpoint is a complete one."""
    rng = random.Random(3)
    for kill in range(15):
        out = tmp_path / f"w{kill}.h5"
        job = subprocess.Popen([sys.executable, "-c", WRITER, str(out)], cwd=REPO, start_new_session=True)
        while not out.exists():
            assert job.poll() is None
            time.sleep(0.001)
        time.sleep(rng.uniform(0, 0.3))
        kill_job(job)
        res = read_results(out, checkpoint=True)
        last = len(res.table("rounds")["round"])
        assert res.table("rounds")["round"].tolist() == list(range(1, last + 1))
        ledger = res.table("physical")
        assert ledger["round"].tolist() == np.repeat(np.arange(1, last + 1), 40).tolist()
        assert ledger["bytes"].tolist() == (np.tile(np.arange(40), last) * ledger["round"]).tolist()
        if last >= 4:  # the newest complete checkpoint, never one past the committed rows
            blob = res.table("checkpoint")["server"]
            r = int(res.table_attrs["checkpoint"]["round"])
            assert r % 3 == 0 and last - 3 <= r <= last and blob.tolist() == [r % 256] * (1000 + r)


def stopped_at(monkeypatch: pytest.MonkeyPatch, dataset_name: str, write: Callable[[], None]) -> None:
    """Run ``write`` (an :class:`AppendOnlyFile` write) and stop it as it first writes into ``dataset_name``, as a
    SIGKILL there would (h5py writes nothing more afterwards: the test closes the file)."""
    setitem = h5py.Dataset.__setitem__

    def killed_there(dataset, key, value):  # noqa: ANN001 - h5py's own signature
        if dataset.name == dataset_name:
            raise KeyboardInterrupt
        setitem(dataset, key, value)

    monkeypatch.setattr(h5py.Dataset, "__setitem__", killed_there)
    with pytest.raises(KeyboardInterrupt):
        write()
    monkeypatch.undo()


def test_a_write_stopped_at_its_commit_leaves_the_file_at_its_last_commit_and_not_completed(tmp_path, monkeypatch):
    """The last write (status "completed") stopped as it commits its rows: the file is not called completed, and
    both readers (``report``'s first line and its "stopped at round N") count the committed round only, not the
    attribute the write had set (CI once saw a SIGKILLed job's file say "1 rounds" and "stopped at round 2")."""
    out = tmp_path / "cut.h5"
    writer = AppendOnlyFile(out, resume=False)
    rows = {"round": np.array([1])}
    writer.write({"config": "{}", "status": "running", "rounds_completed": 1}, {"rounds": (0, rows)}, {}, {},
                 (1, {"server": np.zeros(3, np.uint8)}))
    stopped_at(monkeypatch, "/committed", lambda: writer.write(
        {"config": "{}", "status": "completed", "rounds_completed": 2}, {"rounds": (1, {"round": np.array([2])})},
        {}, {}, None))
    writer.file.close()
    with h5py.File(out, "r") as f:
        assert (f.attrs["status"], f.attrs["rounds_completed"]) == ("running", 2)  # set before the commit
    state = inspect_output(out)
    assert (state.status, state.rounds_completed, state.checkpoint_round) == ("running", 1, 1)
    assert read_results(out).attrs["rounds_completed"] == 1
    resume = f"python -m mpifl run --resume {out} (any rank count)"
    assert state.standing() == f"stopped at round 1, resumable from round 1: {resume}"


def test_a_resumed_run_stopped_while_it_rewrites_committed_rows_reads_up_to_its_checkpoint(tmp_path, monkeypatch):
    """A resumed run's first write redoes the rows after its checkpoint (here round 6 of 10 committed, checkpoint
    at round 5); stopped as it writes them, the rows it had begun to replace no longer count: the file holds
    rounds 1-5, as both readers say, never a row half-replaced or a count over rows no longer there."""
    out = tmp_path / "resumed.h5"
    first = AppendOnlyFile(out, resume=False)
    first.write({"config": "{}", "status": "running", "rounds_completed": 10},
                {"rounds": (0, {"round": np.arange(1, 11)})}, {}, {}, (5, {"server": np.zeros(3, np.uint8)}))
    first.file.close()
    resumed = AppendOnlyFile(out, resume=True)
    stopped_at(monkeypatch, "/rounds/round", lambda: resumed.write(
        {"config": "{}", "status": "running", "rounds_completed": 6}, {"rounds": (5, {"round": np.array([6])})},
        {}, {}, None))
    resumed.file.close()
    assert read_results(out).table("rounds")["round"].tolist() == [1, 2, 3, 4, 5]
    assert read_results(out).attrs["rounds_completed"] == inspect_output(out).rounds_completed == 5
    with h5py.File(out, "r+") as f:  # as an earlier mpifl left such a file: its old count over the 6 rows there
        f["committed"][list(committed_rows(f)).index("rounds")] = 10
    assert len(read_results(out).table("rounds")["round"]) == read_results(out).attrs["rounds_completed"] == 6
    assert inspect_output(out).rounds_completed == 6


def test_a_file_whose_tail_never_reached_the_disk_reads_and_resumes(tmp_path):
    """A kill while HDF5 flushes can leave the superblock's end of file past the bytes written (found by the test
    above: "truncated file: eof = 199501, ..., stored_eof = 200651"). Made here by cutting a file's trailing
    zeros (space HDF5 allocated): the committed rows read (the tail as zeros, the file untouched), and a resume
    extends the file to its recorded end and goes on."""
    out = tmp_path / "cut.h5"
    writer = AppendOnlyFile(out, resume=False)
    writer.write({"config": "{}", "status": "running"}, {"rounds": (0, {"round": np.array([1])})}, {}, {}, None)
    writer.file.create_dataset("allocated", data=np.zeros(1 << 16, np.uint8))  # the file's last bytes: zeros
    writer.file.close()
    whole = out.read_bytes()
    cut = len(whole.rstrip(b"\0")) + 1
    assert len(whole) - cut > 60_000
    out.write_bytes(whole[:cut])
    with pytest.raises(OSError, match="truncated file"):
        h5py.File(out, "r")
    assert read_results(out).table("rounds")["round"].tolist() == [1] and out.stat().st_size == cut
    resumed = AppendOnlyFile(out, resume=True)
    assert resumed.rows["rounds"] == 1 and out.stat().st_size == len(whole)
    resumed.write({"config": "{}", "status": "running"}, {"rounds": (1, {"round": np.array([2])})}, {}, {}, None)
    resumed.file.close()
    assert read_results(out).table("rounds")["round"].tolist() == [1, 2]


def test_files_from_before_the_append_only_format_still_read(tmp_path, capsys):
    """A file the previous writer made (whole tables, no committed counts): read whole, its per-round ledger
    totals worked out from its rows, reported; resuming from it is refused with one line."""
    res = read_results(OLD_LAYOUT)
    assert res.attrs["status"] == "completed" and res.table("rounds")["round"].tolist() == [1, 2, 3]
    ledger = res.table("ledger")
    totals = res.table("ledger_totals")
    assert totals["round"].tolist() == [1, 1, 1, 2, 2, 2, 3, 3, 3]
    for r in (1, 2, 3):
        assert totals["bytes"][totals["round"] == r].sum() == ledger["bytes"][ledger["round"] == r].sum()
    assert read_results(OLD_LAYOUT, ledger=False).table("ledger_totals")["bytes"].tolist() == totals["bytes"].tolist()
    assert main(["report", str(OLD_LAYOUT), "--json"]) == 0
    per_client = json.loads(capsys.readouterr().out)["logical_bytes_per_client_round"]
    assert per_client["train"]["up"] == {"min": 2600, "max": 2600, "mean": 2600.0, "count": 9}
    copy = tmp_path / "old.h5"
    shutil.copy(OLD_LAYOUT, copy)
    config = tmp_path / "old.yaml"
    config.write_text(res.attrs["config"])
    assert main(["run", str(config), "--resume", str(copy), "--set=rounds=4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "before the append-only results format" in err[0]
