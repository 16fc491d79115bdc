"""One mpifl job per worker count on namespace nodes whose links are shaped as its network model says, to
compare the measured round time with ``sim_time_s`` (benchmarks/bench_netmodel.py, test_netmodel.py)."""

from __future__ import annotations

import statistics
import subprocess
import sys
from pathlib import Path

import yaml

from mpifl.results import read_results
from tests.conftest import REPO
from tests.multinode.netns import Nodes

CLIENT_MBPS = 16.0
SERVER_MBPS = 16.0  # with more than one client it binds: every client's copy crosses it


def config(workers: int, rounds: int, server_mbps: float | None) -> dict:
    return {
        "algorithm": "fedavg", "rounds": rounds, "eval_every": rounds, "clients_per_round": workers, "seed": 0,
        "data": {"dataset": "digits", "num_clients": workers, "partition": "iid", "unseen_fraction": 0.0},
        "model": {"name": "mlp", "hidden": [400, 400]},
        "client": {"steps": 1, "batch_size": 16, "lr": 0.01},
        "network": {"latency_s": 0.0, "up_mbps": CLIENT_MBPS, "down_mbps": CLIENT_MBPS, "compute": "model",
                    "seconds_per_sample": 0.0, "server_up_mbps": server_mbps, "server_down_mbps": server_mbps},
    }


def round_times(nodes: Nodes, workers: int, rounds: int, server_mbps: float | None, tmp: Path, broadcast: str,
                shaped: bool = True) -> tuple[list[float], float]:
    """Measured seconds of rounds 2.. of one job on ``workers`` worker nodes (round 1 also sets up), and the
    simulated seconds per round. ``shaped=False`` leaves every link unshaped: what a round costs apart from
    its network, on this machine as loaded as it is now."""
    rate = f"{CLIENT_MBPS}mbit" if shaped else None
    for node in range(2, workers + 2):
        nodes.shape_node(node, rate, rate)
    server = None if server_mbps is None or not shaped else f"{server_mbps}mbit"
    nodes.shape_node(1, server, server)
    name = f"w{workers}_s{server_mbps}" + ("" if shaped else "_unshaped")
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config(workers, rounds, server_mbps)))
    out = tmp / f"{name}.h5"
    # linear: the server sends every copy (the model's broadcast); tree: Open MPI's default choice
    env = {**nodes.env(), "OMPI_MCA_coll_libnbc_ibcast_algorithm": "1" if broadcast == "linear" else "0"}
    job = [sys.executable, "-m", "mpifl", "run", str(path), "--out", str(out), "--quiet"]
    proc = subprocess.run(nodes.mpirun(list(range(1, workers + 2)), job), capture_output=True, text=True,
                          timeout=600, env=env, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"the job on {workers} worker nodes failed: {proc.stderr[-2000:]}")
    results = read_results(out)
    owners = results.table("clients")["owner"]
    assert sorted(owners.tolist()) == list(range(1, workers + 1)), "each worker must host exactly one client"
    rounds_table = results.table("rounds")
    return rounds_table["wall_time_s"][1:].tolist(), statistics.median(rounds_table["sim_time_s"][1:].tolist())


def measure(nodes: Nodes, workers: int, rounds: int, server_mbps: float | None, tmp: Path,
            broadcast: str) -> tuple[float, float]:
    """Median measured and simulated seconds per round (rounds 2..) of one job on ``workers`` worker nodes."""
    measured, simulated = round_times(nodes, workers, rounds, server_mbps, tmp, broadcast)
    return statistics.median(measured), simulated
