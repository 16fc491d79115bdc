"""mpifl across three namespace nodes (tests/multinode/netns.py): the server on node 1, a worker on each of
nodes 2 and 3, talking over TCP through real links, shaped links and a link that is cut mid-run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from mpifl.results import read_results
from tests.conftest import HANG_S, REPO, TINY, _merge, assert_same, deterministic, run_config
from tests.multinode.netns import Nodes, make_nodes, peek
from tests.test_stop_standing import _rank_pid

# A model of 1 MB (a wide hidden layer costs bytes, hardly any compute): MPI traffic dwarfs the launcher's
# control messages, and a 20 Mbit/s link adds seconds to a round.
JOB = _merge(TINY, {"rounds": 3, "model": {"channels": [8], "fc_hidden": 2000}})
HOSTS = [1, 2, 3]  # rank r on node r + 1: the server alone on node 1
ABORT_BOUND_S = 15  # keepalive detection (at most 5 s) plus the launcher's tear-down, with room for a busy machine


def mpifl_run(config: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "mpifl", "run", str(config), "--out", str(out), "--quiet"]


def write(tmp_path: Path, cfg: dict, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_nodes_go_away_with_whatever_ran_on_them_when_a_test_fails(tmp_path):
    setup = make_nodes(2, tmp_path)
    two = next(setup)
    sleeper = subprocess.Popen(two.on(2, ["sleep", "600"]))
    # Popen returns before `ip netns exec` has entered the namespace; on a busy machine the teardown could
    # otherwise look for the namespace's processes before the sleeper is one of them.
    deadline = time.monotonic() + HANG_S
    while str(sleeper.pid) not in subprocess.run(["ip", "netns", "pids", two.ns[1]], capture_output=True,
                                                 text=True).stdout.split():
        assert sleeper.poll() is None and time.monotonic() < deadline, "the sleeper never entered node 2"
        time.sleep(0.05)
    with pytest.raises(RuntimeError, match="a failing test"):
        setup.throw(RuntimeError("a failing test"))
    assert sleeper.wait(timeout=HANG_S) == -signal.SIGKILL
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not [ns for ns in [*two.ns, two.switch] if ns in left]


def test_each_rank_runs_on_its_own_node(nodes: Nodes):
    proc = nodes.run(HOSTS, [sys.executable, "-c", "import socket; from mpi4py import MPI; "
                             "print(MPI.COMM_WORLD.Get_rank(), socket.gethostname(), MPI.Get_processor_name())"])
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split("\n")[:-1]) == [f"{r} node{r + 1} node{r + 1}" for r in range(3)]


@dataclass
class Across:
    """One run of JOB across the nodes: its config, results file, and the bytes each node's link carried."""

    config: Path
    out: Path
    carried: list[int]


@pytest.fixture(scope="module")
def across(nodes: Nodes, tmp_path_factory) -> Across:
    where = tmp_path_factory.mktemp("across")
    config, out = write(where, JOB), where / "nodes.h5"
    before = [nodes.link_bytes(n) for n in HOSTS]
    proc = nodes.run(HOSTS, mpifl_run(config, out))
    assert proc.returncode == 0, proc.stderr
    return Across(config, out, [nodes.link_bytes(n) - b for n, b in zip(HOSTS, before)])


def test_job_across_nodes_is_bitwise_the_one_node_job_and_its_bytes_crossed_the_links(across: Across, tmp_path):
    run_config(across.config, tmp_path / "local.h5")  # one rank, in this process: the same bits as any rank count
    assert_same(deterministic(tmp_path / "local.h5"), deterministic(across.out))
    mpi_bytes = read_results(across.out).table("ranks")["mpi_bytes"]
    assert mpi_bytes.min() > 2_000_000  # the model's rounds, not only set-up handshakes
    for rank, node in enumerate(HOSTS):  # each rank's MPI traffic went through its own node's link
        assert across.carried[node - 1] >= mpi_bytes[rank], (rank, across.carried, mpi_bytes)
    # and little else did: TCP/IP headers and the launcher's messages add a few percent
    assert sum(across.carried) < 1.2 * mpi_bytes.sum(), (across.carried, mpi_bytes)


