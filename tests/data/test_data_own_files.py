"""data.prepared with data partitioned elsewhere (docs/reference/data-format.md): one HDF5 file or a directory of .npz,
read bitwise as written, the same results from either layout and on any rank count, and one clear line for
each malformed source."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

from mpifl.cli import main
from mpifl.data import build_federated_dataset
from mpifl.data.config import DataConfig
from mpifl.data.prepared import FORMAT, SPLITS
from tests.conftest import TINY, assert_same, deterministic, run_mpifl, run_mpifl_batch

FIELDS = ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test")


def own_clients() -> list[dict[str, np.ndarray]]:
    """Five clients of 6 float64 features and 3 classes, unequal sizes; client 2 has no validation rows and
    client 4 is unseen (the arrays the user partitioned, before mpifl's float32/int64 conversion)."""
    rng = np.random.default_rng(3)
    clients = []
    for c, (train, val, test) in enumerate([(20, 4, 6), (12, 3, 5), (30, 0, 8), (16, 2, 4), (0, 2, 6)]):
        arrays = {}
        for split, rows in zip(SPLITS, (train, val, test), strict=True):
            if rows or split != "val":  # a split with no rows: empty arrays, or none at all for val
                y = (np.arange(rows) + c) % 3
                arrays[f"x_{split}"] = rng.normal(size=(rows, 6)) + y[:, None]
                arrays[f"y_{split}"] = y.astype(np.int32)
        clients.append(arrays)
    return clients


UNSEEN = np.array([False, False, False, False, True])


def write_h5(path: Path, clients: list[dict[str, np.ndarray]], unseen: np.ndarray = UNSEEN) -> Path:
    """The HDF5 layout: each split's rows of all clients in one array, client c at offsets[c]:offsets[c+1]."""
    feature_shape, x_dtype = clients[0]["x_train"].shape[1:], clients[0]["x_train"].dtype
    with h5py.File(path, "w") as f:
        f.attrs["format"] = FORMAT
        for split in SPLITS:
            xs = [c.get(f"x_{split}", np.zeros((0, *feature_shape), x_dtype)) for c in clients]
            ys = [c.get(f"y_{split}", np.zeros(0, np.int32)) for c in clients]
            f[f"x_{split}"], f[f"y_{split}"] = np.concatenate(xs), np.concatenate(ys)
            f[f"offsets_{split}"] = np.cumsum([0] + [len(y) for y in ys])
        f["unseen"] = unseen
    return path


def write_npz(folder: Path, clients: list[dict[str, np.ndarray]], unseen: np.ndarray = UNSEEN) -> Path:
    """The .npz layout: one file per client, client ids in sorted file-name order."""
    folder.mkdir()
    for c, arrays in enumerate(clients):
        np.savez(folder / f"client_{c:03d}.npz", **arrays, **({"unseen": True} if unseen[c] else {}))
    return folder


def config(tmp_path: Path, source: Path, **data: object) -> Path:
    """A tiny FedAvg run on ``source``, with no other data settings than ``data``."""
    cfg = {**TINY, "rounds": 2, "clients_per_round": 3, "model": {"name": "mlp", "hidden": [8]},
           "data": {"prepared": str(source), **data}}
    path = tmp_path / "own.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_both_layouts_read_the_arrays_as_written(tmp_path):
    clients = own_clients()
    h5 = build_federated_dataset(DataConfig(prepared=str(write_h5(tmp_path / "own.h5", clients))), 7)
    npz = build_federated_dataset(DataConfig(prepared=str(write_npz(tmp_path / "own", clients))), 7)
    for data in (h5, npz):
        layout = data.layout
        assert data.cheap_clients and layout.has_val and layout.task == "classification"
        assert (layout.num_clients, layout.num_classes, layout.input_shape, layout.input_dtype) == (5, 3, (6,),
                                                                                                    "float32")
        assert layout.train_sizes.tolist() == [20, 12, 30, 16, 0] and layout.unseen.tolist() == UNSEEN.tolist()
        assert layout.class_counts[2].tolist() == [10, 10, 10]  # (arange(30) + 2) % 3
        got = data.load_clients([4, 2, 0, 1, 3])
        for c, arrays in enumerate(clients):
            for field in FIELDS:
                want = arrays.get(field, np.zeros((0, 6) if field[0] == "x" else 0))
                value = getattr(got[c], field)
                assert value.dtype == (np.float32 if field[0] == "x" else np.int64), (c, field)
                assert np.array_equal(value, want.astype(value.dtype)), (c, field)


def test_prepare_output_without_fingerprint_is_written_elsewhere(tmp_path):
    """`mpifl prepare`'s file is an instance of the format: without its fingerprint, it is read as it is
    (whatever the settings that made it), and data settings are refused rather than silently ignored."""
    settings = {"dataset": "digits", "num_clients": 6, "partition": "dirichlet", "alpha": 0.5, "unseen_fraction": 0.2}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump({"seed": 3, "data": settings}))
    assert main(["prepare", str(tmp_path / "cfg.yaml"), "--out", str(tmp_path / "digits.h5")]) == 0
    with h5py.File(tmp_path / "digits.h5", "a") as f:
        del f.attrs["fingerprint"]
    original = build_federated_dataset(DataConfig(**settings), 3)
    moved = build_federated_dataset(DataConfig(prepared=str(tmp_path / "digits.h5")), 99)
    assert np.array_equal(original.layout.unseen, moved.layout.unseen) and not moved.layout.has_val
    want, got = original.load_clients(range(6)), moved.load_clients(range(6))
    assert all(np.array_equal(getattr(want[c], f), getattr(got[c], f)) for c in range(6) for f in FIELDS)


