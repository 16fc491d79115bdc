"""PeFLL's margin on unseen clients over training (issue 36; docs/papers/pefll.md, "5× longer"): the table.

    python scripts/pefll_horizon.py results/evidence/pefll_500 [--rounds 50 100 200 300 400 500]

Reads the sweep's completed results files (``configs/evidence/pefll_500.yaml``: ``VARIANT,...,seed=S.h5``) and
prints, at each of ``--rounds`` (evaluation rounds), PeFLL's pooled unseen-client test accuracy as mean ± 2·SE over
seeds, and its margin over every other method in points: PeFLL's accuracy minus the method's on the same seed,
then mean ± 2·SE over the seeds both ran. A method's accuracy is that of the model it evaluates (its personal
models, else its global model, as ``mpifl report``). The per-method tables at the best-validation round come
from ``mpifl report DIR --select best-val``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from mpifl.report.seeds import mean_2se
from mpifl.results.reading import read_results

REFERENCE = "pefll"


def unseen_curves(folder: Path) -> dict[str, dict[int, dict[int, float]]]:
    """Each variant's completed runs: seed → {evaluation round: unseen pooled test accuracy}."""
    out: dict[str, dict[int, dict[int, float]]] = {}
    for path in sorted(folder.glob("*.h5")):
        res = read_results(path, ledger=False)
        if res.attrs.get("status") != "completed":
            continue
        ev = res.table("eval")
        kind = "personal" if "personal.unseen.acc_pooled" in ev else "global"
        out.setdefault(path.stem.split(",")[0], {})[int(res.config["seed"])] = dict(
            zip(map(int, ev["round"]), map(float, ev[f"{kind}.unseen.acc_pooled"]), strict=True))
    return out


def cell(values: list[float], digits: int, signed: bool = False) -> str:
    mean, two_se = mean_2se(np.asarray(values))
    shown = f"{mean:{'+' if signed else ''}.{digits}f}"
    return f"{shown} ± {two_se:.{digits}f}" if np.isfinite(two_se) else shown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--rounds", type=int, nargs="+", default=[50, 100, 200, 300, 400, 500])
    args = parser.parse_args()
    curves = unseen_curves(args.folder)
    if REFERENCE not in curves:
        raise SystemExit(f"pefll_horizon: no completed {REFERENCE} run in {args.folder}")
    pefll = curves.pop(REFERENCE)
    print("| unseen, round | " + " | ".join(map(str, args.rounds)) + " |")
    print("|---" * (len(args.rounds) + 1) + "|")
    print(f"| PeFLL ({len(pefll)} seeds) | " + " | ".join(
        cell([runs[r] for runs in pefll.values()], 4) for r in args.rounds) + " |")
    for name, runs in curves.items():
        seeds = sorted(set(pefll) & set(runs))
        margins = [cell([100 * (pefll[s][r] - runs[s][r]) for s in seeds], 1, signed=True) for r in args.rounds]
        print(f"| PeFLL − {name} ({len(seeds)} seeds) | " + " | ".join(margins) + " |")


if __name__ == "__main__":
    main()