def test_shaped_links_slow_the_job_down_and_change_no_bit(nodes: Nodes, across: Across, tmp_path):
    nodes.shape("20mbit")
    try:
        proc = nodes.run(HOSTS, mpifl_run(across.config, tmp_path / "slow.h5"))
    finally:
        nodes.unshape()
    assert proc.returncode == 0, proc.stderr
    assert_same(deterministic(across.out), deterministic(tmp_path / "slow.h5"))
    # The server's node moves half its MPI bytes each way through its one link, 20 Mbit/s in each direction:
    # the round loop (start-up excluded, as it does not depend on the links) takes at least that much longer.
    fast, slow = (read_results(path).table("ranks") for path in (across.out, tmp_path / "slow.h5"))
    wire_s = slow["mpi_bytes"][0] / 2 * 8 / 20e6
    assert wire_s > 1 and slow["loop_wall_seconds"][0] - fast["loop_wall_seconds"][0] > 0.8 * wire_s, (
        fast["loop_wall_seconds"], slow["loop_wall_seconds"], wire_s)


def test_a_cut_link_ends_the_job_within_the_keepalive_bound_and_keeps_the_last_evaluation(nodes: Nodes, tmp_path):
    """Node 3's cable is pulled mid-run. Nothing tells TCP: the launcher notices the silent control connection
    to node 3's daemon after its keepalive probes (KEEPALIVE: 2 + 3 x 1 s) and ends every rank."""
    out = tmp_path / "cut.h5"
    config = write(tmp_path, _merge(JOB, {"rounds": 500}))
    job = subprocess.Popen(nodes.mpirun(HOSTS, mpifl_run(config, out)), env=nodes.env(), cwd=REPO,
                           stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + HANG_S
        while peek(out)[0] < 2:
            assert job.poll() is None and time.monotonic() < deadline, "the job did not reach round 2"
            time.sleep(0.1)
        threading.Thread(target=nodes.cut, args=(3,)).start()
        cut = time.monotonic()
        _, stderr = job.communicate(timeout=HANG_S)
        ended = time.monotonic() - cut
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    assert ended < ABORT_BOUND_S, stderr
    # Not asserted: the exit status. Open MPI 5.0.11's mpirun exits 0 after losing a daemon (it killed the
    # ranks itself), so its message and the results file's status are what tell the user.
    assert "PRTE has lost communication with a remote daemon" in stderr and "on node node3" in stderr
    res = read_results(out)
    assert res.attrs["status"] == "running" and res.attrs["rounds_completed"] >= 2
    rounds = res.table("eval")["round"]
    assert list(rounds) == list(range(1, res.attrs["rounds_completed"] + 1))  # every evaluation, up to the last



def test_a_worker_killed_on_another_node_is_named_by_rank_0(nodes: Nodes, tmp_path):
    """kill -9 of rank 1 on node 2: Open MPI's TCP transport ends a survivor at once, in C, and its lines blame
    that survivor; rank 0's lifeline to the worker (mpifl/runtime/lifeline.py) breaks first, and rank 0 names the
    rank, its node, where to see the run's standing and the command that continues it. (Nodes 1 and 2: the cut
    link's test leaves node 3 cut.)"""
    out = tmp_path / "killed.h5"
    config = write(tmp_path, _merge(TINY, {"rounds": 100_000, "eval_every": 1000, "checkpoint_every": 5,
                                           "model": {"name": "logistic"}}))
    job = subprocess.Popen(nodes.mpirun([1, 2], mpifl_run(config, out)), env=nodes.env(), cwd=REPO,
                           stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + HANG_S
        while not peek(out)[1]:
            assert job.poll() is None and time.monotonic() < deadline, "the job committed no checkpoint"
            time.sleep(0.1)
        worker = _rank_pid(1, out)
        os.kill(worker, signal.SIGKILL)
        _, stderr = job.communicate(timeout=HANG_S)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    lines = [line.lstrip(" \0") for line in stderr.splitlines() if line.lstrip(" \0").startswith("mpifl: ")]
    resume = f"mpirun -n 2 --oversubscribe --host {nodes.addr[0]},{nodes.addr[1]} --map-by node"  # as launched
    assert lines == [f"mpifl: rank 1 of 2 (pid {worker} on node2, another node) has died, so Open MPI ends the job "
                     "(its lines below may blame a rank that lost its connection to it); python -m mpifl report "
                     f"{out} says where the run stands, and {resume} python -m mpifl run --resume {out} continues "
                     "it from its last checkpoint"], stderr
    assert peek(out)[1]
