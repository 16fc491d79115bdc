"""A full file system (issue 57): on a real small file system (a tmpfs this test mounts; skipped where it cannot),
a run whose results do not fit ends with one line that names the file system, what it needed and had, what the
file keeps and the command that continues; no temporary file, no lock, never a crash; and once there is room, the
resumed run is bitwise the uninterrupted one."""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
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
                      "before it completed; free space (or mend what the line above names), then continue with: "
                      f"python -m mpifl sweep {sweep} --force-start (completed runs are skipped, a stopped one "
                      "resumes from its checkpoint)")
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


def test_prepare_on_a_full_file_system_ends_in_one_line_and_leaves_no_part(small_fs, write_config):
    """``mpifl prepare`` wrote its HDF5 file with nothing catching a full disk: h5py's tracebacks, then HDF5's
    clean-up at exit. Now the command's one line (exit 75), no temporary file, no crash (in a process of its own:
    the process that met an HDF5 write failing ends at once)."""
    folder = small_fs(200)
    done = subprocess.run([sys.executable, "-m", "mpifl", "prepare", str(write_config({})), "--out",
                           str(folder / "p.h5")], capture_output=True, text=True, timeout=HANG_S, cwd=REPO)
    assert done.returncode == STORAGE_EXIT, done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"mpifl: error: the file system at {folder} could not take the prepared data "
                                  "file p.h5: No space left on device"), done.stderr
    assert not list(folder.iterdir())


