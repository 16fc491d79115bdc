"""LEAF datasets with their natural partition (one client per writer / speaking role): FEMNIST, Shakespeare.

LEAF's train split of a user gives its train and val rows (val = the last ``val_fraction``), its test
split gives the test rows; ``test_fraction`` does not apply. JSON has to be parsed whole, so the layout
parses every file once keeping only labels, and ``load_clients`` re-parses only the files that hold the
requested users.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpifl.data.base import (
    ClientSplit,
    FederatedDataset,
    FederatedLayout,
    Tag,
    empty_rows,
    image_transform,
    make_rng,
    padded_shape,
    require_training_samples,
    unseen_mask,
)
from mpifl.data.config import DataConfig
from mpifl.data.formats import Decoder, check_labels, leaf_files, read_leaf_file
from mpifl.data.partition import apportion
from mpifl.schema import ConfigError

# LEAF's ALL_LETTERS (models/utils/language_utils.py); a character outside it maps to UNKNOWN_CHAR.
SHAKESPEARE_LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
UNKNOWN_CHAR = len(SHAKESPEARE_LETTERS)
SHAKESPEARE_SEQ_LEN = 80
_ASCII_TO_INDEX = np.full(128, UNKNOWN_CHAR, dtype=np.int64)
_ASCII_TO_INDEX[[ord(ch) for ch in SHAKESPEARE_LETTERS]] = np.arange(len(SHAKESPEARE_LETTERS))


def encode_chars(text: str) -> np.ndarray:
    """Vocabulary indices of ``text``'s characters (UNKNOWN_CHAR for anything outside LEAF's 80)."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4").astype(np.int64)
    return np.where(codes < 128, _ASCII_TO_INDEX[np.minimum(codes, 127)], UNKNOWN_CHAR)


def _femnist_x(x: list, path: Path) -> np.ndarray:
    if not x:
        return empty_rows((1, 28, 28), np.float32)
    try:
        arr = np.asarray(x, dtype=np.float32).reshape(len(x), -1)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"data.root: {path}: FEMNIST 'x' rows must be lists of 784 numbers") from exc
    if arr.shape[1] != 28 * 28:
        raise ConfigError(f"data.root: {path}: FEMNIST 'x' rows have {arr.shape[1]} values, expected 784")
    if not np.isfinite(arr).all():
        raise ConfigError(f"data.root: {path}: FEMNIST 'x' contains NaN or Inf")
    return arr.reshape(-1, 1, 28, 28)


def _femnist_y(y: list, path: Path) -> np.ndarray:
    arr = np.asarray(y)
    if len(arr) and (arr.ndim != 1 or arr.dtype.kind not in "iu"):
        raise ConfigError(f"data.root: {path}: FEMNIST 'y' must be a list of integers")
    arr = arr.astype(np.int64)
    check_labels(arr, 62, path)
    return arr


def _chars(items: list, length: int, what: str, path: Path) -> np.ndarray:
    if not all(isinstance(s, str) and len(s) == length for s in items):
        raise ConfigError(f"data.root: {path}: Shakespeare {what} must be strings of {length} characters")
    return encode_chars("".join(items)).reshape(len(items), length)


def _shakespeare_x(x: list, path: Path) -> np.ndarray:
    return _chars(x, SHAKESPEARE_SEQ_LEN, "'x'", path)


def _shakespeare_y(y: list, path: Path) -> np.ndarray:
    return _chars(y, 1, "'y'", path)[:, 0]


@dataclass(frozen=True)
class LeafFormat:
    num_classes: int
    sample_shape: tuple[int, ...]
    input_dtype: str
    decode_x: Decoder
    decode_y: Decoder


LEAF_FORMATS = {
    "femnist": LeafFormat(62, (1, 28, 28), "float32", _femnist_x, _femnist_y),
    # the unknown-character index is a class of its own, so a target outside the vocabulary stays valid
    "shakespeare": LeafFormat(UNKNOWN_CHAR + 1, (SHAKESPEARE_SEQ_LEN,), "int64", _shakespeare_x, _shakespeare_y),
}


