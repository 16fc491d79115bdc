"""File formats: IDX, CIFAR pickles, LEAF JSON; values read back exactly, bad files refused by path."""

from __future__ import annotations

import gzip
import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
from data_files import dump_pickle, femnist_user, row_ids, tagged_images, write_idx, write_leaf, write_mnist

from mpifl.data import ClientSplit, FederatedDataset, build_federated_dataset
from mpifl.data.config import DataConfig
from mpifl.data.formats import IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC, IdxFile
from mpifl.data.leaf import SHAKESPEARE_LETTERS, UNKNOWN_CHAR, encode_chars
from mpifl.schema import ConfigError


def _all(ds: FederatedDataset) -> dict[int, ClientSplit]:
    return ds.load_clients(range(ds.layout.num_clients))


def _stack(splits: dict[int, ClientSplit], field: str) -> np.ndarray:
    return np.concatenate([getattr(s, field) for s in splits.values()])


# ------------------------------------------------------------------------------------------ IDX


@pytest.mark.parametrize("gz", [False, True])
def test_idx_reads_values_and_rows(tmp_path: Path, gz: bool) -> None:
    images = tagged_images(30, (5, 4))
    f = IdxFile(write_idx(tmp_path / "img", images, gz), IDX_IMAGES_MAGIC)
    assert f.shape == (30, 5, 4)
    np.testing.assert_array_equal(f.read_all(), images)
    rows = np.array([29, 3, 3, 0, 17])
    np.testing.assert_array_equal(f.read_rows(rows), images[rows])


def test_idx_big_endian_wide_types(tmp_path: Path) -> None:
    values = np.array([[1, -2], [70000, 5]], dtype=np.int32)
    f = IdxFile(write_idx(tmp_path / "wide", values), 0x00000C02)
    np.testing.assert_array_equal(f.read_all(), values)
    assert f.read_all().dtype.byteorder in "=|<"


def test_idx_bad_magic_names_path(tmp_path: Path) -> None:
    path = write_idx(tmp_path / "labels", np.zeros(3, np.uint8))
    with pytest.raises(ConfigError, match="expected 0x00000803") as err:
        IdxFile(path, IDX_IMAGES_MAGIC)
    assert str(path) in str(err.value)
    junk = tmp_path / "junk"
    junk.write_bytes(b"PK\x03\x04rest")
    with pytest.raises(ConfigError, match="not an IDX file"):
        IdxFile(junk, IDX_LABELS_MAGIC)


@pytest.mark.parametrize("gz", [False, True])
def test_idx_truncated_is_refused(tmp_path: Path, gz: bool) -> None:
    path = write_idx(tmp_path / "img", tagged_images(40, (8, 8)), gz)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 50])
    with pytest.raises(ConfigError) as err:
        IdxFile(path, IDX_IMAGES_MAGIC)
    assert str(path) in str(err.value)


def test_idx_gz_multi_member_is_accepted(tmp_path: Path) -> None:
    images = tagged_images(10, (3, 3))
    plain = write_idx(tmp_path / "img", images)
    data = plain.read_bytes()
    path = tmp_path / "multi-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(data[:50]) + gzip.compress(data[50:]))  # trailer records the last member only
    np.testing.assert_array_equal(IdxFile(path, IDX_IMAGES_MAGIC).read_all(), images)


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_pool_round_trips_every_sample(tmp_path: Path, gz: bool) -> None:
    images, labels = tagged_images(70, (28, 28)), np.arange(70) % 10
    write_mnist(tmp_path, images, labels, 50, gz)
    cfg = DataConfig(dataset="mnist", root=str(tmp_path), num_clients=5, test_fraction=0.2, val_fraction=0.1)
    ds = build_federated_dataset(cfg, seed=3)
    assert ds.layout.input_shape == (1, 28, 28) and ds.layout.num_classes == 10
    splits = _all(ds)
    x = np.concatenate([_stack(splits, f) for f in ("x_train", "x_val", "x_test")])
    y = np.concatenate([_stack(splits, f) for f in ("y_train", "y_val", "y_test")])
    ids = row_ids(x, 0.1307, 0.3081)
    np.testing.assert_array_equal(np.sort(ids), np.arange(70))  # every sample, once
    np.testing.assert_array_equal(y, labels[ids])
    expected = (images[ids][:, None] / 255.0 - 0.1307) / 0.3081
    np.testing.assert_allclose(x, expected, atol=1e-5)
    assert x.dtype == np.float32 and y.dtype == np.int64
    assert ds.cheap_clients is not gz  # a gzip stream is read from its start for any row: no per-round reads


