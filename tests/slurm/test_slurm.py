"""Batch jobs on a real single-node Slurm that these tests start themselves (slurmctld + slurmd +
munge on localhost, as root). ``scripts/test.sh`` installs Debian's Slurm when it runs as root;
elsewhere these tests are skipped with the reason."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import pytest
import yaml

from mpifl.cli import main
from tests.conftest import HANG_S, REPO, mpi_env
from tests.multinode.netns import peek

DAEMONS = ("slurmctld", "slurmd", "sbatch", "munged", "munge")
missing = [d for d in DAEMONS if shutil.which(d, path=os.environ.get("PATH", "") + ":/usr/sbin") is None]
pytestmark = pytest.mark.skipif(
    bool(missing) or os.geteuid() != 0,
    reason=f"needs a local Slurm as root (missing: {', '.join(missing) or 'root'}); scripts/test.sh installs it",
)

CONF = """ClusterName=mpifl-test
SlurmctldHost={host}({addr})
SlurmUser=root
SlurmctldPort=16817
SlurmdPort=16818
AuthType=auth/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
{nodes}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def slurm_conf(d: Path, controller: tuple[str, str], nodes: list[tuple[str, str]]) -> Path:
    """``d``/slurm.conf for a cluster run from ``d``: the controller and each node as (hostname, address)."""
    for sub in ("state", "spool", *(f"spool/{name}" for name, _ in nodes)):
        (d / sub).mkdir(exist_ok=True)
    lines = "".join(f"NodeName={name} NodeAddr={addr} CPUs=8 State=UNKNOWN\n" for name, addr in nodes)
    conf = d / "slurm.conf"
    conf.write_text(CONF.format(host=controller[0], addr=controller[1], d=d, nodes=lines))
    return conf


def start_munge() -> None:
    """The authentication daemon every Slurm daemon and command talks to (over a socket in /run/munge)."""
    if subprocess.run([_sbin("munge"), "-n"], capture_output=True).returncode != 0:
        Path("/run/munge").mkdir(exist_ok=True)
        subprocess.run([_sbin("munged"), "--force"], check=True, capture_output=True)


def stop_orphaned_daemons() -> None:
    """Kill the Slurm daemons of an earlier test session that died before its teardown: their config file is
    gone with its temporary folder, and they would hold the fixed ports (a new controller then exits, and sbatch
    talks to the orphan until it dies)."""
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if Path(argv[0].decode(errors="replace")).name in ("slurmctld", "slurmd") and b"-f" in argv:
            conf = Path(argv[argv.index(b"-f") + 1].decode(errors="replace"))
            if not conf.exists():
                subprocess.run(["kill", "-9", proc.name], check=False)
                deadline = time.monotonic() + HANG_S
                while proc.exists() and time.monotonic() < deadline:  # its ports are free once it is gone
                    time.sleep(0.1)


def _sbin(name: str) -> str:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    d = tmp_path_factory.mktemp("slurm")
    host = socket.gethostname().split(".")[0]
    conf = slurm_conf(d, (host, "127.0.0.1"), [(host, "127.0.0.1")])
    env = {**mpi_env(), "SLURM_CONF": str(conf), "MPIFL_VENV": sys.prefix, "PATH": f"{Path(sys.executable).parent}:"
           + os.environ.get("PATH", "")}
    start_munge()
    stop_orphaned_daemons()
    subprocess.run([_sbin("slurmctld"), "-i", "-f", str(conf)], check=True, env=env)
    subprocess.run([_sbin("slurmd"), "-f", str(conf)], check=True, env=env)
    try:
        deadline = time.monotonic() + HANG_S
        while "idle" not in subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=env).stdout:
            assert time.monotonic() < deadline, "the local Slurm node never became idle"
            time.sleep(0.5)
        # sinfo answers whichever controller holds the fixed port: ours must be the one still running
        controller = int((d / "slurmctld.pid").read_text())
        assert Path(f"/proc/{controller}").exists(), (d / "slurmctld.log").read_text()[-1000:]
        yield env
    finally:
        for pid_file in (d / f"slurmd-{host}.pid", d / "slurmctld.pid"):
            if pid_file.exists():
                subprocess.run(["kill", pid_file.read_text().strip()], check=False)


def pmix_works(env) -> bool:
    listing = subprocess.run(["srun", "--mpi=list"], capture_output=True, text=True, env=env)
    return "pmix" in listing.stdout + listing.stderr and Path("/usr/lib/x86_64-linux-gnu/libpmix.so").exists()


def wait_for(job: str, command: Callable[[list[str]], subprocess.CompletedProcess],
             timeout: float = HANG_S) -> str:
    """Wait for ``job`` (every task, for an array) to end, looking every 0.2 s with ``command``, and return
    ``scontrol show job``'s record of it. ``sbatch --wait`` looks after 2, 10 and 42 s: a job that took 11 s
    held its test for 42."""
    deadline = time.monotonic() + timeout
    while command(["squeue", "-h", "-j", job]).stdout.strip():
        assert time.monotonic() < deadline, f"job {job} did not end within {timeout} s"
        time.sleep(0.2)
    return command(["scontrol", "show", "job", job]).stdout


