"""After any stop, every command says where the run stands (issue 50): a Ctrl-C in a terminal that reaches only
``mpirun``, the checkpoint folder of a resumed run that completes, names too long for the file system, and
``plot --help`` against the plot's titles."""

import os
import pty
import select
import shlex
import subprocess
import sys
import time
from pathlib import Path

import h5py
import pytest
import yaml

from mpifl.cli import _parser, main
from mpifl.results import read_results, shard_dir
from mpifl.results.guard import inspect_output
from tests.conftest import TINY, _merge, mpi_env, mpirun_cmd
from tests.test_run_outputs import digest

HANG_S = 180  # a generous bound that only catches a hang


def _in_a_terminal(cmd: list[str], cwd: Path) -> tuple[subprocess.Popen, int]:
    """Start ``cmd`` as a terminal's foreground job: a session of its own whose controlling terminal is a new
    pseudo-terminal; returns the process and the terminal's master side (what a user's screen and keyboard are)."""
    import fcntl
    import termios

    master, slave = pty.openpty()

    def take_terminal() -> None:  # after setsid: the slave becomes the session's controlling terminal
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    job = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=mpi_env(), cwd=cwd,
                           start_new_session=True, preexec_fn=take_terminal)
    os.close(slave)
    return job, master


def _read_until(master: int, job: subprocess.Popen, done, deadline: float) -> bytes:  # noqa: ANN001 - a predicate
    """What the terminal shows, read until ``done(shown)`` holds or the terminal closes (every process gone)."""
    shown = b""
    while not done(shown):
        assert time.monotonic() < deadline, f"hung; the terminal showed: {shown.decode(errors='replace')[-2000:]}"
        ready, _, _ = select.select([master], [], [], 0.1)
        if not ready:
            continue
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the last process holding the terminal is gone
            return shown
        if not data:
            return shown
        shown += data
    return shown


def _committed(out: Path) -> bool:
    try:
        with h5py.File(out, "r", locking=False) as f:
            return "checkpoint" in f
    except OSError:  # between the writer's flushes
        return False


def _long_run_in_a_terminal(tmp_path: Path, act) -> tuple[str, Path, Path]:  # noqa: ANN001 - act(master, out)
    """A 3-rank run of 100,000 rounds under mpirun in a terminal; once it has committed a checkpoint, ``act`` (a
    Ctrl-C typed, a rank killed); what the terminal showed until the job ended, the config and the results file."""
    config = tmp_path / "q.yaml"
    config.write_text(yaml.safe_dump(_merge(TINY, {"rounds": 100_000, "eval_every": 1000, "checkpoint_every": 5,
                                                   "model": {"name": "logistic"}})))
    out = tmp_path / "r.h5"
    job, master = _in_a_terminal(mpirun_cmd(3) + [sys.executable, "-m", "mpifl", "run", str(config), "--out",
                                                 str(out)], tmp_path)
    deadline = time.monotonic() + HANG_S
    try:
        shown = _read_until(master, job, lambda _: _committed(out), deadline)
        act(master, out)
        shown += _read_until(master, job, lambda _: False, deadline)
        job.wait(timeout=HANG_S)
    finally:
        if job.poll() is None:
            job.kill()
        os.close(master)
    return shown.decode(errors="replace").replace("\r\n", "\n"), config, out


