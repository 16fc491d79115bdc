"""PeFLL server cost per round vs clients per round: the server's per-client work is batched.

    python benchmarks/bench_pefll_server.py [--clients-per-round 5 25 50] [--rounds 10] [--write]

Workload: configs/pefll_digits.yaml (LeNet client model, CNN embedding net φ with label planes, l = 13,
hypernetwork 13→100→100→100→100→d, Adam) with 100 clients (90 seen), run through the real CLI with P = 1
(`python -m mpifl run`, in process), evaluation only after the last round. Per round the server (rank 0)
runs one hypernetwork forward over the c stacked descriptors, one backward of all c Δθ_i at once (the
VJP that gives Σ J_hᵀΔθ_i and every Δv_i), averages the c Δη_v rows and takes one Adam step on
η = (η_v, η_h). Reported: the median of the results file's `rounds/server_time_s` (seconds rank 0 spent
in the algorithm's payload() and consume(), i.e. without the clients' local training) over rounds
2..R, per c, and its ratio to c = 5 next to c/5 (what a per-client loop would cost at best). The wall
time per round, which at P = 1 includes the c clients' local training, is shown for scale. With --write
the table is appended to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from common import REPO, heading, mpifl_job, record

CONFIG = REPO / "configs" / "pefll_digits.yaml"
NUM_CLIENTS = 100


def run(clients_per_round: int, rounds: int, workdir: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    res = mpifl_job(CONFIG, 1, workdir / f"pefll_c{clients_per_round}.h5", [
        f"data.num_clients={NUM_CLIENTS}", f"clients_per_round={clients_per_round}", f"rounds={rounds}",
        f"eval_every={rounds}"])
    return res.table("rounds"), res.table("model")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients-per-round", type=int, nargs="+", default=[5, 25, 50])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for c in args.clients_per_round:
            rounds, model = run(c, args.rounds, Path(tmp))
            server = float(np.median(rounds["server_time_s"][1:]))
            wall = float(np.median(rounds["wall_time_s"][1:]))
            rows.append((c, server, wall))
            print(f"c={c}: server {server:.4f} s/round, wall {wall:.3f} s/round", flush=True)
    base_c, base = rows[0][0], rows[0][1]
    record([
        heading("PeFLL server time vs clients per round"),
        "",
        f"`python benchmarks/bench_pefll_server.py --clients-per-round "
        f"{' '.join(map(str, args.clients_per_round))} --rounds {args.rounds}`",
        "",
        f"configs/pefll_digits.yaml with {NUM_CLIENTS} clients, P = 1; server: |η_v| = {model['embed_net'].size:,}, "
        f"|η_h| = {model['hypernetwork'].size:,} parameters (Adam). Medians over rounds 2..{args.rounds}.",
        "",
        f"| clients per round c | median server s/round | server ms per client | ratio to c={base_c} | "
        f"c/{base_c} | wall s/round (incl. local training) |",
        "|---|---|---|---|---|---|",
        *(f"| {c} | {s:.4f} | {1e3 * s / c:.2f} | {s / base:.2f}× | {c / base_c:.0f}× | {w:.3f} |"
          for c, s, w in rows),
    ], args.write)


if __name__ == "__main__":
    main()
