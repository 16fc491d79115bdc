"""Several nodes on one machine: Linux network namespaces joined by veth links to a bridge, each node with
its own address and its own hostname (a UTS namespace), and Open MPI's launcher starting its remote daemons
in them instead of over ssh. Needs root and ``ip netns``; skipped with the reason elsewhere.

Layout (``PREFIX`` is mpifl<this process's id>x<serial>, so parallel or leftover sessions never collide)::

    PREFIX-sw: bridge br0 ── port p1 ═ veth ═ eth0 in PREFIX-n1 (10.77.0.1, hostname node1)
                         ├── port p2 ═ veth ═ eth0 in PREFIX-n2 (10.77.0.2, hostname node2)
                         └── ...

The bridge lives in its own namespace, so nothing touches the root namespace's routes. ``mpirun`` runs on
node 1 (as on a cluster's first node); the daemons of the other nodes are started by ``agent.sh``, which
Open MPI runs instead of ssh (``PRTE_MCA_plm_ssh_agent``) and which maps a node's address to its namespace.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import h5py
import pytest

from mpifl.results.layout import rounds_completed
from tests.conftest import HANG_S, REPO, mpi_env, mpirun_cmd

SUBNET = "10.77.0"
SERIAL = itertools.count(1)  # node sets of this process: mpifl<pid>x<serial>-...
# A daemon whose node stops answering is declared lost after 2 + 1 * 3 s of silence on its (otherwise idle)
# control connection; Open MPI's default, 300 + 20 * 9 s, would leave a job on a cut link hanging for 8 min.
KEEPALIVE = {"time": "2", "intvl": "1", "probes": "3"}

AGENT = """#!/bin/sh
# Open MPI's stand-in for ssh: "agent.sh HOST COMMAND..." runs COMMAND on the namespace node HOST.
host=$1; shift
case $host in
{cases}
  *) echo "agent.sh: unknown node $host" >&2; exit 1;;
esac
exec ip netns exec "$ns" unshare --uts sh -c "hostname $name; $*"
"""


def peek(path: Path) -> tuple[int, bool]:
    """(rounds committed, has a checkpoint) of a running job's results file, (0, False) before its first
    write or while a write is under way (a read then fails: "truncated file", "bad heap free list"); read
    without HDF5's file lock, which the writing rank may hold."""
    try:
        with h5py.File(path, "r", locking=False) as f:
            return rounds_completed(f), "checkpoint" in f
    except (OSError, RuntimeError, KeyError):
        return 0, False


def inside(ns: str, hostname: str, cmd: list[str], own_sysfs: bool = True) -> list[str]:
    """``cmd`` run in network namespace ``ns`` under its own ``hostname``. ``ip netns exec`` also mounts a
    /sys that shows the namespace's interfaces; daemons that need the host's /sys (slurmd's cgroups) enter
    the network namespace alone."""
    enter = ["ip", "netns", "exec", ns] if own_sysfs else ["nsenter", f"--net=/run/netns/{ns}"]
    return [*enter, "unshare", "--uts", "sh", "-c", f'hostname {hostname}; exec "$@"', "sh", *cmd]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@dataclass
