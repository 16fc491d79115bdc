"""Pooled image datasets (digits, MNIST, Fashion-MNIST, CIFAR-10/100): one labelled pool, split by a partitioner.

The official train and test sets are pooled so that each client's test split is drawn from its own
class mix. Building reads labels only; pixels are read in ``load_clients``, for the requested rows.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpifl import plugins
from mpifl.data.base import (
    ClientSplit,
    FederatedDataset,
    FederatedLayout,
    Tag,
    dataset_root,
    image_transform,
    make_rng,
    padded_shape,
    require_training_samples,
    unseen_mask,
)
from mpifl.data.config import DATASETS, DataConfig
from mpifl.data.formats import IDX_IMAGES_MAGIC, IDX_LABELS_MAGIC, IdxFile, check_labels, find_file, read_cifar_batch
from mpifl.data.partition import partition_counts, split_counts
from mpifl.schema import ConfigError

FASHION_MNIST_DEFAULT_ROOT = "/usr/share/datasets/fashion-mnist"  # Debian package dataset-fashion-mnist

_NORMALIZATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashion_mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)),  # PeFLL's constants
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "svhn": ((0.4377, 0.4438, 0.4728), (0.1980, 0.2010, 0.1970)),
}


@dataclass(frozen=True)
class Part:
    """A contiguous run of pool indices backed by one file (or array)."""

    size: int
    read: Callable[[np.ndarray], np.ndarray]  # local rows -> float32 [k, *sample_shape] in [0, 1]
    cheap_rows: bool = False  # reading a few rows costs a few rows (memory, memory-mapped file), not the file


@dataclass(frozen=True)
class Pool:
    labels: np.ndarray  # int64 [N]
    num_classes: int
    sample_shape: tuple[int, ...]
    parts: tuple[Part, ...]
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None

    def read(self, indices: np.ndarray) -> np.ndarray:
        """Raw [0,1] images of pool ``indices``, touching only the parts that hold them."""
        out = np.empty((len(indices), *self.sample_shape), dtype=np.float32)
        lo = 0
        for part in self.parts:
            mask = (indices >= lo) & (indices < lo + part.size)
            if mask.any():
                out[mask] = part.read(indices[mask] - lo)
            lo += part.size
        return out


# --------------------------------------------------------------------------------- sources


def digits_file() -> Path:
    """scikit-learn's bundled digits (digits.csv.gz: 64 pixels in 0..16, then the label, per row), found without
    importing scikit-learn, which costs ≈ 1 s of a small job's start (it imports scipy.stats and pandas)."""
    spec = importlib.util.find_spec("sklearn")
    path = Path(spec.submodule_search_locations[0], "datasets", "data", "digits.csv.gz") if (
        spec and spec.submodule_search_locations) else None
    if path is None or not path.is_file():
        raise ConfigError(f"data.dataset: digits is scikit-learn's bundled file, not found ({path or 'no sklearn'}): "
                          "pip install scikit-learn")
    return path


def digits_pool(cfg: DataConfig) -> Pool:
    """scikit-learn's bundled 8x8 digits (offline), as its load_digits reads them; normalized with their own
    global mean/std."""
    with gzip.open(digits_file(), "rt") as file:
        table = np.loadtxt(file, delimiter=",")
    images = (table[:, :-1].reshape(-1, 1, 8, 8) / 16.0).astype(np.float32)
    stats = ((float(images.mean()),), (float(images.std()),)) if cfg.normalize else (None, None)
    part = Part(len(images), lambda rows: images[rows], cheap_rows=True)
    return Pool(table[:, -1].astype(np.int64), 10, (1, 8, 8), (part,), *stats)


def idx_pool(cfg: DataConfig) -> Pool:
    """MNIST / Fashion-MNIST IDX files (optionally gzipped): train pooled with t10k."""
    default = FASHION_MNIST_DEFAULT_ROOT if cfg.dataset == "fashion_mnist" else None
    root = dataset_root(cfg, "the IDX files", default, "install Debian's dataset-fashion-mnist")
    labels, parts, shapes = [], [], set()
    for split in ("train", "t10k"):
        label_file = IdxFile(find_file(root, [f"{split}-labels-idx1-ubyte"], f"{split} labels"), IDX_LABELS_MAGIC)
        image_file = IdxFile(find_file(root, [f"{split}-images-idx3-ubyte"], f"{split} images"), IDX_IMAGES_MAGIC)
        y = label_file.read_all().astype(np.int64)
        if image_file.shape[0] != len(y):
            raise ConfigError(
                f"data.root: {image_file.path} holds {image_file.shape[0]} images but {label_file.path} {len(y)} labels"
            )
        check_labels(y, 10, label_file.path)
        labels.append(y)
        shapes.add(image_file.shape[1:])
        parts.append(Part(len(y), functools.partial(_idx_rows, image_file),
                          cheap_rows=image_file.path.suffix != ".gz"))
    if len(shapes) != 1:
        raise ConfigError(f"data.root: {root}: train and t10k images differ in size {sorted(shapes)}")
    stats = _NORMALIZATION[cfg.dataset] if cfg.normalize else (None, None)
    return Pool(np.concatenate(labels), 10, (1, *shapes.pop()), tuple(parts), *stats)