def test_mnist_unnormalized_and_padded(mnist_files: tuple) -> None:
    root, images, _ = mnist_files
    cfg = DataConfig(dataset="mnist", root=str(root), num_clients=2, normalize=False, pad_to=32)
    ds = build_federated_dataset(cfg, seed=0)
    assert ds.layout.input_shape == (1, 32, 32)
    split = ds.load_clients([1])[1]
    x = split.x_train
    assert x.shape[1:] == (1, 32, 32)
    assert not x[:, :, :2].any() and not x[:, :, -2:].any() and not x[:, :, :, :2].any() and not x[:, :, :, -2:].any()
    ids = row_ids(x[:, :, 2:30, 2:30])
    np.testing.assert_allclose(x[:, 0, 2:30, 2:30], images[ids] / 255.0, atol=1e-6)


def test_mnist_missing_root_and_files(tmp_path: Path, mnist_files: tuple) -> None:
    with pytest.raises(ConfigError, match="needs data.root"):
        build_federated_dataset(DataConfig(dataset="mnist"), 0)
    with pytest.raises(ConfigError, match="not a directory"):
        build_federated_dataset(DataConfig(dataset="mnist", root=str(tmp_path / "nope")), 0)
    root = mnist_files[0]
    (root / "t10k-images-idx3-ubyte").unlink()
    with pytest.raises(ConfigError, match="t10k images") as err:
        build_federated_dataset(DataConfig(dataset="mnist", root=str(root)), 0)
    assert str(root) in str(err.value)


def test_mnist_label_count_mismatch(tmp_path: Path) -> None:
    images = tagged_images(30, (28, 28))
    write_mnist(tmp_path, images, np.arange(30) % 10, 20)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(19, np.uint8))
    with pytest.raises(ConfigError, match="20 images but .* 19 labels"):
        build_federated_dataset(DataConfig(dataset="mnist", root=str(tmp_path), num_clients=2), 0)


def test_mnist_label_out_of_range(tmp_path: Path) -> None:
    write_mnist(tmp_path, tagged_images(30, (28, 28)), np.full(30, 11), 20)
    with pytest.raises(ConfigError, match=r"labels must lie in \[0, 10\)"):
        build_federated_dataset(DataConfig(dataset="mnist", root=str(tmp_path), num_clients=2), 0)


def test_truncated_gz_images_refused_at_build(tmp_path: Path) -> None:
    write_mnist(tmp_path, tagged_images(70, (28, 28)), np.arange(70) % 10, 50, gz=True)
    path = tmp_path / "train-images-idx3-ubyte.gz"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ConfigError, match="train-images-idx3-ubyte.gz"):
        build_federated_dataset(DataConfig(dataset="fashion_mnist", root=str(tmp_path), num_clients=2), 0)


# ---------------------------------------------------------------------------------------- CIFAR