def test_ctrl_c_in_a_terminal_under_mpirun_says_where_the_run_stands_and_the_printed_line_resumes(tmp_path, capsys):
    """Row 1 and 5: a terminal's Ctrl-C reaches ``mpirun`` alone, which stops forwarding output and kills the ranks
    half a second later. Rank 0 writes to the terminal itself: at once, that the stop is under way and where to
    look; once the checkpoint is saved (if the SIGKILL leaves time), the command that continues the run, with
    mpirun's own options. The same command run again refuses, touching nothing, with where the run stands; the
    printed command, as printed, resumes it on this 2-core machine (3 ranks need --oversubscribe)."""
    # Ctrl-C, as typed: the terminal sends SIGINT to its foreground group, mpirun's
    screen, config, out = _long_run_in_a_terminal(tmp_path, lambda master, out: os.write(master, b"\x03"))
    assert (f"mpifl: Ctrl-C or SIGTERM to mpirun (or a rank that died on another node): it kills the ranks half a "
            f"second later; saving a checkpoint after the round under way if there is time; then python -m mpifl "
            f"report {out} says where the run stands and how to continue it (kill -USR1 <mpirun's pid> stops with "
            "time to save)\n") in screen
    state = inspect_output(out)
    resume = f"mpirun -n 3 --oversubscribe python -m mpifl run --resume {out}"
    assert state.condition in ("interrupted", "stopped"), state  # stopped: the SIGKILL came before the file's mark
    if state.condition == "interrupted":
        assert (f"mpifl: Ctrl-C or SIGTERM to mpirun: stopped after round {state.rounds_completed} of 100000 and saved "
                f"a checkpoint; continue with: {resume} (any rank count)\n") in screen
    assert "Traceback" not in screen

    before = digest(out)
    assert main(["run", str(config), "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"mpifl: error: output {out} holds an unfinished run: {state.condition} at round {state.rounds_completed} of "
        f"100000, resumable from round {state.checkpoint_round}: {resume} (any rank count); or --overwrite starts "
        "it again\n")
    assert digest(out) == before

    printed = shlex.split(resume.replace(" python ", f" {sys.executable} "))
    printed[0] = mpirun_cmd(3)[0]  # the mpirun of this environment
    proc = subprocess.run([*printed, "--quiet", f"--set=rounds={state.checkpoint_round + 1}"], env=mpi_env(),
                          cwd=tmp_path, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stderr
    assert read_results(out).attrs["status"] == "completed"


def _rank_pid(rank: int, out: Path) -> int:
    """The process id of rank ``rank`` of the job writing ``out`` (Open MPI puts each rank's number in its
    environment)."""
    for proc in Path("/proc").iterdir():
        try:
            if str(out).encode() in (proc / "cmdline").read_bytes() and (
                    f"OMPI_COMM_WORLD_RANK={rank}\0".encode() in (proc / "environ").read_bytes()):
                return int(proc.name)
        except OSError:  # a process that has ended, or is not ours
            continue
    raise AssertionError(f"no rank {rank} writing {out}")


def test_a_worker_killed_under_mpirun_is_named_with_where_the_run_stands(tmp_path):
    """kill -9 of rank 1: mpirun ends the job (SIGTERM to the other ranks, as for a Ctrl-C), and rank 0 says what
    happened instead of blaming a Ctrl-C: which rank died, where to see the run's standing, the command that
    continues it."""
    killed: list[int] = []

    def kill_rank_1(master: int, out: Path) -> None:
        killed.append(_rank_pid(1, out))
        os.kill(killed[0], 9)

    screen, _, out = _long_run_in_a_terminal(tmp_path, kill_rank_1)
    worker = killed[0]
    assert (f"mpifl: rank 1 of 3 (pid {worker}) has died, so mpirun ends the job: it kills the other ranks half a "
            f"second later; python -m mpifl report {out} says where the run stands, and mpirun -n 3 --oversubscribe "
            f"python -m mpifl run --resume {out} continues it from its last checkpoint\n") in screen
    assert "Ctrl-C" not in screen and "Traceback" not in screen
    assert inspect_output(out).checkpoint_round is not None


def test_a_resumed_run_that_completes_keeps_only_its_committed_checkpoints(write_config, tmp_path, monkeypatch):
    """Row 6: a segment killed while it wrote a checkpoint leaves files nothing commits (a later round's shards,
    a temporary name); the resumed run, completed, leaves only the checkpoints its file lists, checkpoint_keep of
    them at most. A run that never took a checkpoint leaves no folder."""
    config, out = write_config({"rounds": 6, "checkpoint_every": 2, "model": {"name": "logistic"}}), tmp_path / "r.h5"
    monkeypatch.setenv("MPIFL_INJECT_FAULT", "0:5")  # dies in round 5: checkpoints at rounds 2 and 4
    assert main(["run", str(config), "--out", str(out), "--quiet"]) == 1
    monkeypatch.delenv("MPIFL_INJECT_FAULT")
    folder = shard_dir(out)
    for stale in ("round6-server.h5", "round6-rank0.h5", ".round6-server.h5.tmp", "round6-runtime.h5"):
        (folder / stale).write_bytes(b"an unfinished checkpoint of the killed segment")
    assert main(["run", "--resume", str(out), "--quiet", "--set", "rounds=5"]) == 0  # round 5 takes none
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        f"round{r}-{who}.h5" for r in (2, 4) for who in ("rank0", "server"))
    plain = tmp_path / "plain.h5"
    assert main(["run", str(write_config({"rounds": 2}, name="plain.yaml")), "--out", str(plain), "--quiet"]) == 0
    assert not shard_dir(plain).exists()


LONG_NAME = "b" * 300
LEGAL_NAME = "b" * 247 + ".h5"  # 250 bytes: legal, but its lock (".NAME.lock") is 256


@pytest.mark.parametrize("args", [
    ["run", "CONFIG", "--out", f"DIR/{LONG_NAME}.h5"],
    ["run", "CONFIG", "--out", f"DIR/{LONG_NAME}/r.h5"],
    ["run", "CONFIG", "--out", f"DIR/{LEGAL_NAME}"],
    ["run", "CONFIG", "--out", f"DIR/{LEGAL_NAME}", "--overwrite"],
    ["run", "--resume", f"DIR/{LEGAL_NAME}"],
    ["run", "--resume", f"DIR/{LONG_NAME}.h5"],
    ["prepare", "CONFIG", "--out", f"DIR/{LONG_NAME}.h5"],
    ["prepare", "CONFIG", "--out", f"DIR/{'b' * 250}.h5"],  # legal, but not its temporary name
    ["plot", "DIR/done.h5", "-o", f"DIR/{LONG_NAME}.png"],
    ["export", "DIR/done.h5", "--csv", f"DIR/{LONG_NAME}"],
    ["sweep", "SWEEP"],
    ["sweep", "SWEEP", "--output-dir", f"DIR/{LONG_NAME}"],
], ids=["run", "run-folder", "run-lock", "run-overwrite", "resume-lock", "resume", "prepare", "prepare-temporary",
        "plot", "export", "sweep-variant", "sweep-output-dir"])
def test_a_name_too_long_is_one_line_exit_2_and_nothing_is_created(tmp_path, capsys, args):
    """Rows 7-9: every writing command checks the whole path, the names it creates beside it too (a results
    file's lock, temporary name and checkpoint folder; a prepared file's temporary name), before anything else."""
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(_merge(TINY, {"rounds": 1, "model": {"name": "logistic"}})))
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"base": str(config), "output_dir": str(tmp_path / "sweep"), "seeds": [0],
                                     "variants": [{"name": LONG_NAME, "set": {"client.lr": 0.2}}]}))
    done = tmp_path / "done.h5"
    assert main(["run", str(config), "--out", str(done), "--quiet"]) == 0
    capsys.readouterr()
    before = sorted(tmp_path.rglob("*"))
    swap = {"CONFIG": str(config), "SWEEP": str(sweep)}
    assert main([swap.get(a, a.replace("DIR", str(tmp_path))) for a in args]) == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and captured.err.startswith("mpifl: error: "), captured.err
    assert "this file system allows in a name" in captured.err and "Traceback" not in captured.err
    assert sorted(tmp_path.rglob("*")) == before


def test_run_help_and_plot_titles_say_the_same(tmp_path):
    """Row 10: ``mpifl --help`` describes the plot's curves as its titles do (one seed: no average)."""
    from mpifl.report.plots import averaging

    shown = " ".join(_parser().format_help().split())
    assert averaging(2) in shown and averaging(1) in shown