def cifar_pool(cfg: DataConfig) -> Pool:
    """CIFAR python-pickle batches, train pooled with test; ``root`` is the batch directory or its parent."""
    if cfg.dataset == "cifar10":
        folder, files, key, num_classes = "cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], b"labels", 10
        files.append("test_batch")
    else:
        folder, files, key, num_classes = "cifar-100-python", ["train", "test"], b"fine_labels", 100
    root = dataset_root(cfg, f"{folder}/ or its parent")
    if not (root / files[0]).exists():
        if not (root / folder).is_dir():
            raise ConfigError(f"data.root: {root}: neither a {folder} directory (no {files[0]}) nor its parent")
        root = root / folder
    labels, parts = [], []
    for name in files:
        path = root / name
        y = read_cifar_batch(path, key, num_classes)[1]
        labels.append(y)
        parts.append(Part(len(y), functools.partial(_cifar_rows, path, key, num_classes)))
    stats = _NORMALIZATION[cfg.dataset] if cfg.normalize else (None, None)
    return Pool(np.concatenate(labels), num_classes, (3, 32, 32), tuple(parts), *stats)


def svhn_pool(cfg: DataConfig) -> Pool:
    """SVHN's cropped-digit MATLAB files ``train_32x32.mat`` and ``test_32x32.mat`` (X: 32×32×3×N uint8,
    y: N×1 with label 10 meaning digit 0), train pooled with test."""
    root = dataset_root(cfg, "train_32x32.mat and test_32x32.mat")
    labels, parts = [], []
    for name in ("train_32x32.mat", "test_32x32.mat"):
        path = root / name
        y = _svhn_mat(path, "y").reshape(-1).astype(np.int64) % 10
        labels.append(y)
        parts.append(Part(len(y), functools.partial(_svhn_rows, path)))
    stats = _NORMALIZATION["svhn"] if cfg.normalize else (None, None)
    return Pool(np.concatenate(labels), 10, (3, 32, 32), tuple(parts), *stats)


def plugin_pool(cfg: DataConfig, seed: int) -> Pool:
    """A dataset plug-in's pool: its loader, called with the data config and the run's seed, returns
    ``(features, labels)``: features [N, *sample_shape] (any real dtype, read as float32; a memory-mapped
    array is read row by row, so each rank reads only its clients' rows), labels [N] integers 0..K-1.
    mpifl partitions them like a built-in pool and does not rescale them (``data.normalize`` is the
    plug-in's to honour)."""
    where = f"data.dataset: plug-in {cfg.dataset!r}"
    arrays = plugins.resolve(plugins.DATASETS, cfg.dataset, DATASETS)(cfg, seed)
    if not (isinstance(arrays, (tuple, list)) and len(arrays) == 2):
        raise ConfigError(f"{where} must return (features, labels), got {type(arrays).__name__}")
    x, y = (a if isinstance(a, np.ndarray) else np.asarray(a) for a in arrays)
    if x.ndim < 2 or x.dtype.kind not in "biuf" or len(x) == 0:
        raise ConfigError(f"{where}: features must be a real array [N, *sample_shape] with N > 0, got "
                          f"{x.dtype} {x.shape}")
    if y.shape != (len(x),) or y.dtype.kind not in "iu":
        raise ConfigError(f"{where}: labels must be integers of shape ({len(x)},), got {y.dtype} {y.shape}")
    if y.min() < 0 or y.max() < 1:
        raise ConfigError(f"{where}: labels must be class ids 0..K-1 with K >= 2, found {y.min()}..{y.max()}")
    part = Part(len(x), lambda rows: np.asarray(x[rows], dtype=np.float32), cheap_rows=True)
    return Pool(y.astype(np.int64), int(y.max()) + 1, tuple(x.shape[1:]), (part,))


