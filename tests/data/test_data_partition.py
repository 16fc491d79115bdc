"""Partitioners and the pooled path: invariants, determinism, subset loading, impossible requests."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.datasets import load_digits

from mpifl.data import build_federated_dataset
from mpifl.data.config import DataConfig
from mpifl.data.partition import (
    apportion,
    balanced_greedy_classes,
    classes_counts,
    dirichlet_counts,
    dirichlet_pefll_counts,
    iid_counts,
    shards_counts,
    split_counts,
)
from mpifl.data.pooled import digits_pool
from mpifl.schema import ConfigError
from tests.conftest import mpi_env

DIGITS_TOTALS = np.bincount(load_digits().target)
PARTITIONS = ["iid", "classes", "dirichlet", "dirichlet_pefll", "shards"]


def _digits(partition: str, **kw: object) -> DataConfig:
    base = {"num_clients": 20, "test_fraction": 0.2, "val_fraction": 0.1, "classes_per_client": 3, "alpha": 0.3}
    return DataConfig(dataset="digits", partition=partition, **{**base, **kw})


@pytest.mark.parametrize("partition", PARTITIONS)
def test_pooled_invariants(partition: str) -> None:
    ds = build_federated_dataset(_digits(partition), seed=7)
    labels, lay = ds.pool.labels, ds.layout
    seen = []
    for c in range(lay.num_clients):
        train, val, test = ds.indices(c)
        seen += [train, val, test]
        np.testing.assert_array_equal(np.bincount(labels[train], minlength=10), lay.class_counts[c])
        per_class = np.bincount(labels[np.concatenate([train, val, test])], minlength=10)
        test_counts = np.bincount(labels[test], minlength=10)
        assert np.all(np.abs(test_counts - 0.2 * per_class) < 1)  # test has the train class mix, stratified
        assert abs(len(test) - 0.2 * per_class.sum()) <= 0.5
        assert abs(len(val) - 0.1 * per_class.sum()) <= 1
    used = np.concatenate(seen)
    assert len(np.unique(used)) == len(used)  # no sample goes to two clients or two splits
    assert used.min() >= 0 and used.max() < len(labels)
    assert lay.train_sizes.dtype == np.int64 and lay.class_counts.dtype == np.int64
    np.testing.assert_array_equal(lay.train_sizes, lay.class_counts.sum(1))


def test_classes_partition_gives_k_distinct_balanced_classes() -> None:
    lay = build_federated_dataset(_digits("classes", num_clients=30), seed=1).layout
    held = lay.class_counts > 0
    np.testing.assert_array_equal(held.sum(1), np.full(30, 3))
    np.testing.assert_array_equal(held.sum(0), np.full(10, 9))  # k·n/C = 9 clients per class


def test_iid_sizes_and_all_samples_used() -> None:
    counts = iid_counts(DIGITS_TOTALS, 7, np.random.default_rng(0))
    np.testing.assert_array_equal(counts.sum(0), DIGITS_TOTALS)
    assert counts.sum(1).max() - counts.sum(1).min() <= 1


def test_shards_sizes() -> None:
    counts = shards_counts(DIGITS_TOTALS, 10, 2, np.random.default_rng(0))
    np.testing.assert_array_equal(counts.sum(1), np.full(10, 2 * (1797 // 20)))
    assert (counts > 0).sum(1).max() <= 4  # two sorted shards span at most two classes each
    assert np.all(counts.sum(0) <= DIGITS_TOTALS)


def test_dirichlet_uses_all_samples_and_pefll_floors() -> None:
    rng = np.random.default_rng(0)
    np.testing.assert_array_equal(dirichlet_counts(DIGITS_TOTALS, 15, 0.5, rng).sum(0), DIGITS_TOTALS)
    pi_rng, counts_rng = np.random.default_rng(3), np.random.default_rng(3)
    counts = dirichlet_pefll_counts(DIGITS_TOTALS, 15, 0.5, counts_rng)
    pi = pi_rng.dirichlet(np.full(10, 0.5), size=15)
    np.testing.assert_array_equal(counts, np.floor(DIGITS_TOTALS * pi / pi.sum(0)).astype(np.int64))


def test_balanced_greedy_matches_slots() -> None:
    held = balanced_greedy_classes(100, 2, 10, np.random.default_rng(0))
    assert all(len(set(row)) == 2 for row in held)
    np.testing.assert_array_equal(np.bincount(held.ravel(), minlength=10), np.full(10, 20))
    uneven = balanced_greedy_classes(7, 3, 5, np.random.default_rng(1))  # ceil(21/5) = 5 slots per class
    assert all(len(set(row)) == 3 for row in uneven) and np.bincount(uneven.ravel()).max() <= 5


@pytest.mark.parametrize("partition", PARTITIONS)
def test_deterministic_and_seed_dependent(partition: str) -> None:
    a, b = build_federated_dataset(_digits(partition), 11), build_federated_dataset(_digits(partition), 11)
    np.testing.assert_array_equal(a.layout.class_counts, b.layout.class_counts)
    sa, sb = a.load_clients([4])[4], b.load_clients([4])[4]
    for field in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(sa, field), getattr(sb, field))
    other = build_federated_dataset(_digits(partition), 12)
    assert not np.array_equal(a.load_clients([4])[4].x_train, other.load_clients([4])[4].x_train)


def test_subset_load_equals_full_load() -> None:
    ds = build_federated_dataset(_digits("dirichlet", unseen_fraction=0.2), 5)
    full = ds.load_clients(range(20))
    part = ds.load_clients([17, 3, 3])
    assert sorted(part) == [3, 17]
    for c in part:
        for field in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test"):
            np.testing.assert_array_equal(getattr(part[c], field), getattr(full[c], field))
    np.testing.assert_array_equal(ds.layout.unseen, np.arange(20) >= 16)
    with pytest.raises(ValueError, match="out of range"):
        ds.load_clients([20])


def test_layout_is_read_only() -> None:
    lay = build_federated_dataset(_digits("iid"), 0).layout
    with pytest.raises(ValueError):
        lay.train_sizes[0] = 5


def test_digits_normalized_globally() -> None:
    ds = build_federated_dataset(DataConfig(dataset="digits", num_clients=1, test_fraction=0.5), 0)
    split = ds.load_clients([0])[0]
    x = np.concatenate([split.x_train, split.x_test])
    assert x.shape == (1797, 1, 8, 8) and ds.layout.input_shape == (1, 8, 8)
    assert abs(float(x.mean())) < 1e-4 and abs(float(x.std()) - 1) < 1e-4


def test_digits_are_scikit_learns_bits_without_importing_it() -> None:
    """mpifl reads scikit-learn's digits file itself (importing scikit-learn costs a small job ≈ 1 s): the same
    pixels and labels, bit for bit, as its load_digits; and in a fresh interpreter no sklearn, scipy or pandas."""
    pool = digits_pool(DataConfig(dataset="digits", normalize=False))
    bunch = load_digits()
    expected = (bunch.images / 16.0).astype(np.float32)[:, None]
    assert pool.read(np.arange(len(expected))).tobytes() == expected.tobytes()
    np.testing.assert_array_equal(pool.labels, bunch.target)
    assert pool.labels.dtype == np.int64
    loaded = subprocess.run([sys.executable, "-c", "import sys; from mpifl.data.pooled import digits_pool; "
                             "from mpifl.data.config import DataConfig; digits_pool(DataConfig(dataset='digits')); "
                             "print(sorted({'sklearn', 'scipy', 'pandas'} & set(sys.modules)))"],
                            capture_output=True, text=True, check=True, env=mpi_env())
    assert loaded.stdout.strip() == "[]"


def test_digits_without_scikit_learn_is_one_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sklearn", None)  # what importlib finds where it is not installed: nothing
    with pytest.raises(ConfigError, match=r"digits is scikit-learn's bundled file, not found \(no sklearn\): pip"):
        digits_pool(DataConfig(dataset="digits"))


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (_digits("classes", classes_per_client=11), "classes_per_client: 11 exceeds the 10 classes"),
        (_digits("shards", num_clients=1000, shards_per_client=2), "cannot be cut into 2000"),
        (_digits("iid", num_clients=5000), "0 training samples"),
        (_digits("iid", unseen_fraction=0.98), "leaves no seen client"),
        (_digits("natural"), "needs partition one of"),
        (_digits("iid", test_fraction=0.6, val_fraction=0.4), "must be < 1"),
        (_digits("dirichlet", num_clients=1500, alpha=0.01), "Dirichlet"),
    ],
)
def test_impossible_requests(cfg: DataConfig, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build_federated_dataset(cfg, 0)


def test_bad_seed() -> None:
    with pytest.raises(ConfigError, match="seed"):
        build_federated_dataset(_digits("iid"), -1)


def test_classes_equal_shares() -> None:
    counts = classes_counts(np.array([100, 100, 7]), 4, 2, np.random.default_rng(0))
    for c, total in enumerate([100, 100, 7]):
        column = counts[:, c][counts[:, c] > 0]
        assert column.sum() == total and column.max() - column.min() <= 1


@settings(max_examples=60, deadline=None)
@given(
    counts=st.lists(st.lists(st.integers(0, 40), min_size=3, max_size=3), min_size=1, max_size=6),
    test=st.floats(0.01, 0.9),
    val=st.floats(0.0, 0.5),
)
def test_split_counts_properties(counts: list, test: float, val: float) -> None:
    if test + val >= 1:
        return
    counts = np.array(counts, dtype=np.int64)
    train, val_c, test_c = split_counts(counts, test, val)
    np.testing.assert_array_equal(train + val_c + test_c, counts)
    assert (train >= 0).all() and (val_c >= 0).all() and (test_c >= 0).all()
    np.testing.assert_array_equal(test_c.sum(1), np.floor(counts.sum(1) * test + 0.5))
    assert np.all(np.abs(test_c - counts * test) < 1)


@settings(max_examples=40, deadline=None)
@given(totals=st.lists(st.integers(0, 50), min_size=1, max_size=5), n=st.integers(1, 30), seed=st.integers(0, 99))
def test_iid_counts_margins(totals: list, n: int, seed: int) -> None:
    totals = np.array(totals, dtype=np.int64)
    counts = iid_counts(totals, n, np.random.default_rng(seed))
    np.testing.assert_array_equal(counts.sum(0), totals)
    sizes = counts.sum(1)
    assert sizes.max() - sizes.min() <= 1 and (counts >= 0).all()


def test_apportion_largest_remainder() -> None:
    np.testing.assert_array_equal(apportion(np.array([[5, 5, 5]]), 0.5), [[3, 3, 2]])  # 8 of 15, ties by column
    np.testing.assert_array_equal(apportion(np.array([[1, 9], [3, 1]]), 0.25), [[1, 2], [1, 0]])