@pytest.mark.parametrize("at_folder", [False, True])
def test_cifar10_values_from_folder_or_parent(cifar10_files: tuple, at_folder: bool) -> None:
    parent, images, labels = cifar10_files
    root = parent / "cifar-10-batches-py" if at_folder else parent
    ds = build_federated_dataset(DataConfig(dataset="cifar10", root=str(root), num_clients=4), 1)
    assert ds.layout.input_shape == (3, 32, 32) and ds.layout.num_classes == 10
    splits = _all(ds)
    x = np.concatenate([_stack(splits, "x_train"), _stack(splits, "x_test")])
    y = np.concatenate([_stack(splits, "y_train"), _stack(splits, "y_test")])
    mean, std = np.array([0.4914, 0.4822, 0.4465]), np.array([0.2023, 0.1994, 0.2010])
    ids = row_ids(x, mean[0], std[0])
    np.testing.assert_array_equal(np.sort(ids), np.arange(48))
    np.testing.assert_array_equal(y, labels[ids])
    raw = x * std[None, :, None, None] + mean[None, :, None, None]
    np.testing.assert_allclose(raw, images[ids] / 255.0, atol=1e-5)


def test_cifar100_uses_fine_labels(cifar100_files: tuple) -> None:
    parent, images, labels = cifar100_files
    cfg = DataConfig(dataset="cifar100", root=str(parent), num_clients=2, normalize=False)
    ds = build_federated_dataset(cfg, 0)
    assert ds.layout.num_classes == 100 and ds.layout.class_counts.shape == (2, 100)
    split = ds.load_clients([0])[0]
    np.testing.assert_array_equal(np.bincount(split.y_train, minlength=100), ds.layout.class_counts[0])
    ids = row_ids(split.x_test)
    np.testing.assert_array_equal(split.y_test, labels[ids])
    np.testing.assert_allclose(split.x_test, images[ids] / 255.0, atol=1e-6)


def test_cifar_missing_batch_truncated_and_missing_key(cifar10_files: tuple) -> None:
    parent = cifar10_files[0]
    folder = parent / "cifar-10-batches-py"
    batch = folder / "data_batch_3"
    data = batch.read_bytes()
    batch.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match="corrupt or truncated pickle") as err:
        build_federated_dataset(DataConfig(dataset="cifar10", root=str(parent)), 0)
    assert str(batch) in str(err.value)
    dump_pickle(batch, {b"data": np.zeros((8, 3072), np.uint8)})
    with pytest.raises(ConfigError, match="b'labels'"):
        build_federated_dataset(DataConfig(dataset="cifar10", root=str(parent)), 0)
    batch.unlink()
    with pytest.raises(ConfigError, match="missing file .*data_batch_3"):
        build_federated_dataset(DataConfig(dataset="cifar10", root=str(parent)), 0)


def test_cifar_wrong_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cifar-100-python"):
        build_federated_dataset(DataConfig(dataset="cifar100", root=str(tmp_path)), 0)


class _Exploit:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused(cifar10_files: tuple, tmp_path: Path) -> None:
    parent = cifar10_files[0]
    marker = tmp_path / "pwned"
    batch = parent / "cifar-10-batches-py" / "data_batch_1"
    batch.write_bytes(pickle.dumps({b"data": _Exploit(marker), b"labels": [0]}, protocol=2))
    with pytest.raises(ConfigError, match="refusing to unpickle global (posix|nt).system") as err:
        build_federated_dataset(DataConfig(dataset="cifar10", root=str(parent)), 0)
    assert str(batch) in str(err.value)
    assert not marker.exists()


@pytest.mark.parametrize("protocol", [4, 5])
def test_pickle_protocols_accepted(cifar10_files: tuple, protocol: int) -> None:
    parent, images, labels = cifar10_files
    batch = parent / "cifar-10-batches-py" / "test_batch"
    batch.write_bytes(pickle.dumps({b"data": images[40:].reshape(8, -1), b"labels": labels[40:]}, protocol=protocol))
    cfg = DataConfig(dataset="cifar10", root=str(parent), num_clients=2, normalize=False)
    splits = _all(build_federated_dataset(cfg, 0))
    x = np.concatenate([_stack(splits, "x_train"), _stack(splits, "x_test")])
    np.testing.assert_array_equal(np.sort(row_ids(x)), np.arange(48))