def test_own_data_runs_the_same_from_either_layout_on_any_rank_count(tmp_path):
    clients = own_clients()
    sources = {"h5": write_h5(tmp_path / "own.h5", clients), "npz": write_npz(tmp_path / "own", clients)}
    runs = {(name, ranks): ["run", str(config(tmp_path, sources[name]).rename(tmp_path / f"{name}{ranks}.yaml")),
                            "--out", str(tmp_path / f"{name}{ranks}.h5"), "--quiet"]
            for name, ranks in (("h5", 0), ("h5", 3), ("npz", 3))}
    assert main(runs["h5", 0]) == 0
    for proc in run_mpifl_batch([runs["h5", 3], runs["npz", 3]], 3, tmp_path / "batch"):  # one 3-rank launch
        assert proc.returncode == 0, proc.stderr
    results = {key: deterministic(tmp_path / f"{key[0]}{key[1]}.h5") for key in runs}
    assert "eval/global.unseen.val_acc_pooled" in results["h5", 0]  # the file's own validation split is evaluated
    assert_same(results["h5", 0], results["h5", 3])
    assert_same(results["h5", 3], results["npz", 3])


def npz_with(client: int, change) -> object:  # noqa: ANN001
    """A writer of the .npz layout whose ``client``'s arrays are changed by ``change(arrays)`` first."""
    def write(tmp_path: Path) -> Path:
        clients = own_clients()
        change(clients[client])
        return write_npz(tmp_path / "own", clients)
    return write


def h5_with(change) -> object:  # noqa: ANN001
    """A writer of the HDF5 layout, changed by ``change(file)`` once written."""
    def write(tmp_path: Path) -> Path:
        path = write_h5(tmp_path / "own.h5", own_clients())
        with h5py.File(path, "a") as f:
            change(f)
        return path
    return write


def _relabel(f: h5py.File, dtype: type, label: int | None = None) -> None:
    y = f["y_train"][()].astype(dtype)
    if label is not None:
        y[25] = label
    del f["y_train"]
    f["y_train"] = y


