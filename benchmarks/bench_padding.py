"""Padded work of the batched executor's call shapes: rows computed per real client row when a round's cohort is
spread evenly over 1, 2 and 4 worker ranks, each rank's clients in calls of exactly ``chunk`` rows, and the
calls a local step makes on the busiest worker (each call is one vmapped gradient's launches on a GPU).

    python benchmarks/bench_padding.py [--cohort 50 1000]

Pure arithmetic (no training): the executor pads every call to the chunk (``mpifl.training.executor._padded``),
so these are the rows it computes. ``auto`` is ``client.vectorize_chunk: auto`` on a GPU (``auto_chunk``).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpifl.training.vectorizing import WORKER_COUNTS, auto_chunk, padded_work  # noqa: E402

OPTIONS = (64, 32, 16, 13, 8, 7, 5, 4)


def table(cohort: int) -> list[str]:
    auto = auto_chunk(cohort, torch.device("cuda"))
    lines = [f"cohort {cohort} (auto: {auto})", "",
             "| chunk | " + " | ".join(f"{w} worker{'s' if w > 1 else ''}" for w in WORKER_COUNTS)
             + " | calls a step, 1 / 4 workers |", "|---|" + "---|" * (len(WORKER_COUNTS) + 1)]
    for chunk in sorted({*OPTIONS, auto}, reverse=True):
        cells = " | ".join(f"{padded_work(cohort, w, chunk):.2f}×" for w in WORKER_COUNTS)
        calls = f"{math.ceil(cohort / chunk)} / {math.ceil(math.ceil(cohort / 4) / chunk)}"
        lines.append(f"| {chunk}{' (auto)' if chunk == auto else ''} | {cells} | {calls} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cohort", type=int, nargs="+", default=[50, 1000], help="clients per round")
    for cohort in parser.parse_args(argv).cohort:
        print("\n".join(table(cohort)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
