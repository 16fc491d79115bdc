"""Federated data already split into clients (``data.prepared``): one HDF5 file or a directory of ``.npz``.

The format is documented in docs/reference/data-format.md. ``mpifl prepare CONFIG --out DATA.h5`` writes it from any
config's ``data:`` section (bitwise the loader's clients, plus a fingerprint of the data settings and seed,
checked when present); users write it from data they partitioned themselves (no fingerprint: the clients,
splits and unseen flags are the file's, so data settings that would change them are refused). Every rank
checks the whole source before training, reading only labels and array headers; a worker then reads only
its clients, each at about the cost of its own rows, so stateless algorithms can balance every round
(``placement: auto``) even on data whose original files are costly to read (gzipped IDX, CIFAR pickles).
"""

from __future__ import annotations

import contextlib
import json
import numbers
import zipfile
from abc import abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import yaml
from numpy.lib import format as npy

from mpifl.data.base import ClientSplit, FederatedDataset, FederatedLayout, empty_rows
from mpifl.data.config import DataConfig
from mpifl.results.space import written_hdf5
from mpifl.schema import ConfigError, to_dict

FORMAT = "mpifl-federated-1"
SPLITS = ("train", "val", "test")
REQUIRED_SPLITS = ("train", "test")
TASKS = ("classification", "regression")
META_KEYS = ("task", "num_classes")  # declared by HDF5 root attributes, or meta.json in an .npz directory
ARRAY_KEYS = tuple(f"{kind}_{split}" for split in SPLITS for kind in ("x", "y"))
_BATCH_CLIENTS = 1000  # clients materialized at a time while preparing


def fingerprint(cfg: DataConfig, seed: int) -> str:
    """What decides every client's arrays: the data section and the seed (not where the original files
    are, nor the prepared file itself)."""
    settings = to_dict(cfg)
    settings.pop("prepared")
    settings.pop("root")
    return yaml.safe_dump({"data": settings, "seed": int(seed)}, sort_keys=True)


def is_prepared(path: Path) -> bool:
    """Whether ``path`` holds a dataset ``mpifl prepare`` wrote (the only file ``prepare --overwrite`` replaces)."""
    try:
        with h5py.File(path, "r", locking=False) as f:
            return f.attrs.get("format") == FORMAT
    except OSError:
        return False


def temporary_name(path: Path) -> Path:
    """The name a prepared file is written under until it is complete."""
    return path.with_name(f".{path.name}.tmp")


def prepare(dataset: FederatedDataset, cfg: DataConfig, seed: int, path: str | Path) -> None:
    """Write every client of ``dataset`` to ``path`` in the documented HDF5 layout, with the fingerprint of
    ``cfg`` and ``seed`` (through a temporary name: never half-written)."""
    path = Path(path)
    layout = dataset.layout
    path.parent.mkdir(parents=True, exist_ok=True)
    with written_hdf5(path, "the prepared data file", temporary_name(path)) as f:  # full: one line, no part
        f.attrs.update(format=FORMAT, fingerprint=fingerprint(cfg, seed), task=layout.task)
        if layout.task == "classification":
            f.attrs["num_classes"] = layout.num_classes
        f.create_dataset("unseen", data=layout.unseen)
        offsets = {split: [0] for split in SPLITS}
        for start in range(0, layout.num_clients, _BATCH_CLIENTS):
            clients = dataset.load_clients(range(start, min(start + _BATCH_CLIENTS, layout.num_clients)))
            for split in SPLITS:
                for kind in ("x", "y"):
                    _append(f, f"{kind}_{split}", np.concatenate([getattr(clients[c], f"{kind}_{split}")
                                                                 for c in sorted(clients)]))
                sizes = [len(getattr(clients[c], f"y_{split}")) for c in sorted(clients)]
                offsets[split] += list(offsets[split][-1] + np.cumsum(sizes))
        for split in SPLITS:
            f.create_dataset(f"offsets_{split}", data=np.array(offsets[split], dtype=np.int64))


