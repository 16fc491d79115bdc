"""Karula's Table 1(a) (karula.md §5.2): synthetic ridge regression, six strategies, mean ± 2·SE over seeds.

For every repeat (seed) each strategy runs through mpifl's own runtime, in process (``Engine`` on
``MPI.COMM_SELF``), on ``configs/karula_ridge.yaml``. Karula's t (and, with ``--cv-baselines``, pFedMe's λ
and IFCA's number of clusters) is chosen by K-fold cross-validation on the clients' *training* rows, as
the paper does: fold k of every client's training rows is held out, the strategy trains on the rest, and
the candidate with the lowest pooled held-out MSE over the K folds wins; the test rows are never used for
the choice. The winner is then trained on all training rows and scored on the test rows.

Scores per strategy: estimation error = mean over clients of ‖θ̂_i − θ_i^true‖² (weights and the bias,
whose true value is 0), read from each client's final evaluated model; test R² pooled over all clients'
test rows, and the mean of per-client R², both from the runtime's own evaluation.

    python benchmarks/karula_table1.py                 # defaults: 3 repeats, 300 rounds, 5 folds
    python benchmarks/karula_table1.py --write         # also replace the table in docs/papers/karula.md
    python benchmarks/karula_table1.py --results results/evidence/karula   # score a sweep's results files

``--results DIR`` scores the runs an ``mpifl sweep`` left in DIR instead (configs/evidence/karula.yaml): the
estimation error of every strategy, which the runtime logs only for Karula, from each results file's final
state and checkpoint (so the runs need ``checkpoint_every`` = ``rounds``), squared or (``--error norm``) not;
mean ± 2·SE over seeds.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import re
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mpifl.algorithms.karula import estimation_errors  # noqa: E402
from mpifl.config import load_raw  # noqa: E402
from mpifl.data import ClientSplit, build_federated_dataset  # noqa: E402
from mpifl.data.base import FederatedDataset  # noqa: E402
from mpifl.models import FlatModel, build_model  # noqa: E402
from mpifl.registry import parse_config  # noqa: E402
from mpifl.results import Results, read_results  # noqa: E402
from mpifl.state_io import read_client_states  # noqa: E402

STRATEGIES = ("local", "fedsgd", "fedavg", "pfedme", "ifca", "karula")
LABELS = {"local": "Local", "fedsgd": "FedSGD", "fedavg": "FedAvg", "pfedme": "pFedMe", "ifca": "IFCA",
          "karula": "Karula"}
# Per-strategy overrides of the shared config (ours: the paper gives no baseline settings).
OVERRIDES = {
    "local": {},
    "fedsgd": {},
    "fedavg": {"client": {"steps": 5}},  # FedAvg = 5 local full-batch GD steps per round
    "pfedme": {"pfedme": {"lam": 15.0, "personal_lr": 0.005, "inner_steps": 5}},
    "ifca": {"ifca": {"clusters": 3}},
    "karula": {},
}
# Cross-validated option per strategy: (section, key, grid).
GRIDS = {
    "karula": ("karula", "t", (0.3, 1.0, 3.0)),
    "pfedme": ("pfedme", "lam", (1.0, 15.0)),
    "ifca": ("ifca", "clusters", (1, 3)),
}
PAPER = {  # Table 1(a) as printed: (estimation error, test R²), each (mean, 2·SE)
    "local": ((35.33, 2.729), (0.692, 0.108)), "fedsgd": ((7.60, 0.513), (0.839, 0.024)),
    "fedavg": ((7.47, 0.493), (0.846, 0.026)), "pfedme": ((31.65, 0.986), (0.768, 0.044)),
    "ifca": ((7.69, 0.509), (0.821, 0.024)), "karula": ((5.86, 0.204), (0.938, 0.009)),
}
TABLE_BEGIN, TABLE_END = "<!-- karula-table1:begin -->", "<!-- karula-table1:end -->"


# ------------------------------------------------------------------ cross-validation folds
def fold_rows(n: int, folds: int, fold: int, seed: int, client: int) -> np.ndarray:
    """Boolean mask of ``client``'s training rows held out in ``fold`` (of ``folds``): a permutation keyed
    by (seed, client) alone, cut into ``folds`` near-equal parts, so the K folds partition the rows and the
    same rows are held out whatever else runs."""
    if not 0 <= fold < folds <= n:
        raise ValueError(f"fold {fold} of {folds} for {n} rows")
    order = np.random.default_rng(np.random.SeedSequence([seed, client, 0x4346])).permutation(n)
    mask = np.zeros(n, dtype=bool)
    mask[np.array_split(order, folds)[fold]] = True
    return mask


class FoldDataset(FederatedDataset):
    """A view of ``base`` for one CV fold: training = training rows outside the fold, test = the fold."""

    def __init__(self, base: FederatedDataset, folds: int, fold: int, seed: int):
        self.base, self.folds, self.fold, self.seed = base, folds, fold, seed
        sizes = base.layout.train_sizes
        held = np.array([fold_rows(int(n), folds, fold, seed, c).sum() for c, n in enumerate(sizes)])
        self.layout = dataclasses.replace(base.layout, train_sizes=(sizes - held).astype(np.int64))

    def _load(self, client_ids: list[int]) -> dict[int, ClientSplit]:
        out = {}
        for c, split in self.base.load_clients(client_ids).items():
            held = fold_rows(len(split.x_train), self.folds, self.fold, self.seed, c)
            out[c] = ClientSplit(split.x_train[~held], split.y_train[~held], split.x_val, split.y_val,
                                 split.x_train[held], split.y_train[held])
        return out


# ------------------------------------------------------------------ one run through the runtime
def strategy_config(base: dict, strategy: str, seed: int, rounds: int, option: tuple[str, str, float] | None):
    raw = copy.deepcopy(base)
    karula = raw.pop("karula", {})
    # a checkpoint at the end keeps the clients' own models (Local, pFedMe) in the results file
    raw.update(algorithm=strategy, seed=seed, rounds=rounds, eval_every=rounds, checkpoint_every=rounds)
    for section, values in OVERRIDES[strategy].items():
        raw[section] = {**raw.get(section, {}), **values}
    if strategy == "karula":
        raw["karula"] = dict(karula)
    if option is not None:
        section, key, value = option
        raw[section] = {**raw.get(section, {}), key: value}
    return parse_config(raw)


@dataclasses.dataclass(frozen=True)
class Run:
    """What a run left in its results file: the tables, and each client's state at the end."""

    results: Results
    states: dict[int, dict[str, np.ndarray]]


