"""Synthetic generators: cheap layouts at scale, per-client determinism, the statistics they promise."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from mpifl.data import ClientSplit, KarulaRidgeDataset, build_federated_dataset
from mpifl.data.config import DataConfig, SyntheticConfig
from mpifl.schema import ConfigError

FIELDS = ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test")


def _same(a: ClientSplit, b: ClientSplit) -> None:
    for field in FIELDS:
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


@pytest.mark.parametrize("partition", ["iid", "classes"])
def test_gaussian_layout_for_100k_clients_is_cheap(partition: str) -> None:
    cfg = DataConfig(dataset="gaussian_images", num_clients=100_000, partition=partition, unseen_fraction=0.1)
    tracemalloc.start()
    ds = build_federated_dataset(cfg, 0)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 256e6  # the samples themselves would be 100,000 x 80 x 784 float32: 25 GB
    lay = ds.layout
    np.testing.assert_array_equal(lay.train_sizes, np.full(100_000, 64))  # 64 / 0.8 = 80 per client, 16 test
    assert lay.unseen.sum() == 10_000 and lay.unseen[-10_000:].all()
    if partition == "classes":
        np.testing.assert_array_equal((lay.class_counts > 0).sum(1), np.full(100_000, 2))


def test_gaussian_clients_follow_layout_and_class_means() -> None:
    syn = SyntheticConfig(samples_per_client=400, num_classes=4, image_shape=(2, 5, 5), class_separation=2.0)
    cfg = DataConfig(dataset="gaussian_images", num_clients=6, partition="classes", classes_per_client=2, synthetic=syn)
    ds = build_federated_dataset(cfg, 3)
    splits = ds.load_clients(range(6))
    for c, split in splits.items():
        assert split.x_train.shape == (ds.layout.train_sizes[c], 2, 5, 5) and split.x_train.dtype == np.float32
        np.testing.assert_array_equal(np.bincount(split.y_train, minlength=4), ds.layout.class_counts[c])
        assert set(np.unique(split.y_test)) == set(np.flatnonzero(ds.layout.class_counts[c]))
    x = np.concatenate([s.x_train for s in splits.values()])
    y = np.concatenate([s.y_train for s in splits.values()])
    for k in range(4):
        # x = 2·mean[k] + N(0, 1): per-pixel sample means within ~5 standard errors of 2·mean[k]
        np.testing.assert_allclose(x[y == k].mean(0), 2.0 * ds.means[k], atol=5 / np.sqrt((y == k).sum()))
    _same(ds.load_clients([5])[5], splits[5])
    _same(build_federated_dataset(cfg, 3).load_clients([2])[2], splits[2])


def test_gaussian_lognormal_sizes_keep_each_clients_class_mix() -> None:
    syn = SyntheticConfig(samples_per_client=64, size_sigma=1.0)
    equal = DataConfig(dataset="gaussian_images", num_clients=2000, partition="classes", test_fraction=0.2)
    unequal = DataConfig(**{**equal.__dict__, "synthetic": syn})
    base, ds = build_federated_dataset(equal, 0).layout, build_federated_dataset(unequal, 0)
    sizes = ds.layout.train_sizes
    total = sizes / 0.8  # each client's T·LogNormal samples, 20% of them held out for test
    assert abs(np.log(total).std() - 1.0) < 0.05 and abs(total.mean() / 80 - 1) < 0.1 and sizes.min() >= 2
    np.testing.assert_array_equal(ds.layout.class_counts > 0, base.class_counts > 0)  # same classes per client
    big = int(np.argmax(sizes))
    split = ds.load_clients([big])[big]
    assert len(split.y_train) == sizes[big]
    np.testing.assert_array_equal(np.bincount(split.y_train, minlength=10), ds.layout.class_counts[big])


def test_gaussian_pad_and_val_sizes() -> None:
    cfg = DataConfig(dataset="gaussian_images", num_clients=3, pad_to=32, val_fraction=0.1, test_fraction=0.2)
    ds = build_federated_dataset(cfg, 0)
    split = ds.load_clients([1])[1]
    assert ds.layout.input_shape == (1, 32, 32) and split.x_val.shape[1:] == (1, 32, 32)
    assert (len(split.x_train), len(split.x_val), len(split.x_test)) == (64, 9, 18)  # 64 / 0.7 -> 91 per client
    assert not split.x_train[:, :, :2].any()


def test_leaf_synthetic() -> None:
    syn = SyntheticConfig(num_features=60, num_classes=10, leaf_alpha=0.5, leaf_beta=0.5)
    cfg = DataConfig(dataset="leaf_synthetic", num_clients=12, partition="natural", synthetic=syn)
    ds = build_federated_dataset(cfg, 2)
    lay = ds.layout
    assert lay.input_shape == (60,) and lay.num_classes == 10 and lay.task == "classification"
    splits = ds.load_clients(range(12))
    for c, split in splits.items():
        total = sum(len(getattr(split, f)) for f in ("y_train", "y_val", "y_test"))
        assert total >= 50 and split.x_train.shape == (lay.train_sizes[c], 60)
        np.testing.assert_array_equal(np.bincount(split.y_train, minlength=10), lay.class_counts[c])
    x = np.concatenate([s.x_train for s in splits.values()])
    centred = np.concatenate([s.x_train - s.x_train.mean(0) for s in splits.values()])
    # within a client, feature j has variance j^-1.2
    np.testing.assert_allclose(centred.var(0)[[0, 9, 59]], np.array([1, 10, 60]) ** -1.2, rtol=0.15)
    assert x.dtype == np.float32
    _same(build_federated_dataset(cfg, 2).load_clients([7])[7], splits[7])
    assert not np.array_equal(build_federated_dataset(cfg, 3).load_clients([7])[7].x_train[:5], splits[7].x_train[:5])


def test_karula_ridge_ground_truth_and_groups() -> None:
    syn = SyntheticConfig(num_features=5, ridge_min_samples=10, ridge_max_samples=100, ridge_noise_std=0.0)
    cfg = DataConfig(dataset="karula_ridge", num_clients=30, partition="natural", synthetic=syn)
    ds = build_federated_dataset(cfg, 0)
    assert isinstance(ds, KarulaRidgeDataset)
    lay = ds.layout
    assert (lay.task, lay.num_classes, lay.class_counts.shape, lay.input_shape) == ("regression", 0, (30, 0), (5,))
    assert lay.train_sizes.min() >= 10 and lay.train_sizes.max() <= 100
    np.testing.assert_array_equal(ds.groups, np.arange(30) % 3)
    np.testing.assert_array_equal(ds.feature_groups, ds.groups)
    split = ds.load_clients([4])[4]
    assert split.y_train.dtype == np.float32 and len(split.x_train) == lay.train_sizes[4]
    theta = ds.true_parameters(4)
    assert abs(theta.mean() - 1.5) < 0.3  # client 4 is in group 1 (mean 1.5)
    fit = np.linalg.lstsq(split.x_train.astype(np.float64), split.y_train.astype(np.float64), rcond=None)[0]
    np.testing.assert_allclose(fit, theta, atol=1e-4)  # noiseless targets are exactly x·theta
    assert abs(split.x_train.mean() - 0.5) < 0.3  # aligned: feature mean of group 1
    np.testing.assert_allclose(len(split.y_test) / lay.train_sizes[4], 0.25, atol=0.02)


def test_karula_ridge_crossed_and_noise() -> None:
    syn = SyntheticConfig(
        num_features=3,
        ridge_feature_groups="crossed",
        ridge_noise_std=0.5,
        ridge_min_samples=200,
        ridge_max_samples=300,
    )
    cfg = DataConfig(dataset="karula_ridge", num_clients=9, partition="natural", synthetic=syn)
    ds = build_federated_dataset(cfg, 1)
    assert len(set(zip(ds.groups.tolist(), ds.feature_groups.tolist(), strict=True))) == 9  # every (g, f) pair
    split = ds.load_clients([8])[8]
    residual = split.y_train - split.x_train @ ds.true_parameters(8)
    assert abs(residual.std() - 0.5) < 0.1


def test_karula_ridge_bad_sizes() -> None:
    syn = SyntheticConfig(ridge_min_samples=50, ridge_max_samples=10)
    with pytest.raises(ConfigError, match="ridge_min_samples: 50 exceeds ridge_max_samples 10"):
        build_federated_dataset(DataConfig(dataset="karula_ridge", partition="natural", synthetic=syn), 0)
    with pytest.raises(ConfigError, match="needs partition 'natural'"):
        build_federated_dataset(DataConfig(dataset="karula_ridge", partition="iid"), 0)
