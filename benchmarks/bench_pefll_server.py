"""PeFLL's and pFedHN's server cost per round vs clients per round, on the CPU or a GPU (server.device).

    python benchmarks/bench_pefll_server.py [--algorithms pefll pfedhn] [--clients-per-round 5 25 50]
                                            [--server-devices cpu cuda] [--device cpu|cuda] [--num-clients N]
                                            [--rounds 10] [--set KEY=VALUE ...] [--write]

Workload: configs/pefll_digits.yaml (LeNet client model, CNN embedding net φ with label planes, l = 13,
hypernetwork 13→100→100→100→100→d, Adam) with 100 clients (90 seen; more when the largest c needs them:
``--num-clients`` or enough seen clients for it), run through the real CLI with P = 1 (`python -m mpifl run`,
in process), evaluation only after the last round. Per round PeFLL's server (rank 0) runs one hypernetwork
forward over the c stacked descriptors, one backward of all c Δθ_i at once (the VJP that gives Σ J_hᵀΔθ_i and
every Δv_i), averages the c Δη_v rows and takes one Adam step on η = (η_v, η_h); pFedHN's (the config's
``server_steps: per_client``) takes one step per client in turn. Reported: the median of the results file's
`rounds/server_time_s` (seconds rank 0 spent in the algorithm's payload() and consume(), i.e. without the
clients' local training) over rounds 2..R, per algorithm, ``server.device`` and c, its ratio to the smallest c
next to c/c₀ (what a per-client loop would cost at best), and with several server devices the first one's
seconds over each one's. The wall time per round, which at P = 1 includes the c clients' local training (on
``--device``), is shown for scale. With --write the table is appended to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import numpy as np
import yaml
from common import REPO, heading, mpifl_job, record

CONFIG = REPO / "configs" / "pefll_digits.yaml"
NUM_CLIENTS = 100


def clients_needed(clients_per_round: int) -> int:
    """The fewest clients whose seen ones (the config's unseen_fraction left out) fill a round of that size."""
    unseen = yaml.safe_load(CONFIG.read_text())["data"].get("unseen_fraction", 0.0)
    return max(NUM_CLIENTS, math.ceil(clients_per_round / (1 - unseen)) + 1)


def run(algorithm: str, server_device: str, clients_per_round: int, num_clients: int, args: argparse.Namespace,
        workdir: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    res = mpifl_job(CONFIG, 0, workdir / f"{algorithm}_{server_device}_c{clients_per_round}.h5", [
        f"algorithm={algorithm}", f"data.num_clients={num_clients}", f"clients_per_round={clients_per_round}",
        f"rounds={args.rounds}", f"eval_every={args.rounds}", f"device={args.device}",
        f"server.device={server_device}", *args.overrides])
    return res.table("rounds"), res.table("model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", nargs="+", choices=["pefll", "pfedhn"], default=["pefll"])
    parser.add_argument("--clients-per-round", type=int, nargs="+", default=[5, 25, 50])
    parser.add_argument("--server-devices", nargs="+", choices=["cpu", "cuda"], default=["cpu"])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the clients train")
    parser.add_argument("--num-clients", type=int, help="default: 100, or enough for the largest c")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="further config overrides, as mpifl run --set")
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    args.server_devices = list(dict.fromkeys(args.server_devices))
    num_clients = args.num_clients or clients_needed(max(args.clients_per_round))
    rows, sizes = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for algorithm in args.algorithms:
            for server_device in args.server_devices:
                for c in args.clients_per_round:
                    rounds, model = run(algorithm, server_device, c, num_clients, args, Path(tmp))
                    server = float(np.median(rounds["server_time_s"][1:]))
                    wall = float(np.median(rounds["wall_time_s"][1:]))
                    rows.append((algorithm, server_device, c, server, wall))
                    sizes[algorithm] = ", ".join(f"|{name}| = {value.size:,}" for name, value in model.items())
                    print(f"{algorithm} server.device={server_device} c={c}: server {server:.4f} s/round, "
                          f"wall {wall:.3f} s/round", flush=True)
    base_c = args.clients_per_round[0]
    seconds = {(a, d, c): s for a, d, c, s, _ in rows}
    first_device = args.server_devices[0]
    versus = len(args.server_devices) > 1
    record([
        heading(f"{' and '.join(args.algorithms)} server time vs clients per round, server.device "
                f"{' and '.join(args.server_devices)}"),
        "",
        f"`python benchmarks/bench_pefll_server.py --algorithms {' '.join(args.algorithms)} --clients-per-round "
        f"{' '.join(map(str, args.clients_per_round))} --server-devices {' '.join(args.server_devices)} "
        f"--device {args.device} --rounds {args.rounds}" + "".join(f" --set {o}" for o in args.overrides) + "`",
        "",
        f"configs/pefll_digits.yaml with {num_clients} clients, P = 1, clients on {args.device}; server state: "
        + "; ".join(f"{a} {s}" for a, s in sizes.items()) + f". Medians over rounds 2..{args.rounds}.",
        "",
        f"| algorithm | server.device | clients per round c | median server s/round | server ms per client | "
        f"ratio to c={base_c} | c/{base_c} | " + (f"{first_device} ÷ this | " if versus else "")
        + "wall s/round (incl. local training) |",
        "|---|---|---|---|---|---|---|" + ("---|" if versus else "") + "---|",
        *(f"| {a} | {d} | {c} | {s:.4f} | {1e3 * s / c:.2f} | {s / seconds[a, d, base_c]:.2f}× | {c / base_c:g}× | "
          + (f"{seconds[a, first_device, c] / s:.2f}× | " if versus else "") + f"{w:.3f} |"
          for a, d, c, s, w in rows),
    ], args.write)


if __name__ == "__main__":
    main()
