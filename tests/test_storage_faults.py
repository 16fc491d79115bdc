"""A full file system (issue 57): on a real small file system (a tmpfs this test mounts; skipped where it cannot),
a run whose results do not fit ends with one line that names the file system, what it needed and had, what the
file keeps and the command that continues; no temporary file, no lock, never a crash; and once there is room, the
resumed run is bitwise the uninterrupted one."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mpifl.cli import main
from mpifl.results.guard import inspect_output
from mpifl.results.space import free_bytes
from tests.conftest import HANG_S, REPO, _merge, assert_same, deterministic, mpi_env, mpirun_cmd
from tests.test_checkpoint import kill_job
from tests.test_run_outputs import LONG, start, wait_for_checkpoint

STORAGE_EXIT = 75


@pytest.fixture
def small_fs(tmp_path):  # noqa: ANN001, ANN201
    """A tmpfs of a given size at a folder of this test, resizable (``remount(size)``), unmounted after."""
    point = tmp_path / "fs"
    point.mkdir()

    def mount(kib: int, again: bool = False) -> Path:
        options = f"{'remount,' if again else ''}size={kib}k"
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or 'not root'})")
        return point

    yield mount
    with contextlib.suppress(OSError):
        subprocess.run(["umount", "--lazy", str(point)], capture_output=True)  # detached even if still busy


def run(config: Path, out: Path, ranks: int, *extra: str) -> subprocess.CompletedProcess:
    cmd = (mpirun_cmd(ranks) if ranks > 1 else []) + [sys.executable, "-m", "mpifl", "run", str(config), "--out",
                                                      str(out), "--quiet", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, env=mpi_env(), cwd=REPO)


def error_lines(stderr: str) -> list[str]:
    """The lines of ``stderr`` that say ``mpifl: error``, each as it was written: under ``mpirun`` a line may come
    after a space (or a NUL byte) of Open MPI's own, which interleaves its output with the ranks'."""
    lines = (line.lstrip(" \t\0") for line in stderr.splitlines())
    return [line for line in lines if line.startswith("mpifl: error")]


def errors(proc: subprocess.CompletedProcess) -> list[str]:
    return error_lines(proc.stderr)


def test_a_new_run_that_does_not_fit_is_refused_before_round_1_and_with_force_start_ends_in_one_line(
        small_fs, write_config, capsys):
    """Before round 1, its estimate (tests/test_space_estimate.py) against the free space: one line with both
    numbers, exit 2, nothing left. --force-start starts it, and the write that does not fit ends it: one line,
    nothing left either."""
    folder = small_fs(300)
    out = folder / "q.h5"
    config = write_config({"rounds": 2})
    assert main(["run", str(config), "--out", str(out)]) == 2
    refused = capsys.readouterr()
    assert refused.out == "" and refused.err.count("\n") == 1  # before the line that starts round 1
    line = refused.err.rstrip("\n")
    assert line.startswith(f"mpifl: error: {out}: the file system at {folder} has ")
    assert "free; the run (its results file and checkpoints) needs about " in line
    assert "(estimated: a results file of " in line and " and 1 checkpoint of " in line
    assert line.endswith("give an --out on another file system; --force-start starts anyway (each write is still "
                         "checked)")
    assert sorted(p.name for p in folder.iterdir()) == []  # no lock, no temporary file
    longer = ["--set", "rounds=20000", "--set", "clients_per_round=8", "--set", "eval_every=100"]  # many chunks
    assert main(["run", str(config), "--out", str(out), *longer]) == 2
    assert "; fewer rounds, a smaller clients_per_round would shrink it, or give " in capsys.readouterr().err
    proc = run(config, out, 1, "--force-start")
    assert proc.returncode == STORAGE_EXIT, proc.stderr
    assert "Segmentation" not in proc.stderr and "Traceback" not in proc.stderr
    assert errors(proc) == [errors(proc)[0]] and proc.stderr.count("\n") == 1
    line = errors(proc)[0]
    assert f"the file system at {folder} has " in line and "free; creating q.h5 needs about" in line
    assert line.endswith("nothing was kept: free space, then run it again")
    assert sorted(p.name for p in folder.iterdir()) == []  # no temporary file, no lock


def test_a_resume_asks_only_for_the_room_the_rest_of_the_run_needs(small_fs, write_config, capsys):
    """The run's file and checkpoints already there count: a run continued to 8 rounds starts where the same run
    from round 1 would not fit beside it."""
    folder = small_fs(2400)
    out = folder / "q.h5"
    config = write_config({"rounds": 4, "checkpoint_every": 2})
    assert main(["run", str(config), "--out", str(out), "--quiet"]) == 0
    assert main(["run", str(config), "--out", str(folder / "again.h5"), "--quiet", "--set", "rounds=8"]) == 2
    assert "the run (its results file and checkpoints) needs about" in capsys.readouterr().err
    assert main(["run", "--resume", str(out), "--quiet", "--set", "rounds=8"]) == 0
    assert inspect_output(out).rounds_completed == 8 and not (folder / "again.h5").exists()


@pytest.mark.usefixtures("runs_in_this_process")
def test_a_sweep_refuses_the_run_that_does_not_fit_and_does_the_others(small_fs, write_config, tmp_path, capsys):
    """One run of a sweep too large for its file system (a model 250 times larger) is refused before its round 1,
    in its own line; the sweep does the others and names the one it could not do."""
    folder = small_fs(3 << 10)
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"base": str(write_config({"rounds": 2})), "output_dir": str(folder),
                                     "grid": {"model.fc_hidden": [16, 4096]}}))
    assert main(["sweep", str(sweep)]) == 1
    err = capsys.readouterr().err.splitlines()
    large = folder / "model.fc_hidden=4096,seed=0.h5"
    assert err[0].startswith(f"mpifl: error: {large}: the file system at {folder} has "), err
    assert err[1].startswith("mpifl: 1 of 2 runs failed (model.fc_hidden=4096,seed=0: their lines above say why); "
                             f"the others completed; python -m mpifl sweep {sweep} does the failed ones again"), err
    assert len(err) == 2
    assert inspect_output(folder / "model.fc_hidden=16,seed=0.h5").status == "completed"
    assert sorted(p.name for p in folder.iterdir()) == ["model.fc_hidden=16,seed=0.h5"]


@pytest.mark.usefixtures("runs_in_this_process")
def test_a_sweep_whose_file_system_fills_stops_with_what_is_complete_and_how_to_continue(small_fs, write_config,
                                                                                          tmp_path, capsys,
                                                                                          monkeypatch):
    """Another job fills the file system after the sweep's first run: the second (started anyway: --force-start,
    which the sweep hands to its runs) ends at its first write, and the sweep stops there, saying what is complete
    and the command that continues, exit 75; with space again that command does the rest."""
    from mpifl import sweep as sweeps

    folder = small_fs(4 << 10)
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"base": str(write_config({"rounds": 2})), "output_dir": str(folder),
                                     "seeds": [0, 1, 2]}))
    started, fillers = [], []

    def fill_before_the_second(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
        assert "--force-start" in cmd
        started.append(cmd)
        if len(started) == 2:
            fillers.append(fill(folder))
        return real(cmd, env)

    real = sweeps.subprocess.run
    monkeypatch.setattr(sweeps.subprocess, "run", fill_before_the_second)
    assert main(["sweep", str(sweep), "--force-start"]) == STORAGE_EXIT
    err = capsys.readouterr().err.splitlines()
    assert len(started) == 2 and len(err) == 2, err
    assert err[0].startswith("mpifl: error: the file system at ") and "creating seed=1.h5 needs about" in err[0]
    assert err[1] == ("mpifl: the file system stopped run 2 of 3 (seed=1; what its file keeps: the line above); 1 run "
                      f"before it completed; free space, then continue with: python -m mpifl sweep {sweep} "
                      "--force-start (completed runs are skipped, a stopped one resumes from its checkpoint)")
    fillers[0].unlink()
    assert main(["sweep", str(sweep), "--force-start"]) == 0
    assert "3 runs: 1 completed already (skipped), 2 new" in capsys.readouterr().out
    assert [inspect_output(folder / f"seed={s}.h5").status for s in range(3)] == ["completed"] * 3


def fill(folder: Path, leave: int = 64 << 10) -> Path:
    """Another job's file taking all but ``leave`` bytes of the file system of ``folder`` (again and again while a
    run beside it takes some of what was free)."""
    filler = folder / "other-job.bin"
    with open(filler, "wb") as f:
        for _ in range(100):
            room = free_bytes(folder) - leave
            if room <= 4096:
                break
            with contextlib.suppress(OSError):  # ENOSPC: the run took some meanwhile; measure again
                os.posix_fallocate(f.fileno(), os.fstat(f.fileno()).st_size, room)
    return filler


@pytest.fixture(scope="module")
def long_run(tmp_path_factory) -> tuple[Path, dict]:  # noqa: ANN001
    """LONG, evaluated every 5 rounds, and what it computes where there is room."""
    folder = tmp_path_factory.mktemp("long")
    config = folder / "long.yaml"
    config.write_text(yaml.safe_dump(_merge(LONG, {"eval_every": 5})))
    whole = folder / "whole.h5"
    assert main(["run", str(config), "--out", str(whole), "--quiet"]) == 0
    return config, deterministic(whole)


@pytest.mark.parametrize(("ranks", "check"), [(1, "on"), (3, "off")])
def test_a_run_whose_file_system_fills_keeps_what_was_complete_and_resumes_bitwise(small_fs, long_run, ranks, check,
                                                                                   monkeypatch):
    """Another job fills the file system once the run has committed a checkpoint: the run ends at its next write
    with one line naming what its file keeps (the checkpoint committed there, not one a rank had begun) and the
    command that continues; once the space is freed, --resume finishes with the bits of a run that had room. With
    the space check off (MPIFL_SPACE_CHECK=off, as where a quota hides from statvfs) the write fails in HDF5
    half-way, and the same holds: no crash, no second line. (1 rank with the check, 3 ranks without: each path on
    one rank count; the 3 ranks' workers then fail on their checkpoint files too, said once by rank 0.)"""
    monkeypatch.setenv("MPIFL_SPACE_CHECK", check)
    config, whole = long_run
    folder = small_fs(64 << 10)
    out = folder / "q.h5"
    job = start([str(config), "--out", str(out), "--quiet"], ranks=ranks if ranks > 1 else 0)
    try:
        wait_for_checkpoint(job, out, at_least=10)
        filler = fill(folder, leave=0)  # not a block left: with the check off, the next write fails in HDF5
        _, stderr = job.communicate(timeout=HANG_S)
    finally:
        if job.poll() is None:  # a failed step above: no job left running on the mount
            kill_job(job)
    assert job.returncode == STORAGE_EXIT, stderr
    assert "Segmentation" not in stderr and "Traceback" not in stderr
    lines = error_lines(stderr)
    assert len(lines) == 1, stderr
    line, state = lines[0], inspect_output(out)
    assert state.checkpoint_round is not None and state.checkpoint_round >= 10
    assert (f"{out} keeps {state.rounds_completed} round(s) and the checkpoint of round {state.checkpoint_round}; "
            f"free space, then continue with: ") in line and line.endswith(f"--resume {out}")
    if ranks == 1:  # (an aborted job's lock goes with rank 0's process; the next run takes it over)
        assert not (folder / ".q.h5.lock").exists()
    assert not list(folder.glob(".q.h5.tmp-*"))
    filler.unlink()
    resumed = subprocess.run((mpirun_cmd(ranks) if ranks > 1 else []) + [
        sys.executable, "-m", "mpifl", "run", "--resume", str(out), "--quiet"], capture_output=True, text=True,
        timeout=HANG_S, env=mpi_env(), cwd=REPO)
    assert resumed.returncode == 0, resumed.stderr
    assert_same(whole, deterministic(out))


def test_a_plot_or_an_export_that_does_not_fit_leaves_no_part(small_fs, write_config, tmp_path, capsys):
    """Written under a temporary name and renamed when whole: a full file system leaves no part of the image or
    of a CSV file, and the command says so in one line (exit 75)."""
    results = tmp_path / "r.h5"
    assert main(["run", str(write_config({"rounds": 2})), "--out", str(results), "--quiet"]) == 0
    folder = small_fs(1024)
    fill(folder, leave=4 << 10)
    for command in (["plot", str(results), "-o", str(folder / "r.png")], ["export", str(results), "--csv",
                                                                             str(folder / "csv")]):
        capsys.readouterr()
        assert main(command) == STORAGE_EXIT
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"mpifl: error: the file system at {folder} could not take ")
        assert "No space left on device" in err
        assert not list(folder.rglob(".*.tmp-*")) and not (folder / "r.png").exists()
    # what the export did write is whole: the tables it finished before the space ran out
    assert all(path.read_text().endswith("\n") for path in (folder / "csv").glob("*.csv"))
