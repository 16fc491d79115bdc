"""Exports read back by each tool's own reader (TensorBoard's EventAccumulator, MLflow's client), pandas
frames of the results tables, and one-line errors when an optional extra is missing."""

from __future__ import annotations

import os
import sys
import time

import h5py
import numpy as np
import pytest

from mpifl.cli import main
from mpifl.extras import MissingExtra
from mpifl.results import read_results
from tests.conftest import run_mpifl


@pytest.fixture
def timed_run(write_config, tmp_path):
    """``timed_run(name, seed)``: a 3-round run into tmp_path/runs/NAME.h5; returns (results, start, end)."""

    def run(name: str = "r", seed: int = 7):
        out = tmp_path / "runs" / f"{name}.h5"
        start = time.time()
        assert main(["run", str(write_config({"seed": seed})), "--out", str(out), "--quiet"]) == 0
        return read_results(out), start, time.time()

    return run


def test_csv_and_tensorboard_scalars_carry_rounds_real_wall_times_and_hparams(timed_run, tmp_path):
    res, start, end = timed_run()
    out = tmp_path / "runs" / "r.h5"
    assert main(["export", str(out), "--csv", str(tmp_path / "csv"), "--tensorboard", str(tmp_path / "tb")]) == 0
    lines = (tmp_path / "csv" / "eval.csv").read_text().splitlines()
    assert len(lines) == 1 + 3 and "global.seen.acc_pooled" in lines[0]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    ev, rounds = res.table("eval"), res.table("rounds")
    scalars = acc.Scalars("eval/global.seen.acc_pooled")
    assert [s.step for s in scalars] == [1, 2, 3]
    assert np.allclose([s.value for s in scalars], ev["global.seen.acc_pooled"], atol=1e-6)
    losses = acc.Scalars("rounds/train_loss")
    assert np.allclose([s.value for s in losses], rounds["train_loss"], rtol=1e-6)
    walls = np.array([s.wall_time for s in losses])
    assert np.allclose(walls, rounds["unix_time_s"])  # the recorded times, not the export's
    assert np.all(np.diff(walls) > 0) and start < walls[0] and walls[-1] < end
    assert np.allclose([s.wall_time for s in scalars], walls)  # an evaluation at its round's end

    content = acc.PluginTagToContent("hparams")
    session = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = session.session_start_info.hparams
    assert hparams["client.lr"].number_value == 0.1 and hparams["algorithm"].string_value == "fedavg"
    assert hparams["model.channels"].string_value == "[4]"
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert "eval/global.seen.acc_pooled" in {m.name.tag for m in experiment.metric_infos}


def test_mlflow_sweep_export_is_read_back_by_mlflow_and_replaced_on_overwrite(timed_run, tmp_path, monkeypatch):
    runs = {name: timed_run(name, seed) for name, seed in (("a", 7), ("b", 8))}
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the CLI opts in to MLflow's file store itself
    store = tmp_path / "mlruns"
    for again in ([], ["--overwrite"]):  # exporting again replaces each file's run
        proc = run_mpifl(["export", str(tmp_path / "runs"), "--mlflow", str(store), *again])
        assert proc.returncode == 0, proc.stderr
        assert "MLflow experiment 'runs', 2 runs" in proc.stdout

    from mlflow import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = MlflowClient(tracking_uri=store.resolve().as_uri())
    experiment = client.get_experiment_by_name("runs")
    found = client.search_runs([experiment.experiment_id])
    assert sorted(r.info.run_name for r in found) == ["a", "b"]
    for run in found:
        res, start, end = runs[run.info.run_name]
        ev, rounds = res.table("eval"), res.table("rounds")
        assert run.info.status == "FINISHED"
        assert run.data.params["seed"] == str(res.config["seed"]) and run.data.params["client.lr"] == "0.1"
        assert run.data.params["model.channels"] == "[4]"
        assert run.data.tags["mpifl.results_file"] == str(tmp_path / "runs" / f"{run.info.run_name}.h5")
        history = client.get_metric_history(run.info.run_id, "eval/global.seen.acc_pooled")
        assert [m.step for m in history] == ev["round"].tolist()
        assert [m.value for m in history] == ev["global.seen.acc_pooled"].tolist()
        losses = client.get_metric_history(run.info.run_id, "rounds/train_loss")
        assert [m.value for m in losses] == rounds["train_loss"].tolist()
        stamps = np.array([m.timestamp for m in losses])
        assert np.array_equal(stamps, (rounds["unix_time_s"] * 1000).astype(np.int64))
        assert start * 1000 <= run.info.start_time < stamps[0] and stamps[-1] == run.info.end_time <= end * 1000


def test_results_tables_as_pandas_frames(timed_run, tmp_path):
    import pandas

    res, _, _ = timed_run()
    rounds = res.frame("rounds")
    assert isinstance(rounds, pandas.DataFrame) and len(rounds) == 3
    assert rounds["train_loss"].tolist() == res.table("rounds")["train_loss"].tolist()
    assert set(rounds.columns) == set(res.table("rounds"))
    with pytest.raises(ValueError, match="no table 'nope'"):
        res.frame("nope")
    # text columns (a multi-rank run's /physical) come back as str, not bytes
    with h5py.File(tmp_path / "t.h5", "w") as f:
        f.attrs["config"] = "{}"
        f.create_dataset("physical/op", data=np.array([b"ibcast", b"igatherv"]))
        f.create_dataset("physical/bytes", data=np.array([4, 8]))
    physical = read_results(tmp_path / "t.h5").frame("physical")
    assert physical["op"].tolist() == ["ibcast", "igatherv"] and physical["bytes"].tolist() == [4, 8]


def test_missing_extras_and_unusable_targets_are_one_line_errors(timed_run, tmp_path, monkeypatch, capsys):
    res, _, _ = timed_run()
    out = str(tmp_path / "runs" / "r.h5")
    for module, flag, extra in (("mlflow", "--mlflow", "mlflow"), ("torch.utils.tensorboard", "--tensorboard",
                                                                   "tensorboard")):
        with monkeypatch.context() as patch:
            patch.setitem(sys.modules, module, None)  # how Python spells "not installed"
            assert main(["export", out, flag, str(tmp_path / extra)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"pip install 'mpifl[{extra}]'" in err, err
        assert not os.path.exists(tmp_path / extra)  # refused before writing anything
    (tmp_path / "file").touch()
    for flag, target, says in (("--csv", tmp_path / "file" / "csv", "cannot write: [Errno 20] Not a directory"),
                               ("--mlflow", "nope://x", "--mlflow nope://x: ")):
        assert main(["export", out, flag, str(target)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err
    monkeypatch.setitem(sys.modules, "pandas", None)
    with pytest.raises(MissingExtra, match=r"mpifl\[pandas\]") as refused:
        res.frame("rounds")
    assert isinstance(refused.value, ImportError)