def run_engine(cfg, dataset: FederatedDataset | None = None) -> Run:  # noqa: ANN001
    """Run ``cfg`` in this process (P = 1) and read its results file; ``dataset`` replaces the one the config
    would build (a CV fold view)."""
    from mpi4py import MPI

    from mpifl.runtime import engine as engine_module

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "run.h5"
        engine = engine_module.Engine(cfg, MPI.COMM_SELF, path)
        if dataset is None:
            engine.prepare()
        else:
            with mock.patch.object(engine_module, "build_federated_dataset", lambda *_: dataset):
                engine.prepare()
        engine.run(progress=False)
        states = {c: s for worker in read_client_states(path).values() for c, s in worker.items()}
        return Run(read_results(path), states)


def client_models(run: Run, cfg, dataset: FederatedDataset) -> np.ndarray:  # noqa: ANN001
    """Every client's final evaluated model as flat float64 rows (a linear model: weights, then the bias)."""
    n = dataset.layout.num_clients
    final = run.results.table("model")
    if cfg.algorithm == "karula":
        return np.asarray(final["personal_models"], dtype=np.float64)
    if cfg.algorithm == "ifca":  # each client's cluster: the one with the lowest loss on its training split
        clusters = np.asarray(final["cluster_models"], dtype=np.float64)
        splits = dataset.load_clients(range(n))
        losses = [[np.mean((s.x_train @ m[:-1] + m[-1] - s.y_train) ** 2) for m in clusters] for s in splits.values()]
        return clusters[np.argmin(losses, axis=1)]
    if cfg.algorithm in ("local", "pfedme"):  # their own models; a client that never trained keeps its start
        name = {"local": "model", "pfedme": "personal"}[cfg.algorithm]
        start = final["global_model"] if "global_model" in final else \
            FlatModel(build_model(cfg.model, dataset.layout, cfg.seed)).numpy()
        return np.stack([run.states.get(c, {}).get(name, start) for c in range(n)]).astype(np.float64)
    return np.tile(np.asarray(final["global_model"], dtype=np.float64), (n, 1))


