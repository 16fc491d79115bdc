"""SVHN's MATLAB format, written here with scipy, read back through the pooled path."""

import numpy as np
import pytest
from scipy.io import savemat

from mpifl.data import build_federated_dataset
from mpifl.data.config import DataConfig
from mpifl.schema import ConfigError


def write_svhn(root, n_train=12, n_test=8):
    rng = np.random.default_rng(0)
    for name, n in (("train_32x32.mat", n_train), ("test_32x32.mat", n_test)):
        x = rng.integers(0, 256, (32, 32, 3, n), dtype=np.uint8)
        x[0, 0, 0, :] = np.arange(n)  # tag each image so rows can be traced
        y = (np.arange(n) % 10 + 1).reshape(-1, 1).astype(np.uint8)  # 10 means digit 0
        savemat(root / name, {"X": x, "y": y})


def test_svhn_loads_labels_and_pixels(tmp_path):
    write_svhn(tmp_path)
    data = build_federated_dataset(DataConfig(dataset="svhn", root=str(tmp_path), num_clients=2, normalize=False), 0)
    assert data.layout.input_shape == (3, 32, 32) and data.layout.num_classes == 10
    assert data.layout.class_counts.sum() == data.layout.train_sizes.sum()
    split = data.load_clients([0, 1])
    x = np.concatenate([s.x_train for s in split.values()] + [s.x_test for s in split.values()])
    y = np.concatenate([s.y_train for s in split.values()] + [s.y_test for s in split.values()])
    assert len(y) == 20 and x.dtype == np.float32 and x.max() <= 1
    tags = np.rint(x[:, 0, 0, 0] * 255).astype(int)  # image k of a file carries label (k % 10 + 1) % 10
    assert np.array_equal(y, (tags % 10 + 1) % 10)


def test_damaged_svhn_is_a_config_error(tmp_path):
    write_svhn(tmp_path)
    (tmp_path / "test_32x32.mat").write_bytes(b"not a mat file")
    with pytest.raises(ConfigError, match="test_32x32.mat"):
        build_federated_dataset(DataConfig(dataset="svhn", root=str(tmp_path), num_clients=2), 0)
    (tmp_path / "test_32x32.mat").unlink()
    with pytest.raises(ConfigError, match="does not exist"):
        build_federated_dataset(DataConfig(dataset="svhn", root=str(tmp_path), num_clients=2), 0)