def _append(f: h5py.File, name: str, rows: np.ndarray) -> None:
    if name not in f:
        row_bytes = max(rows[:1].nbytes, 1)
        f.create_dataset(name, data=rows, maxshape=(None, *rows.shape[1:]),
                         chunks=(max(1, 65536 // row_bytes), *rows.shape[1:]))
        return
    data = f[name]
    data.resize(len(data) + len(rows), axis=0)
    data[len(data) - len(rows):] = rows


def open_prepared(cfg: DataConfig, seed: int) -> FederatedDataset:
    """The source ``data.prepared`` names: a directory is read as ``.npz`` clients, anything else as HDF5."""
    path = Path(str(cfg.prepared)).expanduser()
    if path.is_dir():
        return NpzClients(path, cfg, seed)
    if not path.exists():
        raise ConfigError(f"data.prepared: {path} does not exist (an HDF5 file or a directory of .npz files, "
                          "see docs/reference/data-format.md)")
    return Hdf5Clients(path, cfg, seed)


@dataclass(frozen=True)
class _Split:
    """One split of every client, as the checks see it (labels, never feature rows)."""

    sizes: np.ndarray  # int64 [num_clients]: rows per client
    labels: np.ndarray  # every client's y, concatenated in client order
    shape: tuple[int, ...]  # one sample's x shape
    x_dtype: np.dtype
    y_dtype: np.dtype


class _ClientArrays(FederatedDataset):
    """What both layouts share: where the data comes from, its checks, its layout, and the conversion of
    read arrays into a client's splits (so both layouts give bitwise the same clients for the same arrays)."""

    cheap_clients = True

    def __init__(self, path: Path):
        self.path = path

    @abstractmethod
    def _client(self, c: int) -> str:
        """How errors name client ``c``."""

    def _error(self, problem: str) -> ConfigError:
        return ConfigError(f"data.prepared: {self.path}: {problem}")

    @contextlib.contextmanager
    def _reading(self, c: int) -> Iterator[None]:
        """Reading client ``c``'s rows: a damaged file is one line naming the client (the runtime reads every
        client once at start-up, so this comes before training)."""
        try:
            yield
        except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as exc:
            raise self._error(f"{self._client(c)}: cannot read its rows ({exc})") from None

    def _check_origin(self, found: str | None, cfg: DataConfig, seed: int) -> None:
        """A fingerprint must be that of this config's data settings and seed; without one the data was
        written elsewhere, and no data setting may pretend to shape it."""
        if found is not None:
            if found != fingerprint(cfg, seed):
                raise ConfigError(f"data.prepared: {self.path} was prepared for other data settings or seed; "
                                  "run `mpifl prepare` with this config")
            return
        given, default = to_dict(cfg), to_dict(DataConfig())
        changed = [key for key in given if key != "prepared" and given[key] != default[key]]
        if changed:
            raise ConfigError(f"data.{changed[0]}: does not apply to data.prepared {self.path}, whose clients, "
                              "splits and unseen flags were written elsewhere (no `mpifl prepare` fingerprint); "
                              "remove it")

    def _meta(self, meta: dict[str, Any]) -> tuple[str, int | None]:
        unknown = sorted(set(meta) - set(META_KEYS))
        if unknown:
            raise self._error(f"unknown metadata {', '.join(unknown)} (known: {', '.join(META_KEYS)})")
        task, classes = meta.get("task", "classification"), meta.get("num_classes")
        if task not in TASKS:
            raise self._error(f"task {task!r} is not one of {', '.join(TASKS)}")
        if classes is None:
            return str(task), None
        if task == "regression":
            raise self._error("num_classes is declared for a regression task")
        if isinstance(classes, (bool, np.bool_)) or not isinstance(classes, numbers.Integral) or classes < 2:
            raise self._error(f"num_classes must be an integer >= 2, got {classes!r}")
        return str(task), int(classes)

    def _layout(self, meta: dict[str, Any], splits: dict[str, _Split], unseen: np.ndarray) -> FederatedLayout:
        """Check what no single client shows (splits agree, labels fit the task, every seen client trains)
        and describe the data."""
        task, num_classes = self._meta(meta)
        train = splits["train"]
        kinds = "f" if task == "regression" else "iu"
        for name, split in splits.items():
            if (split.shape, split.x_dtype, split.y_dtype) != (train.shape, train.x_dtype, train.y_dtype):
                raise self._error(f"x_{name}/y_{name} hold {_signature(split)}, x_train/y_train {_signature(train)}; "
                                  "every split needs the same sample shape and dtypes")
            if split.y_dtype.kind not in kinds:
                need = "floating-point targets" if task == "regression" else \
                    "integer labels (or declare task: regression)"
                raise self._error(f"y_{name} is {split.y_dtype}; a {task} task needs {need}")
        if train.x_dtype.kind not in "fiu":
            raise self._error(f"x arrays are {train.x_dtype}; expected floating-point features or integer tokens")
        if task == "classification":
            num_classes = self._check_labels(splits, num_classes)
        seen = ~unseen
        idle = np.flatnonzero(seen & (train.sizes == 0))
        if len(idle):
            raise self._error(f"{self._client(int(idle[0]))} has no training rows and is not unseen")
        if not seen.any():
            raise self._error("every client is unseen; at least one must train")
        n = len(unseen)
        counts = np.zeros((n, 0), dtype=np.int64)
        if num_classes:
            owner = np.repeat(np.arange(n), train.sizes)
            cells = owner * num_classes + train.labels.astype(np.int64)
            counts = np.bincount(cells, minlength=n * num_classes).reshape(n, -1)
        val = splits.get("val")
        return FederatedLayout(
            num_clients=n, train_sizes=train.sizes, unseen=unseen, input_shape=train.shape,
            num_classes=num_classes or 0, task=task, input_dtype="float32" if train.x_dtype.kind == "f" else "int64",
            class_counts=counts.astype(np.int64), has_val=val is not None and bool(val.sizes.sum()))

    def _check_labels(self, splits: dict[str, _Split], declared: int | None) -> int:
        """Labels lie in [0, num_classes); num_classes defaults to the largest label + 1."""
        num_classes = declared or 1 + max(int(s.labels.max(initial=0)) for s in splits.values())
        for name, split in splits.items():
            bad = np.flatnonzero((split.labels < 0) | (split.labels >= num_classes))
            if len(bad):
                client = int(np.searchsorted(np.cumsum(split.sizes), bad[0], side="right"))
                raise self._error(f"{self._client(client)}: label {split.labels[bad[0]]} in y_{name} is outside "
                                  f"[0, {num_classes}) (num_classes {'declared' if declared else 'from the labels'})")
        if num_classes < 2:
            raise self._error("every label is 0; classification needs at least 2 classes (declare num_classes)")
        return num_classes

    def _client_split(self, arrays: dict[str, np.ndarray]) -> ClientSplit:
        """One client's arrays in the runtime's dtypes; an absent split has no rows."""
        layout = self.layout
        y_dtype = np.float32 if layout.task == "regression" else np.int64
        out = []
        for split in SPLITS:
            x, y = arrays.get(f"x_{split}"), arrays.get(f"y_{split}")
            out += [np.ascontiguousarray(x if x is not None else empty_rows(layout.input_shape, layout.input_dtype),
                                         dtype=layout.input_dtype),
                    np.ascontiguousarray(y if y is not None else empty_rows((), y_dtype), dtype=y_dtype)]
        return ClientSplit(*out)


def _signature(split: _Split) -> str:
    return f"{split.x_dtype} samples of shape {split.shape} with {split.y_dtype} labels"


def _flags(values: np.ndarray) -> np.ndarray | None:
    """``values`` as booleans if they are booleans or 0/1 integers, else None."""
    if values.dtype.kind == "b":
        return values.astype(bool)
    if values.dtype.kind in "iu" and np.isin(values, (0, 1)).all():
        return values.astype(bool)
    return None


class Hdf5Clients(_ClientArrays):
    """One HDF5 file: each split's rows of all clients in one array, client ``c`` at rows
    ``offsets_<split>[c]:offsets_<split>[c+1]`` (a slice: cheap for any client)."""

    def __init__(self, path: Path, cfg: DataConfig, seed: int):
        super().__init__(path)
        try:
            with h5py.File(path, "r") as f:
                if f.attrs.get("format") != FORMAT:
                    raise self._error(f"attribute format is {f.attrs.get('format')!r}, expected {FORMAT!r} "
                                      "(see docs/reference/data-format.md)")
                unknown = sorted(set(f.attrs) - {"format", "fingerprint", *META_KEYS}) + sorted(
                    set(f) - {*ARRAY_KEYS, *(f"offsets_{s}" for s in SPLITS), "unseen"})
                if unknown:
                    raise self._error(f"unknown keys {', '.join(unknown)} (see docs/reference/data-format.md)")
                self._check_origin(f.attrs.get("fingerprint"), cfg, seed)
                meta = {key: f.attrs[key] for key in META_KEYS if key in f.attrs}
                self.offsets, splits = self._splits(f)
                unseen = self._unseen(f)
        except OSError as exc:
            raise self._error(f"cannot read it as HDF5 ({exc})") from None
        self.layout = self._layout(meta, splits, unseen)
        self.file: h5py.File | None = None  # opened on first read, kept for the run

    def _client(self, c: int) -> str:
        return f"client {c}"

    def _splits(self, f: h5py.File) -> tuple[dict[str, np.ndarray], dict[str, _Split]]:
        """Each present split's offsets and description; train and test must be there."""
        offsets: dict[str, np.ndarray] = {}
        splits: dict[str, _Split] = {}
        for split in SPLITS:
            keys = [f"{kind}_{split}" for kind in ("x", "y", "offsets")]
            missing = [key for key in keys if not isinstance(f.get(key), h5py.Dataset)]
            if split not in REQUIRED_SPLITS and len(missing) == len(keys):
                continue
            if missing:
                raise self._error(f"missing {', '.join(missing)} (the {split} split needs {', '.join(keys)})")
            clients = len(offsets["train"]) - 1 if offsets else 0
            x, y, offsets[split] = f[keys[0]], f[keys[1]][()], self._offsets(f[keys[2]][()], split, clients)
            if len(x.shape) < 2 or y.ndim != 1 or len(x) != len(y) or offsets[split][-1] != len(y):
                raise self._error(f"x_{split} has shape {x.shape}, y_{split} {y.shape} and offsets_{split} ends at "
                                  f"{offsets[split][-1]}; a split is N samples (x at least 2-D) with N labels, and "
                                  "its offsets end at N")
            splits[split] = _Split(np.diff(offsets[split]), y, tuple(x.shape[1:]), x.dtype, y.dtype)
        return offsets, splits

    def _offsets(self, offsets: np.ndarray, split: str, clients: int) -> np.ndarray:
        """Client c's rows are offsets[c]:offsets[c+1]; every split has the same number of clients."""
        if offsets.ndim != 1 or offsets.dtype.kind not in "iu" or len(offsets) < 2 or offsets[0] != 0 \
                or (np.diff(offsets.astype(np.int64)) < 0).any():
            raise self._error(f"offsets_{split} must be 1-D integers rising from 0, one per client plus one")
        if clients and len(offsets) != clients + 1:
            raise self._error(f"offsets_{split} has {len(offsets)} entries, offsets_train {clients + 1}: "
                              "one per client plus one in every split")
        return offsets.astype(np.int64)

    def _unseen(self, f: h5py.File) -> np.ndarray:
        clients = len(self.offsets["train"]) - 1
        if "unseen" not in f:
            return np.zeros(clients, dtype=bool)
        unseen = f["unseen"][()]
        flags = _flags(unseen)
        if flags is None or unseen.shape != (clients,):
            raise self._error(f"unseen must hold {clients} booleans (one per client), got {unseen.dtype} of shape "
                              f"{unseen.shape}")
        return flags

    def _load(self, client_ids: list[int]) -> dict[int, ClientSplit]:
        if self.file is None:
            self.file = h5py.File(self.path, "r")
        out = {}
        for c in client_ids:
            arrays = {}
            with self._reading(c):
                for split, offsets in self.offsets.items():
                    lo, hi = offsets[c : c + 2]
                    for kind in ("x", "y"):
                        arrays[f"{kind}_{split}"] = self.file[f"{kind}_{split}"][lo:hi]
            out[c] = self._client_split(arrays)
        return out


class NpzClients(_ClientArrays):
    """A directory of ``.npz`` files, one per client, client ids in sorted file-name order; an optional
    ``meta.json`` declares the task and number of classes."""

    def __init__(self, path: Path, cfg: DataConfig, seed: int):
        super().__init__(path)
        self._check_origin(None, cfg, seed)
        self.files = sorted(p for p in path.iterdir() if p.suffix == ".npz" and p.is_file())
        if not self.files:
            raise self._error("no .npz client files in this directory (see docs/reference/data-format.md)")
        meta = self._read_meta(path / "meta.json")
        headers = [self._headers(file) for file in self.files]
        first: dict[str, tuple[tuple[int, ...], np.dtype, np.dtype, str]] = {}
        for c, header in enumerate(headers):
            for split in SPLITS:
                if f"x_{split}" in header:
                    (shape, x_dtype), y = header[f"x_{split}"], header[f"y_{split}"]
                    signature = (shape[1:], x_dtype, y.dtype, self.files[c].name)
                    if first.setdefault(split, signature)[:3] != signature[:3]:
                        raise self._error(f"{self.files[c].name}: x_{split}/y_{split} hold {x_dtype} samples of shape "
                                          f"{shape[1:]} with {y.dtype} labels, but {first[split][3]}'s hold "
                                          f"{first[split][1]} samples of shape {first[split][0]} with "
                                          f"{first[split][2]} labels")
        splits = {}
        for split, (shape, x_dtype, y_dtype, _) in first.items():
            ys = [header[f"y_{split}"] for header in headers if f"y_{split}" in header]
            sizes = [len(header[f"y_{split}"]) if f"y_{split}" in header else 0 for header in headers]
            splits[split] = _Split(np.array(sizes, dtype=np.int64), np.concatenate(ys), shape, x_dtype, y_dtype)
        unseen = np.array([bool(header.get("unseen", False)) for header in headers])
        self.layout = self._layout(meta, splits, unseen)

    def _client(self, c: int) -> str:
        return f"client {c} ({self.files[c].name})"

    def _read_meta(self, file: Path) -> dict[str, Any]:
        if not file.exists():
            return {}
        try:
            meta = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            raise self._error(f"cannot read meta.json as JSON ({exc})") from None
        if not isinstance(meta, dict):
            raise self._error("meta.json must hold one JSON object, e.g. {\"num_classes\": 10}")
        return meta

    def _headers(self, file: Path) -> dict[str, Any]:
        """``file``'s checked contents without its feature rows: (shape, dtype) of each x, every y, and the
        unseen flag."""
        try:
            out = _read_npz(file)
        except (OSError, ValueError, zipfile.BadZipFile) as exc:
            raise self._error(f"cannot read {file.name} as .npz ({exc})") from None
        unknown = sorted(set(out) - {*ARRAY_KEYS, "unseen"})
        if unknown:
            raise self._error(f"{file.name}: unknown keys {', '.join(unknown)} (see docs/reference/data-format.md)")
        for split in SPLITS:
            pair = [f"x_{split}", f"y_{split}"]
            missing = [key for key in pair if key not in out]
            if missing and (split in REQUIRED_SPLITS or len(missing) == 1):
                raise self._error(f"{file.name}: missing {', '.join(missing)} (the {split} split needs x_{split} "
                                  f"and y_{split})")
            if missing:
                continue
            (shape, _), y = out[f"x_{split}"], out[f"y_{split}"]
            if len(shape) < 2 or y.ndim != 1 or shape[0] != len(y):
                raise self._error(f"{file.name}: x_{split} has shape {shape} and y_{split} {y.shape}; a split is "
                                  "N samples (x at least 2-D) with N labels")
        if "unseen" in out:
            flag = _flags(out["unseen"])
            if flag is None or flag.shape != ():
                raise self._error(f"{file.name}: unseen must be one boolean, got {out['unseen'].dtype} of shape "
                                  f"{out['unseen'].shape}")
            out["unseen"] = flag
        return out

    def _load(self, client_ids: list[int]) -> dict[int, ClientSplit]:
        out = {}
        for c in client_ids:
            with self._reading(c), np.load(self.files[c], allow_pickle=False) as npz:
                out[c] = self._client_split({key: npz[key] for key in ARRAY_KEYS if key in npz.files})
        return out


def _read_npz(file: Path) -> dict[str, Any]:
    """Every array of an ``.npz`` by key: x arrays as (shape, dtype) from their headers alone, the rest read."""
    out: dict[str, Any] = {}
    with zipfile.ZipFile(file) as archive:
        for name in archive.namelist():
            key = name.removesuffix(".npy")
            with archive.open(name) as member:
                if key.startswith("x_"):
                    version = npy.read_magic(member)
                    read = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
                    shape, _, dtype = read(member)
                    out[key] = (tuple(shape), np.dtype(dtype))
                else:
                    out[key] = npy.read_array(member, allow_pickle=False)
    return out