# ----------------------------------------------------------------------------------------- LEAF


def _femnist_root(tmp_path: Path) -> tuple[Path, dict, dict]:
    rng = np.random.default_rng(0)
    train = {u: femnist_user(rng, n) for u, n in (("f_b", 10), ("f_a", 20), ("f_c", 5))}
    test = {u: femnist_user(rng, 3) for u in train}
    write_leaf(tmp_path, "train", [{"f_b": train["f_b"]}, {"f_a": train["f_a"], "f_c": train["f_c"]}])
    write_leaf(tmp_path, "test", [test])
    return tmp_path, train, test


def test_femnist_natural_partition(tmp_path: Path) -> None:
    root, train, test = _femnist_root(tmp_path)
    cfg = DataConfig(dataset="femnist", root=str(root), partition="natural", val_fraction=0.1, unseen_fraction=0.34)
    ds = build_federated_dataset(cfg, 0)
    lay = ds.layout
    assert (lay.num_clients, lay.num_classes, lay.input_shape) == (3, 62, (1, 28, 28))
    np.testing.assert_array_equal(lay.train_sizes, [18, 9, 4])  # users sorted: f_a, f_b, f_c; last 10% -> val
    assert lay.unseen.sum() == 1  # a seeded random writer, not the last id
    np.testing.assert_array_equal(lay.unseen, build_federated_dataset(cfg, 0).layout.unseen)
    assert {tuple(build_federated_dataset(cfg, s).layout.unseen) for s in range(8)} == {
        (True, False, False), (False, True, False), (False, False, True)}
    for client, user in enumerate(["f_a", "f_b", "f_c"]):
        np.testing.assert_array_equal(
            lay.class_counts[client], np.bincount(train[user][1][: lay.train_sizes[client]], minlength=62)
        )
    split = ds.load_clients([1])[1]
    x, y = np.asarray(train["f_b"][0], np.float32).reshape(-1, 1, 28, 28), np.asarray(train["f_b"][1])
    np.testing.assert_array_equal(split.x_train, x[:9])
    np.testing.assert_array_equal(split.y_val, y[9:])
    np.testing.assert_array_equal(split.y_test, test["f_b"][1])
    np.testing.assert_array_equal(split.x_test, np.asarray(test["f_b"][0], np.float32).reshape(-1, 1, 28, 28))


def test_femnist_pad_and_max_clients(tmp_path: Path) -> None:
    root, train, _ = _femnist_root(tmp_path)
    cfg = DataConfig(dataset="femnist", root=str(root), partition="natural", pad_to=32, max_clients=2)
    ds = build_federated_dataset(cfg, 0)
    assert ds.layout.num_clients == 2 and ds.layout.input_shape == (1, 32, 32)
    x = ds.load_clients([0])[0].x_train
    np.testing.assert_array_equal(x[:, 0, 2:30, 2:30], np.asarray(train["f_a"][0], np.float32).reshape(-1, 28, 28))
    assert x[:, :, :2].sum() == 0 and x[:, :, :, 30:].sum() == 0


