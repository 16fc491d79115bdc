"""The shapes every dataset hands to the runtime, and the few helpers all loaders share."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import DTypeLike

from mpifl.data.config import DataConfig
from mpifl.schema import ConfigError


class Tag(enum.IntEnum):
    """Fixed stream tags: each random decision draws from ``SeedSequence([seed, tag, ...])`` so that
    no two decisions share a stream and none depends on call order or global state."""

    PARTITION = 1
    POOL_ORDER = 2
    SPLIT_ORDER = 3
    GAUSS_MEANS = 4
    GAUSS_SAMPLES = 5
    LEAF_SYNTHETIC = 6
    RIDGE_SIZES = 7
    RIDGE_THETA = 8
    RIDGE_SAMPLES = 9
    GAUSS_SIZES = 10
    UNSEEN = 11


def make_rng(seed: int, *keys: int) -> np.random.Generator:
    """The generator of one random decision, keyed by the run seed and fixed tags/ids."""
    return np.random.default_rng(np.random.SeedSequence([seed, *(int(k) for k in keys)]))


@dataclass(frozen=True, eq=False)
class ClientSplit:
    """One client's arrays. ``x`` is float32 (images N×C×H×W, tabular N×F) or int64 token
    sequences; ``y`` is int64 class labels or float32 regression targets."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


@dataclass(frozen=True, eq=False)
class FederatedLayout:
    """Cheap metadata, identical on every rank: enough to place clients and build models
    without touching any client's samples."""

    num_clients: int
    train_sizes: np.ndarray  # int64 [num_clients]
    unseen: np.ndarray  # bool [num_clients]; True = never trains, only evaluated
    input_shape: tuple[int, ...]
    num_classes: int  # 0 for regression
    task: str  # "classification" | "regression"
    input_dtype: str  # "float32" | "int64"
    class_counts: np.ndarray  # int64 [num_clients, num_classes] training-label histogram
    # the data brings its own validation rows (data.prepared written elsewhere); otherwise data.val_fraction says
    has_val: bool = False

    def __post_init__(self) -> None:
        for name in ("train_sizes", "unseen", "class_counts"):
            getattr(self, name).setflags(write=False)  # shared metadata: nobody may edit it in place


class FederatedDataset(ABC):
    """A dataset split over clients; holds the layout and materializes clients on demand, so an
    MPI worker only ever pays for the clients it hosts."""

    layout: FederatedLayout
    generated = False  # True: samples come from a generator (nothing on disk), cheap to make on first use
    # True: materializing one client costs about its own samples (not re-reading a compressed file or a
    # whole pickle), so a worker may read different clients every round (dynamic placement)
    cheap_clients = False

    def load_clients(self, client_ids: Sequence[int]) -> dict[int, ClientSplit]:
        """The splits of ``client_ids`` (duplicates collapse), keyed by client id."""
        ids = list(dict.fromkeys(int(c) for c in client_ids))
        bad = [c for c in ids if not 0 <= c < self.layout.num_clients]
        if bad:
            raise ValueError(f"client ids {bad[:5]} out of range [0, {self.layout.num_clients})")
        return self._load(ids) if ids else {}

    @abstractmethod
    def _load(self, client_ids: list[int]) -> dict[int, ClientSplit]:
        """Materialize exactly these (valid, distinct) clients."""


def unseen_mask(num_clients: int, unseen_fraction: float, rng: np.random.Generator | None = None) -> np.ndarray:
    """The ``round(fraction·n)`` clients that never train: PeFLL's convention, the last client ids, where
    client ids are already random (a partition of pooled data); a choice drawn from ``rng`` where they are
    not (LEAF's writers)."""
    n_unseen = int(round(unseen_fraction * num_clients))
    if n_unseen >= num_clients:
        raise ConfigError(f"data.unseen_fraction: {unseen_fraction} of {num_clients} clients leaves no seen client")
    mask = np.zeros(num_clients, dtype=bool)
    if rng is None:
        mask[num_clients - n_unseen :] = True
    else:
        mask[rng.choice(num_clients, n_unseen, replace=False)] = True
    return mask


def require_training_samples(train_sizes: np.ndarray, detail: str) -> None:
    """Every client must be able to train: an empty client is an impossible request, not a corner case."""
    empty = np.flatnonzero(train_sizes == 0)
    if len(empty):
        raise ConfigError(
            f"data.num_clients: {len(empty)} of {len(train_sizes)} clients (first: client {empty[0]}) would get "
            f"0 training samples ({detail}); use fewer clients or a different partition"
        )


def dataset_root(cfg: DataConfig, contents: str, default: str | None = None, install: str | None = None) -> Path:
    """``cfg.root`` (or ``default``) as an existing directory, else a ConfigError saying what belongs there."""
    if cfg.root is None and default is None:
        raise ConfigError(f"data.root: dataset {cfg.dataset!r} needs data.root, the directory holding {contents}")
    root = Path(cfg.root if cfg.root is not None else str(default)).expanduser()
    if not root.is_dir():
        hint = f"; set data.root or {install}" if cfg.root is None and install else ""
        raise ConfigError(f"data.root: {root} is not a directory holding {contents} (dataset {cfg.dataset!r}){hint}")
    return root


def image_transform(
    x: np.ndarray, mean: Sequence[float] | None, std: Sequence[float] | None, pad_to: int | None
) -> np.ndarray:
    """Zero-pad raw [0,1] images symmetrically to ``pad_to`` (black border, as torchvision's Pad
    before ToTensor/Normalize), then normalize per channel when constants are given."""
    if pad_to is not None:
        h, w = x.shape[-2:]
        top, left = (pad_to - h) // 2, (pad_to - w) // 2
        x = np.pad(x, ((0, 0), (0, 0), (top, pad_to - h - top), (left, pad_to - w - left)))
    if mean is not None and std is not None:
        shape = (1, len(mean), 1, 1)
        x = (x - np.asarray(mean, np.float32).reshape(shape)) / np.asarray(std, np.float32).reshape(shape)
    return np.ascontiguousarray(x, dtype=np.float32)


def padded_shape(shape: tuple[int, ...], pad_to: int | None, dataset: str) -> tuple[int, ...]:
    """The per-sample shape after padding; refuses padding that would crop or that has no image to pad."""
    if pad_to is None:
        return shape
    if len(shape) != 3:
        raise ConfigError(f"data.pad_to: {dataset} samples are not images (shape {shape}); leave pad_to unset")
    if pad_to < max(shape[1:]):
        raise ConfigError(f"data.pad_to: {pad_to} is smaller than the {shape[1]}x{shape[2]} images of {dataset}")
    return (shape[0], pad_to, pad_to)


def empty_rows(shape: tuple[int, ...], dtype: DTypeLike) -> np.ndarray:
    """A 0-row array with the right trailing shape, so empty splits still stack and batch."""
    return np.zeros((0, *shape), dtype=dtype)