# how a source is spoiled, and its line's text after "data.prepared: SOURCE: "
BROKEN = {
    "missing split": (h5_with(lambda f: f.__delitem__("y_test")),
                      "missing y_test (the test split needs x_test, y_test, offsets_test)"),
    "x/y lengths": (npz_with(1, lambda a: a.update(y_train=a["y_train"][:-1])),
                    "client_001.npz: x_train has shape (12, 6) and y_train (11,); a split is N samples (x at least "
                    "2-D) with N labels"),
    "feature shapes": (npz_with(3, lambda a: a.update(x_test=a["x_test"][:, :5])),
                       "client_003.npz: x_test/y_test hold float64 samples of shape (5,) with int32 labels, but "
                       "client_000.npz's hold float64 samples of shape (6,) with int32 labels"),
    "dtypes": (npz_with(2, lambda a: a.update(x_train=a["x_train"].astype(np.float32))),
               "client_002.npz: x_train/y_train hold float32 samples of shape (6,) with int32 labels, but "
               "client_000.npz's hold float64 samples of shape (6,) with int32 labels"),
    "negative label": (npz_with(3, lambda a: a.update(y_val=np.array([0, -1], np.int32))),
                       "client 3 (client_003.npz): label -1 in y_val is outside [0, 3) (num_classes from the labels)"),
    "label range": (h5_with(lambda f: (f.attrs.__setitem__("num_classes", 3), _relabel(f, np.int32, 3))),
                    "client 1: label 3 in y_train is outside [0, 3) (num_classes declared)"),
    "float labels": (h5_with(lambda f: _relabel(f, np.float64)),
                     "y_train is float64; a classification task needs integer labels (or declare task: regression)"),
    "idle client": (npz_with(1, lambda a: a.update(x_train=a["x_train"][:0], y_train=a["y_train"][:0])),
                    "client 1 (client_001.npz) has no training rows and is not unseen"),
    "half a split": (npz_with(0, lambda a: a.pop("y_val")),
                     "client_000.npz: missing y_val (the val split needs x_val and y_val)"),
    "unseen shape": (h5_with(lambda f: (f.__delitem__("unseen"), f.create_dataset("unseen", data=[0, 1]))),
                     "unseen must hold 5 booleans (one per client), got int64 of shape (2,)"),
    "unknown keys": (npz_with(0, lambda a: a.update(x_trian=a["x_train"])),
                     "client_000.npz: unknown keys x_trian (see docs/reference/data-format.md)"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_malformed_sources_give_one_line(tmp_path, capsys, case):
    """In this process (the CLI's own code path, without a new interpreter per case); the last test checks
    the same lines through ``python -m mpifl``."""
    write, message = BROKEN[case]
    source = write(tmp_path)
    assert main(["validate", str(config(tmp_path, source))]) == 2
    assert capsys.readouterr().err == f"mpifl: error: data.prepared: {source}: {message}\n"


def test_unusable_sources_and_settings_give_one_line(tmp_path, capsys):
    """Sources that are not the format at all, and data settings that cannot apply to data written elsewhere;
    the first case and the settings through ``python -m mpifl`` (exit code 2 before anything trains)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk.h5").write_bytes(b"not hdf5")
    write_npz(tmp_path / "junk", own_clients())
    (tmp_path / "junk" / "client_001.npz").write_bytes(b"not a zip")
    with h5py.File(tmp_path / "plain.h5", "w") as f:
        f["x_train"] = np.zeros((2, 3))
    (tmp_path / "meta").mkdir()
    write_npz(tmp_path / "meta" / "own", own_clients())
    (tmp_path / "meta" / "own" / "meta.json").write_text(json.dumps({"num_classes": 3, "classes": 3}))
    cases = {
        tmp_path / "empty": "no .npz client files in this directory (see docs/reference/data-format.md)",
        tmp_path / "junk.h5": "cannot read it as HDF5 (",
        tmp_path / "junk": "cannot read client_001.npz as .npz (File is not a zip file)",
        tmp_path / "plain.h5": f"attribute format is None, expected {FORMAT!r} (see docs/reference/data-format.md)",
        tmp_path / "meta" / "own": "unknown metadata classes (known: task, num_classes)",
    }
    for i, (source, message) in enumerate(cases.items()):
        args = ["validate", str(config(tmp_path, source))]
        if i == 0:
            proc = run_mpifl(args)
            code, err = proc.returncode, proc.stderr
        else:
            code, err = main(args), capsys.readouterr().err
        assert code == 2 and err.startswith(f"mpifl: error: data.prepared: {source}: {message}")
        assert err.count("\n") == 1, err
    npz = write_npz(tmp_path / "own", own_clients())
    proc = run_mpifl(["run", str(config(tmp_path, npz, num_clients=5))])
    assert proc.returncode == 2 and proc.stderr == (
        f"mpifl: error: data.num_clients: does not apply to data.prepared {npz}, whose clients, splits and unseen "
        "flags were written elsewhere (no `mpifl prepare` fingerprint); remove it\n")
    assert main(["validate", str(config(tmp_path, npz))]) == 0


def test_regression_targets_and_token_inputs(tmp_path):
    """meta.json declares a regression task; integer x are token ids: read as int64, targets as float32."""
    rng = np.random.default_rng(1)
    clients = [{f"{kind}_{split}": rng.integers(0, 50, (4, 7)) if kind == "x" else rng.normal(size=4)
                for split in ("train", "test") for kind in ("x", "y")} for _ in range(3)]
    folder = write_npz(tmp_path / "tokens", clients, np.zeros(3, dtype=bool))
    (folder / "meta.json").write_text(json.dumps({"task": "regression"}))
    data = build_federated_dataset(DataConfig(prepared=str(folder)), 0)
    layout = data.layout
    assert (layout.task, layout.num_classes, layout.input_dtype, layout.class_counts.shape) == ("regression", 0,
                                                                                                "int64", (3, 0))
    client = data.load_clients([1])[1]
    assert client.x_train.dtype == np.int64 and np.array_equal(client.x_train, clients[1]["x_train"])
    assert client.y_test.dtype == np.float32 and np.array_equal(client.y_test, clients[1]["y_test"].astype(np.float32))