def _index(directory: Path, fmt: LeafFormat) -> tuple[list[Path], dict[str, tuple[int, np.ndarray]]]:
    """Files of one split and ``{user: (file number, labels)}``."""
    files = leaf_files(directory)
    index: dict[str, tuple[int, np.ndarray]] = {}
    for number, path in enumerate(files):
        for user, (_, y) in read_leaf_file(path, fmt.decode_y, None).items():
            if user in index:
                raise ConfigError(f"data.root: user {user!r} appears in both {files[index[user][0]]} and {path}")
            index[user] = (number, y)
    return files, index


class LeafDataset(FederatedDataset):
    """Clients are the LEAF users sorted by id (the first ``max_clients`` when set). Unseen clients are a
    seeded random choice of users (as PeFLL's code shuffles FEMNIST's writers), not the last ids: writer
    ids are ordered by how the data was collected."""

    def __init__(self, cfg: DataConfig, root: Path, seed: int):
        self.fmt = LEAF_FORMATS[cfg.dataset]
        self.pad_to = cfg.pad_to
        shape = padded_shape(self.fmt.sample_shape, cfg.pad_to, cfg.dataset)
        self.train_files, train_index = _index(root / "train", self.fmt)
        self.test_files, test_index = _index(root / "test", self.fmt)
        orphans = sorted(set(test_index) - set(train_index))
        if orphans:
            raise ConfigError(
                f"data.root: {root / 'test'}: {len(orphans)} users (first {orphans[0]!r}) have no train data; "
                "expected LEAF's per-sample split (every user in both train and test)"
            )
        self.users = sorted(train_index)[: cfg.max_clients]
        self.train_where: list[int | None] = [train_index[u][0] for u in self.users]
        self.test_where = [test_index[u][0] if u in test_index else None for u in self.users]
        sizes = np.array([len(train_index[u][1]) for u in self.users], dtype=np.int64)
        self.train_sizes = sizes - apportion(sizes[:, None], cfg.val_fraction)[:, 0]
        require_training_samples(self.train_sizes, f"LEAF users with {sizes.min()} to {sizes.max()} train samples")
        labels = [train_index[u][1][:t] for u, t in zip(self.users, self.train_sizes, strict=True)]
        class_counts = np.stack([np.bincount(y, minlength=self.fmt.num_classes) for y in labels])
        self.layout = FederatedLayout(
            num_clients=len(self.users),
            train_sizes=self.train_sizes,
            unseen=unseen_mask(len(self.users), cfg.unseen_fraction, make_rng(seed, Tag.UNSEEN)),
            input_shape=shape,
            num_classes=self.fmt.num_classes,
            task="classification",
            input_dtype=self.fmt.input_dtype,
            class_counts=class_counts.astype(np.int64),
        )

    def _read(self, files: list[Path], where: list[int | None], client_ids: list[int]) -> dict[int, tuple]:
        wanted: dict[int, list[int]] = defaultdict(list)
        for c in client_ids:
            number = where[c]
            if number is not None:
                wanted[number].append(c)
        found = {}
        for number, clients in sorted(wanted.items()):
            data = read_leaf_file(files[number], self.fmt.decode_y, self.fmt.decode_x, {self.users[c] for c in clients})
            found.update({c: data[self.users[c]] for c in clients})
        return found

    def _x(self, x: np.ndarray) -> np.ndarray:
        return image_transform(x, None, None, self.pad_to) if x.ndim == 4 else x

    def _load(self, client_ids: list[int]) -> dict[int, ClientSplit]:
        train = self._read(self.train_files, self.train_where, client_ids)
        test = self._read(self.test_files, self.test_where, client_ids)
        nothing = (empty_rows(self.fmt.sample_shape, np.dtype(self.fmt.input_dtype)), np.zeros(0, np.int64))
        out = {}
        for c in client_ids:
            (x, y), t = train[c], self.train_sizes[c]
            x_test, y_test = test.get(c, nothing)
            out[c] = ClientSplit(self._x(x[:t]), y[:t], self._x(x[t:]), y[t:], self._x(x_test), y_test)
        return out