class Nodes:
    """N namespace nodes on one bridge; node ``i`` (1-based) is ``ns[i-1]`` at ``addr[i-1]``."""

    ns: list[str]
    addr: list[str]
    switch: str
    agent: Path

    def port(self, node: int) -> str:
        """The bridge's end of node ``node``'s link (what a cable cut or a switch's shaper acts on)."""
        return f"p{node}"

    def link_bytes(self, node: int) -> int:
        """Bytes node ``node``'s link carried so far, both directions, as the bridge's port counts them."""
        stats = json.loads(_ip("-n", self.switch, "-j", "-s", "link", "show", "dev", self.port(node)).stdout)[0]
        return int(stats["stats64"]["rx"]["bytes"] + stats["stats64"]["tx"]["bytes"])

    def _ends(self) -> list[tuple[str, str]]:
        """(namespace, device) of both ends of every link: a qdisc shapes what leaves its end."""
        return [end for node, ns in enumerate(self.ns, 1) for end in ((ns, "eth0"), (self.switch, self.port(node)))]

    def shape(self, rate: str, burst: str = "32kbit", latency: str = "50ms") -> None:
        """A token bucket on every link, both ways (the node's egress and the bridge port's, its ingress).
        ``latency`` only bounds how long a packet may queue in the bucket: this kernel has no netem to delay."""
        for where, dev in self._ends():
            subprocess.run(["tc", "-n", where, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                            "burst", burst, "latency", latency], check=True, capture_output=True)

    def shape_node(self, node: int, up: str | None, down: str | None, burst: str = "64kbit",
                   latency: str = "1s") -> None:
        """Node ``node``'s own link: ``up`` on what it sends (its end's egress), ``down`` on what it receives (the
        bridge port's egress); None leaves that way unshaped. A long ``latency`` (the bucket's queue) keeps TCP
        from losing packets, so a flow runs at the rate rather than backing off."""
        for where, dev, rate in ((self.ns[node - 1], "eth0", up), (self.switch, self.port(node), down)):
            subprocess.run(["tc", "-n", where, "qdisc", "del", "dev", dev, "root"], capture_output=True)
            if rate is not None:
                subprocess.run(["tc", "-n", where, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                                "burst", burst, "latency", latency], check=True, capture_output=True)

    def unshape(self) -> None:
        for where, dev in self._ends():
            subprocess.run(["tc", "-n", where, "qdisc", "del", "dev", dev, "root"], check=True, capture_output=True)

    def cut(self, node: int) -> None:
        """Pull node ``node``'s cable: its bridge port goes down and nothing crosses it any more."""
        _ip("-n", self.switch, "link", "set", self.port(node), "down")

    def on(self, node: int, cmd: list[str]) -> list[str]:
        """``cmd`` as run on node ``node``, under its own hostname."""
        return inside(self.ns[node - 1], f"node{node}", cmd)

    def mpirun(self, hosts: list[int], cmd: list[str]) -> list[str]:
        """``mpirun`` on node 1 with one rank on each of ``hosts`` (in rank order), over TCP only."""
        return self.on(1, [*mpirun_cmd(len(hosts)), "--host", ",".join(self.addr[h - 1] for h in hosts),
                           "--map-by", "node", *cmd])

    def env(self) -> dict[str, str]:
        """Open MPI's settings for these nodes: TCP on the nodes' subnet only (no shared memory between
        nodes, no loopback), daemons started by the agent, and a bounded wait for a node that is gone."""
        env = mpi_env()
        subnet = f"{SUBNET}.0/24"
        env.update(OMPI_MCA_btl="tcp,self", OMPI_MCA_btl_tcp_if_include=subnet, OMPI_MCA_oob_tcp_if_include=subnet,
                   PRTE_MCA_oob_tcp_if_include=subnet, PRTE_MCA_plm_ssh_agent=str(self.agent))
        env.update({f"PRTE_MCA_oob_tcp_keepalive_{k}": v for k, v in KEEPALIVE.items()})
        return env

    def run(self, hosts: list[int], cmd: list[str], timeout: float = HANG_S) -> subprocess.CompletedProcess:
        return subprocess.run(self.mpirun(hosts, cmd), capture_output=True, text=True, timeout=timeout,
                              env=self.env(), cwd=REPO)


def _remove(names: list[str]) -> None:
    """Delete namespaces (their links and bridge go with them) after ending what still runs in them: the
    processes of the jobs these tests started, found by id."""
    for ns in names:
        pids = _ip("netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        _ip("netns", "delete", ns, check=False)


def _stale() -> list[str]:
    """Namespaces left by an earlier session of these tests that died before its teardown."""
    out = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        owner = name[len("mpifl"):].split("x")[0]
        if name.startswith("mpifl") and owner.isdigit() and not Path(f"/proc/{owner}").exists():
            out.append(name)
    return out


def make_nodes(count: int, where: Path) -> Iterator[Nodes]:
    """Set up ``count`` nodes (the agent script goes to ``where``), yield them, and remove them however the
    caller ends: a generator for fixtures."""
    if os.geteuid() != 0:
        pytest.skip("namespace nodes need root (ip netns, veth, unshare --uts)")
    if shutil.which("ip") is None or shutil.which("unshare") is None or shutil.which("tc") is None:
        pytest.skip("namespace nodes need ip, tc and unshare (iproute2, util-linux)")
    _remove(_stale())
    prefix = f"mpifl{os.getpid()}x{next(SERIAL)}"
    switch = f"{prefix}-sw"
    nodes = Nodes([f"{prefix}-n{i}" for i in range(1, count + 1)], [f"{SUBNET}.{i}" for i in range(1, count + 1)],
                  switch, where / "agent.sh")
    try:
        probe = _ip("netns", "add", switch, check=False)
        if probe.returncode != 0:
            pytest.skip(f"ip netns add failed: {probe.stderr.strip()}")
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        _ip("-n", switch, "link", "set", "lo", "up")
        for node, (ns, addr) in enumerate(zip(nodes.ns, nodes.addr), 1):
            _ip("netns", "add", ns)
            port = nodes.port(node)
            _ip("-n", switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        cases = "\n".join(f"  {a}) ns={ns}; name=node{i};;" for i, (ns, a) in enumerate(zip(nodes.ns, nodes.addr), 1))
        nodes.agent.write_text(AGENT.format(cases=cases))
        nodes.agent.chmod(0o755)
        yield nodes
    finally:
        _remove([*nodes.ns, switch])