def test_femnist_bad_files(tmp_path: Path) -> None:
    root, _, _ = _femnist_root(tmp_path)
    cfg = DataConfig(dataset="femnist", root=str(root), partition="natural")
    bad = root / "train" / "part_0.json"
    bad.write_text('{"users": ["f_b"], "num_samples": [')
    with pytest.raises(ConfigError, match="invalid LEAF JSON") as err:
        build_federated_dataset(cfg, 0)
    assert str(bad) in str(err.value)
    bad.write_text(json.dumps({"users": ["f_b"], "user_data": {}}))
    with pytest.raises(ConfigError, match="expected keys"):
        build_federated_dataset(cfg, 0)
    bad.write_text(
        json.dumps({"users": ["f_b"], "num_samples": [2], "user_data": {"f_b": {"x": [[0.0] * 784], "y": [1, 2]}}})
    )
    with pytest.raises(ConfigError, match="1 x, 2 y, num_samples 2"):
        build_federated_dataset(cfg, 0)
    bad.write_text(
        json.dumps({"users": ["f_b"], "num_samples": [1], "user_data": {"f_b": {"x": [[0.5] * 784], "y": [62]}}})
    )
    with pytest.raises(ConfigError, match=r"\[0, 62\)"):
        build_federated_dataset(cfg, 0)
    bad.write_text(
        '{"users": ["f_b"], "num_samples": [1], "user_data": {"f_b": {"x": [[NaN' + ", 0.5" * 783 + ']], "y": [3]}}}'
    )
    ds = build_federated_dataset(cfg, 0)  # the layout reads labels only; pixels are checked when loaded
    with pytest.raises(ConfigError, match="NaN or Inf"):
        ds.load_clients([1])  # f_b
    with pytest.raises(ConfigError, match="needs partition 'natural'"):
        build_federated_dataset(DataConfig(dataset="femnist", root=str(root), partition="iid"), 0)
    with pytest.raises(ConfigError, match="missing LEAF directory"):
        build_federated_dataset(DataConfig(dataset="femnist", root=str(root / "train"), partition="natural"), 0)


def test_leaf_test_only_user_refused(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    write_leaf(tmp_path, "train", [{"a": femnist_user(rng, 4)}])
    write_leaf(tmp_path, "test", [{"a": femnist_user(rng, 1), "z": femnist_user(rng, 1)}])
    with pytest.raises(ConfigError, match="'z'"):
        build_federated_dataset(DataConfig(dataset="femnist", root=str(tmp_path), partition="natural"), 0)


def test_shakespeare_encoding(tmp_path: Path) -> None:
    line = "To be, or not to be: that is the question.\n" * 2
    x = [line[i : i + 80] for i in range(4)]
    y = [line[80], line[81], line[82], "$"]
    write_leaf(tmp_path, "train", [{"HAMLET": (x, y)}])
    write_leaf(tmp_path, "test", [{"HAMLET": (["~" * 80], ["a"])}])
    ds = build_federated_dataset(DataConfig(dataset="shakespeare", root=str(tmp_path), partition="natural"), 0)
    lay = ds.layout
    assert (lay.num_classes, lay.input_shape, lay.input_dtype) == (UNKNOWN_CHAR + 1, (80,), "int64")
    split = ds.load_clients([0])[0]
    assert split.x_train.dtype == np.int64 and split.x_train.shape == (4, 80)
    assert split.x_train[0, 0] == 44 and split.x_train[0, 2] == 1  # "T" and " " in LEAF's ALL_LETTERS
    assert "".join(SHAKESPEARE_LETTERS[i] for i in split.x_train[1]) == x[1]
    assert split.y_train.tolist()[-1] == UNKNOWN_CHAR  # "$" is outside the vocabulary
    np.testing.assert_array_equal(split.x_test, np.full((1, 80), UNKNOWN_CHAR))
    assert split.y_test.tolist() == [encode_chars("a")[0]]
    with pytest.raises(ConfigError, match="not images"):
        build_federated_dataset(
            DataConfig(dataset="shakespeare", root=str(tmp_path), partition="natural", pad_to=32), 0
        )


def test_shakespeare_wrong_length(tmp_path: Path) -> None:
    write_leaf(tmp_path, "train", [{"A": (["short"], ["x"])}])
    write_leaf(tmp_path, "test", [{"A": (["short"], ["x"])}])
    ds = build_federated_dataset(DataConfig(dataset="shakespeare", root=str(tmp_path), partition="natural"), 0)
    with pytest.raises(ConfigError, match="strings of 80 characters"):
        ds.load_clients([0])
