"""The real Fashion-MNIST files of Debian's dataset-fashion-mnist package, when installed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mpifl.data import build_federated_dataset
from mpifl.data.config import DataConfig
from mpifl.data.pooled import FASHION_MNIST_DEFAULT_ROOT

pytestmark = pytest.mark.skipif(
    not Path(FASHION_MNIST_DEFAULT_ROOT).is_dir(),
    reason=f"{FASHION_MNIST_DEFAULT_ROOT} absent (apt-get install dataset-fashion-mnist)",
)


def test_real_fashion_mnist_default_root() -> None:
    cfg = DataConfig(dataset="fashion_mnist", num_clients=100, partition="classes", classes_per_client=2)
    ds = build_federated_dataset(cfg, 0)
    lay = ds.layout
    assert lay.input_shape == (1, 28, 28) and lay.num_classes == 10
    np.testing.assert_array_equal(np.bincount(ds.pool.labels), np.full(10, 7000))  # 60k train + 10k test pooled
    np.testing.assert_array_equal(lay.train_sizes, np.full(100, 560))  # 2 classes x 7000/20 x 0.8
    splits = ds.load_clients([0, 99])
    for c, split in splits.items():
        assert split.x_train.shape == (560, 1, 28, 28) and split.x_test.shape == (140, 1, 28, 28)
        np.testing.assert_array_equal(np.bincount(split.y_train, minlength=10), lay.class_counts[c])
        raw = split.x_train * 0.3530 + 0.2860
        assert raw.min() > -1e-5 and raw.max() < 1 + 1e-5 and 0.05 < raw.mean() < 0.6
