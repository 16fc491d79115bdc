"""Slurm on two namespace nodes (tests/multinode/netns.py): slurmctld on the bridge's own namespace (the
head node "ctl", 10.77.0.254), a slurmd on each of node1 and node2, each with its own hostname and address;
jobs span both nodes."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import yaml

from mpifl.results import read_results
from tests.conftest import HANG_S, REPO, TINY, _merge, assert_same, deterministic, run_config
from tests.multinode.netns import Nodes, inside, make_nodes, peek
from tests.slurm.test_slurm import _sbin, missing, slurm_conf, start_munge, wait_for

pytestmark = pytest.mark.skipif(bool(missing), reason=f"needs Slurm (missing: {', '.join(missing)}); "
                                "scripts/test.sh installs it")
HEAD = ("ctl", "10.77.0.254")


@dataclass
class Cluster:
    nodes: Nodes
    env: dict[str, str]

    def command(self, cmd: list[str], timeout: float = HANG_S) -> subprocess.CompletedProcess:
        """A Slurm command (srun, sbatch, sinfo) as a user would type it on the head node."""
        return subprocess.run(inside(self.nodes.switch, HEAD[0], cmd, own_sysfs=False), capture_output=True,
                              text=True, env=self.env, cwd=REPO, timeout=timeout)

    def wait(self, job: str, timeout: float = HANG_S) -> str:
        """Wait for ``job`` to end and return ``scontrol show job``'s record of it."""
        return wait_for(job, self.command, timeout)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    where = tmp_path_factory.mktemp("cluster")
    for nodes in make_nodes(2, where):  # one pass; the nodes and every daemon on them go away after it
        hosts = [(f"node{i}", addr) for i, addr in enumerate(nodes.addr, 1)]
        conf = slurm_conf(where, HEAD, hosts)
        env = {**nodes.env(), "SLURM_CONF": str(conf), "MPIFL_VENV": sys.prefix}
        subprocess.run(["ip", "-n", nodes.switch, "addr", "add", f"{HEAD[1]}/24", "dev", "br0"], check=True)
        start_munge()
        subprocess.run(inside(nodes.switch, HEAD[0], [_sbin("slurmctld"), "-i", "-f", str(conf)], own_sysfs=False),
                       check=True, env=env)
        for name, _ in hosts:
            subprocess.run(inside(nodes.ns[int(name[-1]) - 1], name, [_sbin("slurmd"), "-N", name, "-f", str(conf)],
                                  own_sysfs=False), check=True, env=env)
        cluster = Cluster(nodes, env)
        waited = cluster.command(["sh", "-c", "for i in $(seq 60); do [ \"$(sinfo -h -o %T)\" = idle ] && exit 0; "
                                  "sleep 0.5; done; exit 1"])
        assert waited.returncode == 0, (where / "slurmctld.log").read_text()[-2000:]
        yield cluster


def test_srun_spans_both_nodes(cluster: Cluster):
    proc = cluster.command(["srun", "-N", "2", "-n", "2", "hostname"])
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split()) == ["node1", "node2"]


def test_two_node_batch_job_requeued_mid_run_resumes_to_the_one_node_bits(cluster: Cluster, tmp_path):
    """jobs/mpifl-requeue.sbatch with -N 2 (Open MPI's mpirun inside the allocation starts node2's daemon
    through srun): requeued after its first checkpoint, it continues with --resume on both nodes again."""
    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump(_merge(TINY, {"rounds": 6, "checkpoint_every": 2})))
    out = tmp_path / "r.h5"
    before = cluster.nodes.link_bytes(2)
    submit = cluster.command(["sbatch", "--parsable", "-N", "2", "--ntasks=3", f"--output={tmp_path}/job.out",
                              f"--export=ALL,MPIFL_LAUNCHER=mpirun,MPIFL_OUT={out}", "jobs/mpifl-requeue.sbatch",
                              str(config), "--quiet"])
    assert submit.returncode == 0, submit.stderr
    job = submit.stdout.strip().split(";")[0]
    deadline = time.monotonic() + HANG_S
    while not peek(out)[1]:
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.1)
    assert cluster.command(["scontrol", "requeue", job]).returncode == 0
    # A requeued job waits two minutes before it may start again: lift that once it is back in the queue and
    # its nodes are clean, and a second after the requeue revoked its credential (revocations are compared
    # to whole seconds: a restart within the same second is refused as "Job credential revoked").
    while cluster.command(["sh", "-c", f"squeue -h -j {job} -o %T; sinfo -h -o %T"]).stdout.split() != [
            "PENDING", "idle"]:
        assert time.monotonic() < deadline, "the job was not requeued"
        time.sleep(0.1)
    time.sleep(1)
    assert cluster.command(["scontrol", "update", f"JobId={job}", "StartTime=now"]).returncode == 0
    state = cluster.wait(job)
    assert "JobState=COMPLETED" in state and "Restarts=1" in state and "NodeList=node[1-2]" in state, (
        state + (tmp_path / "job.out").read_text())
    run_config(config, tmp_path / "local.h5")
    assert_same(deterministic(tmp_path / "local.h5"), deterministic(out))
    res = read_results(out)
    assert res.attrs["status"] == "completed" and res.attrs["world_size"] == 3 and res.attrs["hostname"] == "node1"
    # Slurm placed ranks 0 and 1 on node1 and rank 2 on node2: rank 2's traffic crossed node2's link
    assert cluster.nodes.link_bytes(2) - before >= res.table("ranks")["mpi_bytes"][2] > 0
