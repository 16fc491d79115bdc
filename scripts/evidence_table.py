"""Markdown table of results files: final and last-5-evaluation mean pooled test accuracy per evaluated
model kind, and logical training bytes (up + down) per client.

Usage: python scripts/evidence_table.py results/evidence/*.h5
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from mpifl.report import logical_totals
from mpifl.results import read_results


def row(path: str) -> str:
    res = read_results(path)
    ev = res.table("eval")
    cells = [Path(path).stem, str(res.attrs["algorithm"])]
    for kind in ("global", "personal"):
        acc = ev.get(f"{kind}.seen.acc_pooled")
        cells.append("–" if acc is None else f"{acc[-1]:.4f} ({np.mean(acc[-5:]):.4f})")
    train = logical_totals(res).get("train", {})
    total = sum(sum(by_msg.values()) for by_msg in train.values())
    cells.append(f"{total / res.table('clients')['client'].size / 1e6:.1f}")
    return "| " + " | ".join(cells) + " |"


def main(paths: list[str]) -> None:
    print("| run | algorithm | global acc: final (last-5 mean) | personal acc: final (last-5 mean) "
          "| logical train MB per client |")
    print("|---|---|---|---|---|")
    for path in paths:
        print(row(path))


if __name__ == "__main__":
    main(sys.argv[1:])