class FaultyFs:
    """A real file system on a loop device in a file of the test's folder, that a test makes fail in the middle of
    a run the way a cluster's do: btrfs with a quota (``EDQUOT``: ``statvfs`` shows the disk's free space, not the
    quota's), ext4 that the kernel remounts read-only after an error (``errors=remount-ro``, the error raised
    through ext4's own ``trigger_fs_error``: ``EROFS``), ext4 shut down as after a failing disk (``EIO`` on every
    call; ext4's ``EXT4_IOC_SHUTDOWN``, as xfs_io's ``shutdown`` does: this kernel has no device-mapper for dm-error
    or dm-flakey). Each ext4 fault comes with the file system frozen, so that what was written before it is on the
    disk (a journal aborted on an error drops what the page cache had not written yet, as a power cut does: mpifl
    does not sync its results file, and the test checks mpifl's part). ``mend()`` undoes the fault."""

    MAKE = {"EDQUOT": ("mkfs.btrfs", "-q", "-f"), "EROFS": ("mkfs.ext4", "-q", "-F", "-m", "0"),
            "EIO": ("mkfs.ext4", "-q", "-F", "-m", "0")}
    SIZE = {"EDQUOT": 128 << 20, "EROFS": 16 << 20, "EIO": 16 << 20}  # sparse; btrfs's least is 114 MB

    def __init__(self, fault: str, folder: Path):
        self.fault, self.image, self.point = fault, folder / "fs.img", folder / "fs"
        self.point.mkdir()
        tool = shutil.which(self.MAKE[fault][0])
        if tool is None:
            pytest.skip(f"{self.MAKE[fault][0]} is not installed (scripts/test.sh installs it with apt-get)")
        with open(self.image, "wb") as image:
            image.truncate(self.SIZE[fault])
        subprocess.run([tool, *self.MAKE[fault][1:], str(self.image)], check=True, capture_output=True)
        self.mount()
        self.folder = self.point
        if fault == "EDQUOT":  # a subvolume of its own, whose quota group the test limits
            try:
                for cmd in (["quota", "enable", str(self.point)], ["subvolume", "create", str(self.point / "q")]):
                    self._btrfs(cmd)
                self.folder = self.point / "q"
                self.qgroup = "0/" + self._btrfs(["inspect-internal", "rootid", str(self.folder)]).strip()
            except BaseException:  # a skip too: nothing left mounted
                self.unmount()
                raise

    def mount(self) -> None:
        options = "loop" + (",errors=remount-ro" if self.fault == "EROFS" else "")
        done = subprocess.run(["mount", "-o", options, str(self.image), str(self.point)], capture_output=True,
                              text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a loop device here ({done.stderr.strip() or 'not root'})")

    def _btrfs(self, cmd: list[str]) -> str:
        done = subprocess.run(["btrfs", *cmd], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"btrfs {cmd[0]}: {done.stderr.strip()}")
        return done.stdout

    def fail(self) -> None:
        if self.fault == "EDQUOT":  # less than it holds already: its next write is refused (set from the top
            self._btrfs(["qgroup", "limit", "8k", self.qgroup, str(self.point)])  # level: the limit's own
            return  # transaction would be refused in the subvolume once it is over the limit)
        folder = os.open(self.point, os.O_RDONLY)
        try:
            if self.fault == "EIO":  # 0: frozen (synced, writers held), shut down, thawed: each call fails
                fcntl.ioctl(folder, EXT4_IOC_SHUTDOWN, struct.pack("I", 0))
                return
            fcntl.ioctl(folder, FIFREEZE, struct.pack("i", 0))
            try:
                device = os.stat(self.point).st_dev
                name = Path(f"/sys/dev/block/{os.major(device)}:{os.minor(device)}").resolve().name
                Path(f"/sys/fs/ext4/{name}/trigger_fs_error").write_text("a test's file system error\n")
            finally:
                fcntl.ioctl(folder, FITHAW, struct.pack("i", 0))
        finally:
            os.close(folder)

    def mend(self) -> None:
        if self.fault == "EDQUOT":
            self._btrfs(["qgroup", "limit", "none", self.qgroup, str(self.point)])
            return
        subprocess.run(["umount", str(self.point)], check=True)  # what a user does: unmount, check, mount again
        if self.fault == "EROFS":  # fsck mends the error the kernel recorded (exit 1: errors corrected)
            assert subprocess.run(["fsck.ext4", "-p", str(self.image)], capture_output=True).returncode in (0, 1)
        self.mount()

    def unmount(self) -> None:
        subprocess.run(["umount", "--lazy", str(self.point)], capture_output=True)


def first_rounds(run: dict[str, np.ndarray], rounds: int) -> dict[str, np.ndarray]:
    """What ``run`` (:func:`~tests.conftest.deterministic`) computed in its first ``rounds`` rounds: the rows of
    its evaluations, rounds and ledger (its final state is another round's)."""
    keep = {table: run[f"{table}/round"] <= rounds for table in ("eval", "rounds", "ledger")}
    return {key: values[keep[key.split("/")[0]]] for key, values in run.items() if key.split("/")[0] in keep}


EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32)
FIFREEZE, FITHAW = 0xC0045877, 0xC0045878  # _IOWR('X', 119 and 120, int)
FAULTS = {  # what the line says happened, and what to do before the command that continues
    "EDQUOT": ("Disk quota exceeded (a quota: the file system has ",
               "free space within your quota (or have it raised)"),
    "EROFS": ("Read-only file system", "make the file system writable again (the kernel's log, dmesg, says why it "
                                       "went read-only)"),
    "EIO": ("Input/output error", "mend the file system (the kernel's log, dmesg, says what failed)"),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_quota_a_read_only_or_a_failing_file_system_mid_run_ends_as_a_full_one(tmp_path, long_run, fault):
    """The row "EDQUOT, EROFS, EIO: the same as ENOSPC", on real file systems failing after the run committed a
    checkpoint: one line naming what the file system said, what the file keeps (the committed checkpoint) and what
    to do before the command that continues, exit 75, no temporary file, no crash; once mended, --resume gives the
    bits of a run that never failed. (A read-only or failing file system keeps the lock's file: nothing can remove
    it there; no process holds it, and the resume takes it over. 1 rank: its clients' checkpoint file fails as a
    worker's does, and the cause goes through the same gather to rank 0's line; the 3-rank ENOSPC case above holds
    the line on several ranks.)"""
    config, whole = long_run
    fs = FaultyFs(fault, tmp_path)
    try:
        out = fs.folder / "q.h5"
        job = start([str(config), "--out", str(out), "--quiet"])
        try:
            wait_for_checkpoint(job, out, at_least=5)
            fs.fail()
            _, stderr = job.communicate(timeout=HANG_S)
        finally:
            if job.poll() is None:
                kill_job(job)
        assert job.returncode == STORAGE_EXIT, stderr
        assert "Segmentation" not in stderr and "Traceback" not in stderr
        lines = error_lines(stderr)
        assert len(lines) == 1, stderr
        said, cure = FAULTS[fault]
        line = lines[0]
        assert line.startswith(f"mpifl: error: the file system at {fs.folder} could not take ") and f": {said}" in line
        kept = re.search(rf"; {out} keeps (\d+) round\(s\) and the checkpoint of round (\d+); ", line)
        assert kept and int(kept.group(2)) >= 5, line
        assert line.endswith(f"; {cure}, then continue with: python -m mpifl run --resume {out}")
        def leftovers() -> list[Path]:
            return [*fs.folder.glob(".q.h5.tmp-*"), *fs.folder.glob("q.h5.ckpt/.*.tmp")]

        if fault == "EDQUOT":  # (a read-only or failing one keeps a checkpoint file begun before: the resume
            assert not leftovers()  # removes it)
        fs.mend()
        state = inspect_output(out)  # what the line said the file keeps
        assert (state.rounds_completed, state.checkpoint_round) == tuple(map(int, kept.groups()))
        if fault == "EDQUOT":
            assert not (fs.folder / ".q.h5.lock").exists()
        # to the evaluation after the checkpoint, in this process (no second start-up; the ENOSPC test above
        # resumes to the end)
        upto = state.checkpoint_round + 5
        assert main(["run", "--resume", str(out), "--quiet", "--set", f"rounds={upto}"]) == 0
        assert_same(first_rounds(whole, upto), first_rounds(deterministic(out), upto))
        assert not leftovers()
    finally:
        fs.unmount()


CHECKPOINT_FILE_FAILING = """
import fcntl, os, struct, sys
from pathlib import Path

import numpy as np

from mpifl.results.space import StorageFull, storage_exit
from mpifl.state_io import _write_synced

folder = Path(sys.argv[1])
held = []  # the datasets a failed write leaves referenced (a traceback's frames did so in CI's crash)


def fill(f):
    group = f.create_group("state")
    for i in range(20):
        held.append(group.create_dataset(f"a{{i}}", data=np.arange(1000.0 + i)))
    point = os.open(folder, os.O_RDONLY)
    fcntl.ioctl(point, {shutdown}, struct.pack("I", 0))  # the disk fails before HDF5 flushes the file
    os.close(point)


try:
    _write_synced(folder / "round10-server.h5", fill)
except StorageFull as exc:
    sys.stderr.write(f"mpifl: error: {{exc.strerror}}\\n")
    sys.exit(storage_exit(75))
"""


def test_a_checkpoint_file_whose_disk_fails_before_hdf5_flushes_it_ends_in_one_line_not_a_crash(tmp_path):
    """CI's crash at 47ccc7a (the EIO case above): the server's checkpoint file failed while HDF5 wrote it, h5py
    printed its datasets' failed frees as tracebacks, and HDF5's own clean-up at exit crashed closing them (exit
    -11). The write's HDF5 errors are now collected into one line, and the process that met one ends without
    HDF5's clean-up (``storage_exit``), whichever code caught the error."""
    fs = FaultyFs("EIO", tmp_path)
    try:
        script = tmp_path / "fails.py"
        script.write_text(CHECKPOINT_FILE_FAILING.format(shutdown=EXT4_IOC_SHUTDOWN))
        done = subprocess.run([sys.executable, str(script), str(fs.folder)], capture_output=True, text=True,
                              timeout=HANG_S, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == STORAGE_EXIT, done.stderr
        assert "Traceback" not in done.stderr and "Segmentation" not in done.stderr, done.stderr
        assert errors(done) == [f"mpifl: error: the file system at {fs.folder} could not take the checkpoint file "
                                "round10-server.h5: Input/output error"], done.stderr
    finally:
        fs.unmount()


def test_two_threads_writing_at_once_leave_no_stale_collector(monkeypatch):
    """A checkpoint file (main thread) and a results file (the writer's) may be written at once: once both writes
    ended, a storage error reported in either thread goes to Python's hook again, not into a write's list long gone
    (each write saving and restoring the hooks left the first one's collector installed)."""
    import threading
    import types

    from mpifl.results.space import storage_failures

    reported: list[BaseException] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda args: reported.append(args.exc_value))
    first_in, second_in, first_out, second_out = (threading.Event() for _ in range(4))
    error = OSError(28, "No space left on device")

    def first() -> None:  # the writer's thread: in, out, then an error reported as h5py frees an object
        with storage_failures("x.h5", "the results"):
            first_in.set()
            second_in.wait(HANG_S)
        first_out.set()
        second_out.wait(HANG_S)
        sys.unraisablehook(types.SimpleNamespace(exc_value=error))

    thread = threading.Thread(target=first)
    thread.start()
    first_in.wait(HANG_S)
    with storage_failures("c.h5", "the checkpoint"):
        second_in.set()
        first_out.wait(HANG_S)
    second_out.set()
    thread.join(HANG_S)
    assert reported == [error]


def test_an_error_that_ends_the_writing_thread_is_still_printed(tmp_path):
    """The hooks that keep h5py's reports of freed objects quiet after a failed write keep only those: an error
    that reaches the top of the thread is printed as always (it was dropped: exit 1, nothing said)."""
    script = tmp_path / "ends.py"
    script.write_text("import errno\nfrom mpifl.results.space import storage_failures\n\n"
                      "with storage_failures('x.h5', 'the file x.h5'):\n"
                      "    raise OSError(errno.EROFS, 'Read-only file system')\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=HANG_S, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode == 1 and "StorageFull" in done.stderr and "Read-only file system" in done.stderr, done
