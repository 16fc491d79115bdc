"""How close is mpifl's simulated round time to a real network with the same links? (Issue 18.)

    sudo python benchmarks/bench_netmodel.py [--cohorts 2 4 6] [--rounds 5] [--write]

Namespace nodes (tests/multinode/netns.py: one network namespace per node, veth links to a bridge, Open MPI
over TCP between them): the server on node 1 and one worker rank per other node, each hosting exactly one
client, all of them in every round. Each worker's link is shaped with a token bucket (tc tbf) to its client's
bandwidth in the network model (``up_mbps`` what it sends, ``down_mbps`` what it receives), and the server's
link to ``server_up_mbps``/``server_down_mbps`` when the model has them. The model is an MLP of about 0.76 MB,
so a round's time is its transfers: one local step, no latency in the model (this kernel has no netem and a
token bucket adds no propagation delay), ``compute: model`` with no seconds per sample.

Open MPI's non-blocking broadcast is a tree by default (workers forward the model to each other), while the
model sends it from the server to every client; the runs here use the linear broadcast
(``coll_libnbc_ibcast_algorithm=1``), so the server really sends every copy. Measured is rank 0's
``wall_time_s`` of each training round (from sampling to the last telemetry row), median over all rounds but
the first; simulated is the round's ``sim_time_s``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from common import REPO, heading, record

sys.path.insert(0, str(REPO))
from tests.multinode.netmodel import CLIENT_MBPS, SERVER_MBPS, measure  # noqa: E402
from tests.multinode.netns import make_nodes  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cohorts", type=int, nargs="+", default=[2, 4, 6])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--broadcast", choices=("linear", "tree"), default="linear",
                        help="Open MPI's non-blocking broadcast: linear (the model's) or its default tree")
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench_netmodel: needs root (network namespaces, tc)", file=sys.stderr)
        raise SystemExit(2)
    rows = []
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        setup = make_nodes(max(args.cohorts) + 1, Path(tmp))
        nodes = next(setup)
        try:
            for workers in args.cohorts:
                for server_mbps in (None, SERVER_MBPS):
                    measured, simulated = measure(nodes, workers, args.rounds, server_mbps, Path(tmp), args.broadcast)
                    link = "none (unshaped)" if server_mbps is None else f"{server_mbps:g} Mbit/s"
                    rows.append(f"| {workers} | {link} | {measured:.3f} | {simulated:.3f} | "
                                f"{100 * (measured - simulated) / simulated:+.1f}% |")
                    print(rows[-1], flush=True)
        finally:
            setup.close()
    record([
        "",
        heading("Simulated round time against shaped namespace links"),
        "",
        f"`sudo python benchmarks/bench_netmodel.py --cohorts {' '.join(map(str, args.cohorts))} "
        f"--rounds {args.rounds} --broadcast {args.broadcast}` (load average {load:.2f} at the start)",
        "",
        f"FedAvg, an MLP of 0.76 MB, one client per worker node, every client's link {CLIENT_MBPS:g} Mbit/s each "
        f"way (tc tbf), the server's as in the column, {args.broadcast} MPI broadcast; median over rounds "
        f"2–{args.rounds}.",
        "",
        "| clients | server link | measured s/round | sim_time_s | error |",
        "|---|---|---|---|---|",
        *rows,
    ], args.write)


if __name__ == "__main__":
    main()
