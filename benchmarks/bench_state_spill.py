"""What spilling client state to disk costs per round. (Issue 15, target 4.)

    python benchmarks/bench_state_spill.py [--clients 600] [--rounds 20] [--write]

FedDeper on tabular Gaussian data (60 features, 16 samples per client), an MLP 60-480-440-10, so each client's
personal model is 0.98 MB; 100 clients per round on 3 ranks, so after the first rounds each worker holds a few
hundred MB of state. Run twice: all state in memory, and with ``state_memory_gb`` set to half of the state a
worker ends with (2× the budget: about half of each round's clients are read back from disk and as many
written out). Reported: the median seconds per round over the second half of the rounds, when the state has
outgrown the budget, of each run and their ratio, with each worker's states spilled and read back; the two
runs' results are checked to be bitwise the same.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from common import REPO, heading, mpifl_job, record

CONFIG = REPO / "configs" / "b1.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    base = ["algorithm=feddeper", f"data.num_clients={args.clients}", "data.partition=iid", "clients_per_round=100",
            "data.synthetic.image_shape=[60]", "data.synthetic.samples_per_client=16", "model.name=mlp",
            "model.hidden=[480,440]", "client.steps=2", f"rounds={args.rounds}", f"eval_every={args.rounds}",
            "placement=static"]
    with tempfile.TemporaryDirectory() as tmp:
        memory = mpifl_job(CONFIG, 3, Path(tmp) / "memory.h5", base)
        state = 4 * memory.table("model")["global_model"].size * args.clients / 2  # per worker, every client trained
        budget_gb = state / 2 / 2**30
        disk = mpifl_job(CONFIG, 3, Path(tmp) / "disk.h5", [*base, f"state_memory_gb={budget_gb}"])
    assert np.array_equal(memory.table("model")["global_model"], disk.table("model")["global_model"])
    half = args.rounds // 2
    median = {name: float(np.median(res.table("rounds")["wall_time_s"][half:])) for name, res in
              (("memory", memory), ("disk", disk))}
    ranks = disk.table("ranks")
    record([
        "",
        heading("Client state spilled to disk: FedDeper"),
        "",
        f"`python benchmarks/bench_state_spill.py --clients {args.clients} --rounds {args.rounds}`: each worker's "
        f"state up to {state / 2**20:,.0f} MiB, budget {budget_gb * 1024:,.0f} MiB per rank (2× over it); results "
        "bitwise the same.",
        "",
        f"| state | median s/round, rounds {half + 1}–{args.rounds} | states spilled / read back (workers) |",
        "|---|---|---|",
        f"| in memory | {median['memory']:.3f} | |",
        f"| budget = half the state | {median['disk']:.3f} | "
        f"{' + '.join(map(str, ranks['states_spilled'][1:]))} / {' + '.join(map(str, ranks['states_reloaded'][1:]))} |",
        f"| ratio | {median['disk'] / median['memory']:.2f}× | |",
    ], args.write)


if __name__ == "__main__":
    main()
