"""What benchmarks/karula_table1.py computes that could silently break: the CV folds, the fold view of a
dataset, the per-client models read back from an in-process run and the estimation error."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.karula_table1 import (
    STRATEGIES,
    FoldDataset,
    client_models,
    estimation_error,
    fold_rows,
    mean_2se,
    run_engine,
    strategy_config,
    truth_of,
)
from mpifl.data import build_federated_dataset

BASE = {
    "rounds": 3,
    "clients_per_round": 3,
    "data": {"dataset": "karula_ridge", "partition": "natural", "num_clients": 6,
             "synthetic": {"num_features": 4, "ridge_min_samples": 8, "ridge_max_samples": 15}},
    "model": {"name": "linear"},
    "client": {"lr": 0.01, "weight_decay": 1e-6, "batch_size": 100},
    "karula": {"t": 1.0, "lr": 0.05, "reference_size": 8},
}


def test_folds_partition_rows_deterministically():
    masks = np.stack([fold_rows(23, 5, k, seed=1, client=4) for k in range(5)])
    assert (masks.sum(axis=0) == 1).all()  # every row held out exactly once
    assert sorted(masks.sum(axis=1)) == [4, 4, 5, 5, 5]
    assert (masks == np.stack([fold_rows(23, 5, k, seed=1, client=4) for k in range(5)])).all()
    assert not (masks == np.stack([fold_rows(23, 5, k, seed=1, client=5) for k in range(5)])).all()


def test_fold_view_holds_out_training_rows_only():
    cfg = strategy_config(BASE, "local", 0, 3, None)
    base = build_federated_dataset(cfg.data, 0)
    view = FoldDataset(base, 3, 1, 0)
    full, fold = base.load_clients([2])[2], view.load_clients([2])[2]
    held = fold_rows(len(full.x_train), 3, 1, 0, 2)
    assert view.layout.train_sizes[2] == len(full.x_train) - held.sum() == len(fold.x_train)
    np.testing.assert_array_equal(fold.x_test, full.x_train[held])
    np.testing.assert_array_equal(fold.y_train, full.y_train[~held])


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_estimation_error_reads_the_models_the_runtime_evaluated(strategy):
    """The models the table scores are the ones the runtime evaluated: their pooled test MSE, recomputed here,
    is the runtime's own (Karula's estimation error also matches the per-round log)."""
    option = ("karula", "t", 0.5) if strategy == "karula" else None
    cfg = strategy_config(BASE, strategy, 0, 3, option)
    dataset = build_federated_dataset(cfg.data, 0)
    run = run_engine(cfg)
    models = client_models(run, cfg, dataset)
    sse = n = 0.0
    for c, split in dataset.load_clients(range(dataset.layout.num_clients)).items():  # the runtime's test MSE
        residual = split.x_test.reshape(len(split.x_test), -1) @ models[c, :-1] + models[c, -1] - split.y_test
        sse, n = sse + float(residual @ residual), n + len(residual)
    kind = run.results.attrs["eval_kinds"][0]
    assert np.isclose(run.results.table("eval")[f"{kind}.seen.loss"][-1], sse / n, rtol=1e-5)
    truth = truth_of(dataset)
    expected = np.mean([np.sum((m - t) ** 2) for m, t in zip(models, truth)])
    assert np.isclose(estimation_error(models, truth), expected)
    if strategy == "karula":
        assert np.isclose(run.results.table("rounds")["estimation_error"][-1], expected, rtol=1e-5)


def test_mean_2se():
    mean, two_se = mean_2se([1.0, 2.0, 3.0])
    assert mean == 2.0 and np.isclose(two_se, 2 * 1.0 / np.sqrt(3))
