"""A federated dataset prepared once into one HDF5 file, read client by client.

``mpifl prepare CONFIG --out DATA.h5`` materializes every client of the config's ``data:`` section
(with its seed) and stores each split as one array with per-client offsets; a run with
``data.prepared: DATA.h5`` (and the same ``data:`` settings) then reads any client's rows with a
slice. That makes reading another client cheap even for datasets whose own files are not (gzipped
IDX, CIFAR pickles, SVHN ``.mat``, LEAF JSON), so stateless algorithms can balance every round
(``placement: auto``) on them too. The arrays are bitwise those of the original loader.
"""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import yaml

from mpifl.data.base import ClientSplit, FederatedDataset, FederatedLayout
from mpifl.data.config import DataConfig
from mpifl.schema import ConfigError, to_dict

SPLITS = ("train", "val", "test")
_BATCH_CLIENTS = 1000  # clients materialized at a time while preparing
_FORMAT = "mpifl-prepared-1"


def fingerprint(cfg: DataConfig, seed: int) -> str:
    """What decides every client's arrays: the data section and the seed (not where the original files
    are, nor the prepared file itself)."""
    settings = to_dict(cfg)
    settings.pop("prepared")
    settings.pop("root")
    return yaml.safe_dump({"data": settings, "seed": int(seed)}, sort_keys=True)


def prepare(dataset: FederatedDataset, cfg: DataConfig, seed: int, path: str | Path) -> None:
    """Write every client of ``dataset`` to ``path`` (through a temporary name: never half-written)."""
    path = Path(path)
    layout = dataset.layout
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with h5py.File(tmp, "w") as f:
            f.attrs["format"], f.attrs["fingerprint"] = _FORMAT, fingerprint(cfg, seed)
            group = f.create_group("layout")
            for name in ("train_sizes", "unseen", "class_counts"):
                group.create_dataset(name, data=getattr(layout, name))
            group.attrs.update(input_shape=list(layout.input_shape), num_classes=layout.num_classes,
                               task=layout.task, input_dtype=layout.input_dtype)
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
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def _append(f: h5py.File, name: str, rows: np.ndarray) -> None:
    if name not in f:
        row_bytes = max(rows[:1].nbytes, 1)
        f.create_dataset(name, data=rows, maxshape=(None, *rows.shape[1:]),
                         chunks=(max(1, 65536 // row_bytes), *rows.shape[1:]))
        return
    data = f[name]
    data.resize(len(data) + len(rows), axis=0)
    data[len(data) - len(rows):] = rows


class PreparedDataset(FederatedDataset):
    cheap_clients = True

    def __init__(self, cfg: DataConfig, seed: int):
        self.path = Path(str(cfg.prepared)).expanduser()
        try:
            with h5py.File(self.path, "r") as f:
                if f.attrs.get("format") != _FORMAT:
                    raise ConfigError(f"data.prepared: {self.path} is not a file written by `mpifl prepare`")
                if f.attrs["fingerprint"] != fingerprint(cfg, seed):
                    raise ConfigError(f"data.prepared: {self.path} was prepared for other data settings or seed; "
                                      "run `mpifl prepare` with this config")
                group = f["layout"]
                self.layout = FederatedLayout(
                    num_clients=len(group["train_sizes"]), train_sizes=group["train_sizes"][()],
                    unseen=group["unseen"][()], input_shape=tuple(int(s) for s in group.attrs["input_shape"]),
                    num_classes=int(group.attrs["num_classes"]), task=str(group.attrs["task"]),
                    input_dtype=str(group.attrs["input_dtype"]), class_counts=group["class_counts"][()])
                self.offsets = {split: f[f"offsets_{split}"][()] for split in SPLITS}
        except OSError as exc:
            raise ConfigError(f"data.prepared: cannot read {self.path} as HDF5 ({exc})") from None
        self.file: h5py.File | None = None  # opened on first read, kept for the run

    def _load(self, client_ids: list[int]) -> dict[int, ClientSplit]:
        if self.file is None:
            self.file = h5py.File(self.path, "r")
        out = {}
        for c in client_ids:
            arrays = []
            for split in SPLITS:
                lo, hi = self.offsets[split][c : c + 2]
                arrays += [self.file[f"x_{split}"][lo:hi], self.file[f"y_{split}"][lo:hi]]
            out[c] = ClientSplit(*arrays)
        return out
