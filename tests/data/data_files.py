"""Writers of tiny files in each real on-disk format, so loaders are tested against the formats themselves."""

from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path

import numpy as np


def write_idx(path: Path, array: np.ndarray, gz: bool = False) -> Path:
    """IDX: magic 0x0000 <type> <ndim>, big-endian uint32 dims, big-endian data."""
    codes = {np.dtype(np.uint8): 0x08, np.dtype(np.int32): 0x0C, np.dtype(np.float32): 0x0D}
    head = bytes([0, 0, codes[array.dtype], array.ndim]) + np.asarray(array.shape, ">u4").tobytes()
    payload = head + array.astype(array.dtype.newbyteorder(">")).tobytes()
    if gz:
        path = path.with_name(path.name + ".gz")
        path.write_bytes(gzip.compress(payload))
    else:
        path.write_bytes(payload)
    return path


def tagged_images(count: int, shape: tuple[int, ...]) -> np.ndarray:
    """uint8 images whose first two pixels spell their index, the rest pseudo-random: lets a test
    trace every loaded sample back to the file row it came from (see ``row_ids``)."""
    images = np.random.default_rng(count).integers(0, 256, (count, *shape), dtype=np.uint8)
    flat = images.reshape(count, -1)
    flat[:, 0], flat[:, 1] = np.arange(count) % 256, np.arange(count) // 256
    return images


def row_ids(x: np.ndarray, mean: float = 0.0, std: float = 1.0) -> np.ndarray:
    """The indices spelled by ``tagged_images`` in loaded (scaled, maybe normalized) samples."""
    pixels = np.rint((x.reshape(len(x), -1)[:, :2] * std + mean) * 255).astype(np.int64)
    return pixels[:, 0] + 256 * pixels[:, 1]


def write_mnist(root: Path, images: np.ndarray, labels: np.ndarray, n_train: int, gz: bool = False) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for split, rows in (("train", slice(0, n_train)), ("t10k", slice(n_train, None))):
        write_idx(root / f"{split}-images-idx3-ubyte", images[rows], gz)
        write_idx(root / f"{split}-labels-idx1-ubyte", labels[rows].astype(np.uint8), gz)


def dump_pickle(path: Path, obj: object) -> None:
    path.write_bytes(pickle.dumps(obj, protocol=2))


def write_leaf(root: Path, split: str, files: list[dict[str, tuple[list, list]]]) -> None:
    """LEAF JSON: one file per dict of ``{user: (x, y)}``."""
    (root / split).mkdir(parents=True, exist_ok=True)
    for i, users in enumerate(files):
        doc = {
            "users": list(users),
            "num_samples": [len(y) for _, y in users.values()],
            "user_data": {u: {"x": x, "y": y} for u, (x, y) in users.items()},
        }
        (root / split / f"part_{i}.json").write_text(json.dumps(doc))


def femnist_user(rng: np.random.Generator, count: int) -> tuple[list, list]:
    return rng.random((count, 784)).round(3).tolist(), rng.integers(0, 62, count).tolist()
