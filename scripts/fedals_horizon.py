"""FedALS against FedAvg at the paper's horizon (issue 36; docs/papers/fedals_feddeper.md): the table and the plot.

    python scripts/fedals_horizon.py results/evidence/fedals_20k [-o docs/papers/fedals_20k.png]

Reads the sweep's results files (``configs/evidence/fedals_20k.yaml``: FedAvg as α = 1 and FedALS α = 10, seeds
0-2) and prints, per method: the paper's metric (the mean of the last 10 evaluations, i.e. the last 1,000 local
steps) as mean ± 2·SE over seeds, the same over each quarter of training (5,000 steps), the training bytes, and
FedAvg's accuracy when it had sent as many bytes as FedALS's whole run. The plot: accuracy (mean over seeds)
against local steps and against training bytes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from mpifl.results.reading import read_results

TAU = 5  # local steps a round (fedals.tau)
LAST = 10  # the paper's metric: the mean of the last 10 evaluations


def runs(folder: Path) -> dict[str, list[dict[str, np.ndarray]]]:
    """Each method's completed runs: evaluation rounds, accuracy and cumulative training bytes."""
    out: dict[str, list[dict[str, np.ndarray]]] = {}
    for path in sorted(folder.glob("*.h5")):
        res = read_results(path, ledger=False)
        if res.attrs.get("status") != "completed":
            continue
        ev = res.table("eval")
        rounds = res.table("rounds")
        train = np.cumsum(rounds["logical_up_bytes"] + rounds["logical_down_bytes"])
        out.setdefault(path.stem.split(",")[0], []).append(
            {"steps": ev["round"] * TAU, "acc": ev["global.seen.acc_pooled"], "bytes": train[ev["round"] - 1]})
    return out


def spread(values: list[float]) -> str:
    v = np.asarray(values)
    se = v.std(ddof=1) / np.sqrt(len(v)) if len(v) > 1 else float("nan")
    return f"{v.mean():.4f} ± {2 * se:.4f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("-o", "--plot", type=Path)
    args = parser.parse_args()
    methods = runs(args.folder)
    print("| method | seeds | last-10 mean (steps 19,100-20,000) | quarters 1 / 2 / 3 / 4 (mean accuracy) | "
          "train MB (all clients, up + down) |")
    print("|---|---|---|---|---|")
    for name, seeds in methods.items():
        last = [float(r["acc"][-LAST:].mean()) for r in seeds]
        quarters = [np.mean([r["acc"][q * len(r["acc"]) // 4 : (q + 1) * len(r["acc"]) // 4].mean() for r in seeds])
                    for q in range(4)]
        print(f"| {name} | {len(seeds)} | {spread(last)} | {' / '.join(f'{q:.3f}' for q in quarters)} | "
              f"{seeds[0]['bytes'][-1] / 1e6:,.0f} |")
    if "fedavg" in methods and "fedals_a10" in methods:
        budget = methods["fedals_a10"][0]["bytes"][-1]
        at = [float(r["acc"][np.searchsorted(r["bytes"], budget, side="right") - 1]) for r in methods["fedavg"]]
        print(f"\nFedAvg at FedALS α = 10's whole-run bytes ({budget / 1e6:,.0f} MB): {spread(at)}")
        gap = [a["acc"][-LAST:].mean() - b["acc"][-LAST:].mean()
               for a, b in zip(methods["fedavg"], methods["fedals_a10"])]
        print(f"FedAvg − FedALS α = 10, last-10 mean, per seed: {', '.join(f'{g * 100:.2f}' for g in gap)} points")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for name, seeds in methods.items():
            acc = np.mean([r["acc"] for r in seeds], axis=0)
            axes[0].plot(seeds[0]["steps"], acc, label=f"{name} ({len(seeds)} seeds)")
            axes[1].plot(seeds[0]["bytes"] / 1e6, acc, label=name)
        axes[0].set(xlabel="local steps", ylabel="test accuracy (mean over seeds)", ylim=(0.6, 0.92))
        axes[1].set(xlabel="training MB (all clients, up + down)", xscale="log", ylim=(0.6, 0.92))
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.legend()
        fig.suptitle("FedALS α = 10 vs FedAvg, Fashion-MNIST, K = 5 (2 classes each), τ = 5, T = 20,000")
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"\nplot: {args.plot}")


if __name__ == "__main__":
    main()