def truth_of(dataset: FederatedDataset) -> np.ndarray:
    """θ_i^true followed by a zero bias: a linear model's flat (weight, bias) order."""
    truth = np.stack([dataset.true_parameters(c) for c in range(dataset.layout.num_clients)])
    return np.hstack([truth, np.zeros((len(truth), 1))])


def estimation_error(models: np.ndarray, truth: np.ndarray, kind: str = "squared") -> float:
    """Mean over clients of ‖θ̂_i − θ_i‖² (``squared``) or ‖θ̂_i − θ_i‖ (``norm``)."""
    return float(np.mean(estimation_errors(models, truth, kind)))


def score_directory(directory: Path, kind: str) -> str:
    """A markdown table of every strategy's estimation error (``kind``: squared or norm; Karula per t) over the
    sweep runs in ``directory``."""
    groups: dict[str, list[float]] = {}
    for path in sorted(directory.glob("*.h5")):
        results = read_results(path)
        cfg = parse_config(results.config)
        dataset = build_federated_dataset(cfg.data, cfg.seed)
        states = {}
        if cfg.algorithm in ("local", "pfedme"):  # their models live only in the clients' checkpointed states
            if cfg.checkpoint_every != cfg.rounds:
                raise SystemExit(f"{path}: {cfg.algorithm} needs checkpoint_every = rounds to be scored")
            states = {c: s for worker in read_client_states(path).values() for c, s in worker.items()}
        models = client_models(Run(results, states), cfg, dataset)
        label = LABELS[cfg.algorithm] + (f" t={cfg.algorithm_options.t:g}" if cfg.algorithm == "karula" else "")
        error = estimation_error(models, truth_of(dataset), kind)
        groups.setdefault(label, []).append(error)
    lines = ["| Strategy | seeds | Estimation error |", "|---|---|---|"]
    lines += [f"| {label} | {len(v)} | {'{:.2f} ± {:.2f}'.format(*mean_2se(v))} |" for label, v in groups.items()]
    return "\n".join(lines)


def scores(run: Run, cfg, dataset: FederatedDataset, truth: np.ndarray) -> dict[str, float]:  # noqa: ANN001
    kind = run.results.attrs["eval_kinds"][0]
    last = {k: v[-1] for k, v in run.results.table("eval").items()}
    return {"error": estimation_error(client_models(run, cfg, dataset), truth),
            "r2_pooled": float(last[f"{kind}.seen.acc_pooled"]), "r2_mean": float(last[f"{kind}.seen.acc_mean"]),
            "mse": float(last[f"{kind}.seen.loss"])}


def cross_validate(base: dict, strategy: str, seed: int, rounds: int, folds: int, log) -> float | None:  # noqa: ANN001
    """The grid value with the lowest pooled held-out MSE over ``folds`` folds of the training rows."""
    if strategy not in GRIDS:
        return None
    section, key, grid = GRIDS[strategy]
    dataset = build_federated_dataset(strategy_config(base, strategy, seed, rounds, None).data, seed)
    losses = []
    for value in grid:
        cfg = strategy_config(base, strategy, seed, rounds, (section, key, value))
        sse = count = 0.0
        for fold in range(folds):
            view = FoldDataset(dataset, folds, fold, seed)
            results = run_engine(cfg, view).results
            kind = results.attrs["eval_kinds"][0]
            n_held = float((dataset.layout.train_sizes - view.layout.train_sizes).sum())
            sse += results.table("eval")[f"{kind}.seen.loss"][-1] * n_held
            count += n_held
        losses.append(sse / count)
        log(f"  cv seed {seed} {strategy} {key}={value:g}: held-out MSE {losses[-1]:.3f}")
    return grid[int(np.argmin(losses))]


# ------------------------------------------------------------------ table
def mean_2se(values: list[float]) -> tuple[float, float]:
    arr = np.asarray(values, dtype=np.float64)
    se = arr.std(ddof=1) / np.sqrt(len(arr)) if len(arr) > 1 else float("nan")
    return float(arr.mean()), float(2 * se)


