"""Fixtures: tiny datasets in the real formats, written into ``tmp_path``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from data_files import dump_pickle, tagged_images, write_mnist


@pytest.fixture
def mnist_files(tmp_path: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """An MNIST-format directory, 50 train + 20 t10k; returns (root, images [70,28,28], labels [70])."""
    images, labels = tagged_images(70, (28, 28)), np.arange(70) % 10
    write_mnist(tmp_path / "mnist", images, labels, 50)
    return tmp_path / "mnist", images, labels


@pytest.fixture
def cifar10_files(tmp_path: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """cifar-10-batches-py/ with 6 batches of 8 images; returns (its parent, images [48,3,32,32], labels)."""
    folder = tmp_path / "cifar-10-batches-py"
    folder.mkdir()
    images, labels = tagged_images(48, (3, 32, 32)), np.arange(48) % 10
    for b, name in enumerate([f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]):
        rows = slice(8 * b, 8 * b + 8)
        dump_pickle(folder / name, {b"data": images[rows].reshape(8, -1), b"labels": labels[rows].tolist()})
    return tmp_path, images, labels


@pytest.fixture
def cifar100_files(tmp_path: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """cifar-100-python/ with train (300) and test (100); returns (its parent, images, fine labels)."""
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    images, labels = tagged_images(400, (3, 32, 32)), (np.arange(400) * 7) % 100
    for name, rows in (("train", slice(0, 300)), ("test", slice(300, 400))):
        batch = {b"data": images[rows].reshape(-1, 3072), b"fine_labels": labels[rows].tolist()}
        batch[b"coarse_labels"] = (labels[rows] // 5).tolist()
        dump_pickle(folder / name, batch)
    return tmp_path, images, labels
