"""`mpifl prepare` and data.prepared: the same clients, bitwise, read one by one from one HDF5 file."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

from mpifl.cli import main
from mpifl.data import build_federated_dataset
from mpifl.data.config import DataConfig
from mpifl.schema import ConfigError
from tests.conftest import run_mpifl, run_mpifl_batch
from tests.data.data_files import tagged_images, write_mnist

FIELDS = ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test")


def gz_mnist(tmp_path: Path) -> dict:
    """A gzipped MNIST-format directory (reading any row streams the file: not cheap per client)."""
    rng = np.random.default_rng(0)
    write_mnist(tmp_path / "mnist", tagged_images(600, (28, 28)), rng.integers(0, 10, 600), 500, gz=True)
    return {"dataset": "mnist", "root": str(tmp_path / "mnist"), "num_clients": 12, "partition": "dirichlet",
            "alpha": 0.3, "val_fraction": 0.1}


def test_prepared_clients_are_the_loaders_bitwise(tmp_path, monkeypatch):
    monkeypatch.setattr("mpifl.data.prepared._BATCH_CLIENTS", 5)  # written in three batches
    settings = gz_mnist(tmp_path)
    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump({"seed": 5, "data": settings}))
    assert main(["prepare", str(config), "--out", str(tmp_path / "data.h5")]) == 0
    original = build_federated_dataset(DataConfig(**settings), 5)
    moved = {**settings, "root": "/moved", "prepared": str(tmp_path / "data.h5")}  # the originals are not needed
    prepared = build_federated_dataset(DataConfig(**moved), 5)
    assert not original.cheap_clients and prepared.cheap_clients
    for name in ("train_sizes", "unseen", "class_counts", "input_shape", "num_classes", "task", "input_dtype"):
        assert np.array_equal(getattr(original.layout, name), getattr(prepared.layout, name)), name
    want, got = original.load_clients(range(12)), prepared.load_clients([11, 3, 0, *range(12)])
    for c in range(12):
        for field in FIELDS:
            a, b = getattr(want[c], field), getattr(got[c], field)
            assert a.dtype == b.dtype and np.array_equal(a, b), (c, field)

    with pytest.raises(ConfigError, match="prepared for other data settings or seed"):
        build_federated_dataset(DataConfig(**{**settings, "prepared": str(tmp_path / "data.h5")}), 6)
    (tmp_path / "junk.h5").write_bytes(b"not hdf5")
    with pytest.raises(ConfigError, match="cannot read"):
        build_federated_dataset(DataConfig(**{**settings, "prepared": str(tmp_path / "junk.h5")}), 5)


def test_prepared_data_balances_rounds_with_the_same_results(write_config, tmp_path):
    settings = gz_mnist(tmp_path)
    config = write_config({"rounds": 3, "clients_per_round": 8, "data": {**settings, "unseen_fraction": 0}})
    assert run_mpifl(["prepare", str(config), "--out", str(tmp_path / "data.h5")]).returncode == 0
    prepared = ["--set", f"data.prepared={tmp_path / 'data.h5'}"]
    # the three 3-rank jobs in one launch: another seed (refused), from the files, from the prepared file
    other_seed, *jobs = run_mpifl_batch([["run", str(config), "--set", "seed=99", *prepared]] + [
        ["run", str(config), "--out", str(tmp_path / f"{name}.h5"), "--quiet", *extra]
        for name, extra in (("files", []), ("prepared", prepared))], 3, tmp_path / "batch")
    assert other_seed.returncode == 2
    assert [line for line in other_seed.stderr.splitlines() if line.startswith("mpifl")] == [
        f"mpifl: error: data.prepared: {tmp_path / 'data.h5'} was prepared for other data settings or seed; "
        "run `mpifl prepare` with this config"]
    runs = {}
    for name, proc in zip(("files", "prepared"), jobs):
        out = tmp_path / f"{name}.h5"
        assert proc.returncode == 0, proc.stderr
        with h5py.File(out) as f:
            runs[name] = [f[key][()] for key in ("model/global_model", "eval/global.seen.acc_pooled",
                                                 "rounds/load_imbalance")]
    (model, accuracy, static), (prepared_model, prepared_accuracy, dynamic) = runs["files"], runs["prepared"]
    assert np.array_equal(model, prepared_model) and np.array_equal(accuracy, prepared_accuracy)
    assert dynamic.mean() < static.mean()  # gzipped files stay static; prepared ones rebalance every round


def test_the_start_up_line_names_the_prepared_data(write_config, tmp_path, capsys):
    """Not the default dataset ("fedavg on digits") that the data settings name when a file brings the data."""
    config = write_config({"rounds": 1, "eval_every": 1, "data": {"unseen_fraction": 0}})
    data = tmp_path / "data.h5"
    assert main(["prepare", str(config), "--out", str(data)]) == 0
    capsys.readouterr()
    assert main(["run", str(config), "--out", str(tmp_path / "out.h5"), "--set", f"data.prepared={data}"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (f"mpifl: fedavg on prepared data {data}, 10 clients, 1 rank(s), "
                                                       f"1 rounds -> {tmp_path / 'out.h5'}")
    assert main(["run", str(config), "--out", str(tmp_path / "plain.h5")]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("mpifl: fedavg on digits, 10 clients")


def test_prepare_makes_the_folders_of_its_output_or_refuses_in_one_line(write_config, tmp_path, capsys):
    """A missing folder is made (as for a results file); an output that cannot be written is one line, exit 2,
    before any data is read."""
    config = write_config({"data": {"unseen_fraction": 0}})
    assert main(["prepare", str(config), "--out", str(tmp_path / "new" / "folder" / "data.h5")]) == 0
    assert (tmp_path / "new" / "folder" / "data.h5").is_file()
    (tmp_path / "file").touch()
    capsys.readouterr()
    assert main(["prepare", str(config), "--out", str(tmp_path / "file" / "data.h5")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("mpifl: error: output ") and "Not a directory" in err, err
