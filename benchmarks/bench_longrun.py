"""Long runs: does a round cost the same at round 10,000 as at round 1, and how much of rank 0's loop is the
results file? (Issue 15, target 1.)

    python benchmarks/bench_longrun.py [--rounds 10000] [--ranks 3] [--write]

Runs configs/quickstart.yaml's data (digits, 20 clients, 6 per round) with a logistic model, evaluating every
round (so the results file is written every round), under ``mpirun -n RANKS`` with ``--profile``. Reported,
from the results file: rank 0's median loop time per round (training, evaluation and the results write,
from the profile table) over the first and the last 100 rounds and their ratio (target ≤ 1.05), the same for
each part of that time (so a slowdown can be told from a machine whose load changed), and rank 0's
``io_seconds`` as a share of its loop's wall time (target ≤ 5%), with the file's size and its ledger rows.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from common import REPO, heading, mpifl_job, record

CONFIG = REPO / "configs" / "quickstart.yaml"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10_000)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--write", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "longrun.h5"
        res = mpifl_job(CONFIG, args.ranks, out, ["model.name=logistic", f"rounds={args.rounds}", "eval_every=1"],
                        ["--profile"])
        size = out.stat().st_size
    profile, ranks = res.table("profile"), res.table("ranks")
    parts = rank_parts(profile, 0)
    first, last = float(np.median(parts["wall"][:100])), float(np.median(parts["wall"][-100:]))
    io, loop = float(ranks["io_seconds"][0]), float(ranks["loop_wall_seconds"][0])
    rows = [f"| median {name} ms/round, first 100 → last 100 | {1e3 * np.median(v[:100]):.2f} → "
            f"{1e3 * np.median(v[-100:]):.2f} | |" for name, v in parts.items() if name != "wall" and v.any()]
    record([
        "",
        heading(f"Long run: {args.rounds:,} rounds, evaluation every round"),
        "",
        f"`python benchmarks/bench_longrun.py --rounds {args.rounds} --ranks {args.ranks}`",
        "",
        f"configs/quickstart.yaml with model.name=logistic, eval_every=1, {args.ranks} ranks, --profile; "
        f"results file {size / 1e6:.1f} MB, {len(res.table('ledger')['round']):,} ledger rows.",
        "",
        "| rank 0 | value | target |",
        "|---|---|---|",
        f"| median loop s/round, rounds 1–100 | {first * 1e3:.2f} ms | |",
        f"| median loop s/round, last 100 rounds | {last * 1e3:.2f} ms | |",
        f"| last ÷ first | {last / first:.3f} | ≤ 1.05 |",
        *rows,
        f"| results-file I/O ÷ loop wall | {io:.2f} s ÷ {loop:.1f} s = {100 * io / loop:.2f}% | ≤ 5% |",
        "",
        "Every rank, median ms/round over the first 100 → the last 100 rounds (a worker that slows down shows",
        "here as rank 0's MPI wait):",
        "",
        "| rank | loop | compute | eval | mpi |",
        "|---|---|---|---|---|",
        *(worker_row(rank, rank_parts(profile, rank)) for rank in range(args.ranks)),
    ], args.write)


def rank_parts(profile: dict[str, np.ndarray], rank: int) -> dict[str, np.ndarray]:
    """One rank's per-round seconds of each profiled part (``wall`` is its whole loop), in round order."""
    mine = profile["rank"] == rank
    order = np.argsort(profile["round"][mine])
    return {k.removesuffix("_seconds"): profile[k][mine][order] for k in profile if k.endswith("_seconds")}


def worker_row(rank: int, parts: dict[str, np.ndarray]) -> str:
    cells = (f"{1e3 * np.median(parts[name][:100]):.2f} → {1e3 * np.median(parts[name][-100:]):.2f}"
             for name in ("wall", "compute", "eval", "mpi"))
    return f"| {rank} | {' | '.join(cells)} |"


if __name__ == "__main__":
    main()