def sbatch(env, *args, timeout=HANG_S) -> None:
    """Submit a batch job and wait for it: every task must complete with exit code 0."""
    proc = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, env=env, cwd=REPO,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    record = wait_for(proc.stdout.strip().split(";")[0], lambda command: subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=timeout), timeout)
    states = re.findall(r"JobState=(\S+) .*?ExitCode=(\S+)", record, re.S)
    assert states and set(states) == {("COMPLETED", "0:0")}, record


@pytest.mark.parametrize("launcher", [pytest.param("mpirun", marks=pytest.mark.slow), "srun"])
def test_batch_job_runs_on_three_ranks(slurm, write_config, tmp_path, launcher):
    env = {**slurm, "MPIFL_LAUNCHER": launcher, "MPIFL_OUT": str(tmp_path / "r.h5")}
    if launcher == "srun":
        if not pmix_works(env):
            pytest.skip("Slurm's PMIx plugin is not usable here (install libpmix-dev)")
        env["MPIFL_SRUN_MPI"] = "pmix"
    sbatch(env, "--ntasks=3", "--cpus-per-task=2", f"--output={tmp_path}/job.out", "jobs/mpifl.sbatch",
           str(write_config()), "--quiet")
    with h5py.File(tmp_path / "r.h5") as f:
        assert f.attrs["status"] == "completed" and f.attrs["world_size"] == 3
        assert yaml.safe_load(f.attrs["config"])["threads_per_rank"] == 2  # from --cpus-per-task


def test_sweep_as_job_array_then_report(slurm, write_config, tmp_path, capsys):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"base: {write_config({'rounds': 2})}\noutput_dir: {tmp_path / 'out'}\nranks: 2\n"
                     "seeds: [0, 1]\ngrid:\n  algorithm: [fedavg, local]\n")
    assert main(["sweep", str(sweep), "--slurm"]) == 0
    sbatch({**slurm, "MPIFL_LAUNCHER": "mpirun"}, "--cpus-per-task=2", str(tmp_path / "out" / "sweep.sbatch"))
    assert len(list((tmp_path / "out").glob("*.h5"))) == 4
    for path in (tmp_path / "out").glob("*.h5"):
        with h5py.File(path) as f:
            assert yaml.safe_load(f.attrs["config"])["threads_per_rank"] == 2  # from --cpus-per-task
    assert main(["report", str(tmp_path / "out")]) == 0
    table = capsys.readouterr().out
    assert "| fedavg | 2 |" in table and "| local | 2 |" in table


def test_requeued_job_resumes_from_its_checkpoint(slurm, write_config, tmp_path):
    """jobs/mpifl-requeue.sbatch: requeued mid-run (as before a time limit), it continues with --resume
    and ends bitwise equal to an uninterrupted run."""
    from tests.test_checkpoint import assert_same, deterministic

    config = write_config({"algorithm": "feddeper", "rounds": 10, "clients_per_round": 3, "checkpoint_every": 2,
                           "eval_every": 5, "client": {"steps": 30}})
    out = tmp_path / "r.h5"
    env = {**slurm, "MPIFL_LAUNCHER": "mpirun", "MPIFL_OUT": str(out)}
    submit = subprocess.run(["sbatch", "--parsable", "--ntasks=3", f"--output={tmp_path}/job.out",
                             "jobs/mpifl-requeue.sbatch", str(config), "--quiet"],
                            capture_output=True, text=True, env=env, cwd=REPO, check=True)
    job = submit.stdout.strip().split(";")[0]
    deadline = time.monotonic() + HANG_S
    while not peek(out)[1]:  # a read that falls in one of the job's writes fails: peek says "not yet"
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.2)
    subprocess.run(["scontrol", "requeue", job], env=env, check=True)
    # lift the requeued job's two-minute hold only once it is pending on a clean node, and a second after the
    # requeue revoked its credential (compared in whole seconds: a restart within that second is refused)
    while subprocess.run(["sh", "-c", f"squeue -h -j {job} -o %T; sinfo -h -o %T"], capture_output=True,
                         text=True, env=env).stdout.split() != ["PENDING", "idle"]:
        assert time.monotonic() < deadline, "the job was not requeued"
        time.sleep(0.1)
    time.sleep(1)
    subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, check=True)
    while subprocess.run(["squeue", "-h", "-j", job], capture_output=True, text=True, env=env).stdout.strip():
        assert time.monotonic() < deadline + 240, "the requeued job did not finish"
        time.sleep(1)
    restarts = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, env=env).stdout
    assert "Restarts=1" in restarts
    reference = tmp_path / "reference.h5"
    assert main(["run", str(config), "--out", str(reference), "--quiet"]) == 0
    with h5py.File(out) as f:
        assert f.attrs["status"] == "completed"
    assert_same(deterministic(reference), deterministic(out))