def _svhn_mat(path: Path, name: str) -> np.ndarray:
    from scipy.io import loadmat

    if not path.is_file():
        raise ConfigError(f"data.root: {path} does not exist (SVHN needs train_32x32.mat and test_32x32.mat)")
    try:
        value = loadmat(path, variable_names=[name]).get(name)
    except Exception as exc:  # noqa: BLE001 - scipy raises many types for damaged files
        raise ConfigError(f"data.root: {path} is not a readable SVHN .mat file ({type(exc).__name__})") from None
    bad_labels = name == "y" and value is not None and (value.ndim != 2 or not np.isin(value, range(1, 11)).all())
    if value is None or bad_labels:
        raise ConfigError(f"data.root: {path} has no valid {name!r} variable (SVHN labels are 1..10)")
    if name == "X" and (value.ndim != 4 or value.shape[:3] != (32, 32, 3)):
        raise ConfigError(f"data.root: {path}: X has shape {value.shape}, expected 32×32×3×N")
    return value


def _svhn_rows(path: Path, rows: np.ndarray) -> np.ndarray:
    images = _svhn_mat(path, "X")
    if images.shape[3] <= rows.max(initial=-1):
        raise ConfigError(f"data.root: {path}: X holds {images.shape[3]} images, fewer than its labels")
    return (images[..., rows].transpose(3, 2, 0, 1) / 255.0).astype(np.float32)


def _idx_rows(images: IdxFile, rows: np.ndarray) -> np.ndarray:
    """IDX images of ``rows`` as float32 [k, 1, H, W] in [0, 1]."""
    return (images.read_rows(rows)[:, None] / 255.0).astype(np.float32)


def _cifar_rows(path: Path, key: bytes, num_classes: int, rows: np.ndarray) -> np.ndarray:
    return (read_cifar_batch(path, key, num_classes)[0][rows] / 255.0).astype(np.float32)


# --------------------------------------------------------------------------------- dataset


class PooledDataset(FederatedDataset):
    """Clients' class counts come from the partitioner; client i's samples of class c are the
    ``counts[i, c]`` consecutive entries of a shuffled copy of class c, cut in client order, so no
    sample goes to two clients. Each client's samples of a class are then dealt test, val, train."""

    def __init__(self, cfg: DataConfig, seed: int, pool: Pool):
        self.pool, self.seed, self.pad_to = pool, seed, cfg.pad_to
        self.cheap_clients = all(part.cheap_rows for part in pool.parts)
        shape = padded_shape(pool.sample_shape, cfg.pad_to, cfg.dataset)
        totals = np.bincount(pool.labels, minlength=pool.num_classes)
        counts = partition_counts(cfg, totals, make_rng(seed, Tag.PARTITION))
        self.splits = split_counts(counts, cfg.test_fraction, cfg.val_fraction)  # (train, val, test)
        require_training_samples(self.splits[0].sum(1), f"partition {cfg.partition!r} of {len(pool.labels)} samples")
        keys = make_rng(seed, Tag.POOL_ORDER).random(len(pool.labels))
        self.order = np.lexsort((keys, pool.labels))  # sorted by class, random within class
        self.start = np.concatenate([[0], np.cumsum(totals)[:-1]]) + np.cumsum(counts, axis=0) - counts
        self.layout = FederatedLayout(
            num_clients=cfg.num_clients,
            train_sizes=self.splits[0].sum(1),
            unseen=unseen_mask(cfg.num_clients, cfg.unseen_fraction),
            input_shape=shape,
            num_classes=pool.num_classes,
            task="classification",
            input_dtype="float32",
            class_counts=self.splits[0],
        )

    def indices(self, client: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Pool indices of ``client``'s (train, val, test), each in a fixed per-client shuffled order."""
        rng = make_rng(self.seed, Tag.SPLIT_ORDER, client)
        train, val, test = (s[client] for s in self.splits)
        cuts = self.start[client] + np.cumsum([test, val, train], axis=0)  # [3, C] ends of each split per class
        begins = np.vstack([self.start[client], cuts[:-1]])
        out = [
            self.order[np.concatenate([np.arange(b, e) for b, e in zip(bs, es, strict=True)])]
            for bs, es in zip(begins, cuts, strict=True)
        ]
        test_idx, val_idx, train_idx = (rng.permutation(ix) for ix in out)
        return train_idx, val_idx, test_idx

    def _load(self, client_ids: list[int]) -> dict[int, ClientSplit]:
        per_client = [self.indices(c) for c in client_ids]
        flat = np.concatenate([ix for split in per_client for ix in split]).astype(np.int64)
        x = image_transform(self.pool.read(flat), self.pool.mean, self.pool.std, self.pad_to)
        y = self.pool.labels[flat]
        out, pos = {}, 0
        for client, split in zip(client_ids, per_client, strict=True):
            arrays = []
            for ix in split:
                arrays += [x[pos : pos + len(ix)], y[pos : pos + len(ix)]]
                pos += len(ix)
            out[client] = ClientSplit(*arrays)
        return out
