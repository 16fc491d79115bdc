"""Markdown table of results files: final and last-N-evaluation mean pooled test accuracy per evaluated
model kind, and logical training bytes (up + down) per client.

Usage: python scripts/evidence_table.py [--last N] results/evidence/*.h5     (N = 5 by default)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from mpifl.report import logical_totals
from mpifl.results import read_results


def row(path: str, last: int) -> str:
    res = read_results(path)
    ev = res.table("eval")
    cells = [Path(path).stem, str(res.attrs["algorithm"])]
    for kind in ("global", "personal"):
        acc = ev.get(f"{kind}.seen.acc_pooled")
        cells.append("–" if acc is None else f"{acc[-1]:.4f} ({np.mean(acc[-last:]):.4f})")
    train = logical_totals(res).get("train", {})
    total = sum(sum(by_msg.values()) for by_msg in train.values())
    cells.append(f"{total / res.table('clients')['client'].size / 1e6:.1f}")
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--last", type=int, default=5, help="evaluations averaged in brackets")
    parser.add_argument("paths", nargs="+")
    args = parser.parse_args(argv)
    print(f"| run | algorithm | global acc: final (last-{args.last} mean) | personal acc: final "
          f"(last-{args.last} mean) | logical train MB per client |")
    print("|---|---|---|---|---|")
    for path in args.paths:
        print(row(path, args.last))


if __name__ == "__main__":
    main()