def markdown(results: dict[str, list[dict[str, float]]], chosen: dict[str, list[float]]) -> str:
    lines = ["| Strategy | Estimation error | Test R² (pooled) | Test R² (client mean) | CV choice "
             "| paper: error | paper: R² |", "|---|---|---|---|---|---|---|"]
    for s in STRATEGIES:
        rows = results[s]
        cells = []
        formats = (("error", "{:.2f} ± {:.2f}"), ("r2_pooled", "{:.3f} ± {:.3f}"), ("r2_mean", "{:.3f} ± {:.3f}"))
        for key, fmt in formats:
            cells.append(fmt.format(*mean_2se([r[key] for r in rows])))
        choice = f"{GRIDS[s][1]} ∈ {{{', '.join(f'{v:g}' for v in chosen[s])}}}" if chosen.get(s) else "–"
        (pe, pse), (pr, prse) = PAPER[s]
        lines.append(f"| {LABELS[s]} | {' | '.join(cells)} | {choice} | {pe:.2f} ± {pse:.3f} | {pr:.3f} ± {prse:.3f} |")
    return "\n".join(lines)


def write_doc(path: Path, block: str) -> None:
    text = path.read_text()
    pattern = re.compile(re.escape(TABLE_BEGIN) + ".*?" + re.escape(TABLE_END), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{path}: no {TABLE_BEGIN} ... {TABLE_END} block to replace")
    path.write_text(pattern.sub(lambda _: f"{TABLE_BEGIN}\n{block}\n{TABLE_END}", text))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs/karula_ridge.yaml"))
    ap.add_argument("--repeats", type=int, default=3, help="seeds 0..R-1")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per run (default: the config's)")
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--cv-baselines", action="store_true", help="also cross-validate pFedMe λ and IFCA k")
    ap.add_argument("--write", action="store_true", help="replace the table block in docs/papers/karula.md")
    ap.add_argument("--results", type=Path, help="score the results files of a sweep in this directory instead")
    ap.add_argument("--error", choices=("squared", "norm"), default="squared",
                    help="with --results: mean ‖θ̂_i − θ_i‖² or mean ‖θ̂_i − θ_i‖")
    args = ap.parse_args(argv)
    if args.results:
        print(score_directory(args.results, args.error))
        return 0
    base = load_raw(args.config)
    rounds = args.rounds or int(base.get("rounds", 10))
    strategies = [s for s in args.strategies.split(",") if s]
    results: dict[str, list[dict[str, float]]] = {s: [] for s in STRATEGIES}
    chosen: dict[str, list[float]] = {s: [] for s in STRATEGIES}
    start = time.process_time()
    for seed in range(args.repeats):
        dataset = build_federated_dataset(strategy_config(base, "local", seed, rounds, None).data, seed)
        truth = truth_of(dataset)
        for s in strategies:
            value = None
            if s == "karula" or args.cv_baselines:
                value = cross_validate(base, s, seed, rounds, args.folds, print)
            option = (GRIDS[s][0], GRIDS[s][1], value) if value is not None else None
            if value is not None:
                chosen[s].append(value)
            cfg = strategy_config(base, s, seed, rounds, option)
            r = scores(run_engine(cfg), cfg, dataset, truth)
            results[s].append(r)
            print(f"seed {seed} {s:7s} error {r['error']:8.3f}  R² pooled {r['r2_pooled']:.4f}  "
                  f"mean {r['r2_mean']:.4f}" + (f"  ({GRIDS[s][1]}={value:g})" if value is not None else ""),
                  flush=True)
    table = markdown({s: results[s] or [{"error": np.nan, "r2_pooled": np.nan, "r2_mean": np.nan}] for s in STRATEGIES},
                     chosen)
    command = " ".join(["python benchmarks/karula_table1.py",
                        *(a for a in (argv if argv is not None else sys.argv[1:]) if a != "--write")])
    block = (f"{table}\n\n{args.repeats} repeats (seeds 0..{args.repeats - 1}), {rounds} rounds, {args.folds}-fold CV; "
             f"± 2·SE over repeats; {time.process_time() - start:.0f} s CPU. Command: `{command}`")
    print(block)
    if args.write:
        write_doc(ROOT / "docs/papers/karula.md", block)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
