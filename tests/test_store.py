"""A worker's client data within ``data_memory_gb``: the least recently used clients are forgotten between uses
and made or read again, bitwise the same, so memory does not grow with the clients a worker evaluates."""

from __future__ import annotations

import shutil
import zipfile

import h5py
import numpy as np
import torch

from mpifl.data import build_federated_dataset
from mpifl.registry import parse_config
from mpifl.runtime import store as store_module
from mpifl.runtime.store import ClientStore
from tests.conftest import TINY, _merge, assert_same, deterministic, run_config, run_mpifl_batch
from tests.data.test_data_own_files import config as own_config
from tests.data.test_data_own_files import own_clients, write_h5, write_npz

GAUSSIAN = {"data": {"dataset": "gaussian_images", "num_clients": 30, "partition": "iid",
                     "synthetic": {"image_shape": [12], "samples_per_client": 40}},
            "model": {"name": "mlp", "hidden": [8]}}


def gaussian_store(budget: float) -> ClientStore:
    cfg = parse_config(_merge(TINY, GAUSSIAN))
    dataset = build_federated_dataset(cfg.data, cfg.seed)
    return ClientStore(dataset, np.arange(30), torch.device("cpu"), budget)


def test_the_least_recently_staged_clients_go_first_and_come_back_bitwise():
    unlimited = gaussian_store(float("inf"))
    unlimited.stage(range(30))
    unlimited.release()
    assert len(unlimited.loaded) == 30 and unlimited.loads == 30
    one = unlimited.loaded_bytes / 30  # iid clients of equal size
    store = gaussian_store(3.5 * one)
    store.stage([0, 1, 2, 3, 4])
    store.stage([1])  # 1 is used again: now the most recent
    store.release()
    assert list(store.loaded) == [3, 4, 1] and store.loaded_bytes <= 3.5 * one
    again = store[7]  # staged on demand, made again from its seed
    for field in vars(again):
        assert torch.equal(getattr(again, field), getattr(unlimited.loaded[7], field))
    store.stage([0])  # forgotten before, so made once more
    assert store.loads == 7
    nothing = gaussian_store(0)
    nothing.stage(range(10))
    nothing.release()
    assert not nothing.loaded and nothing.loaded_bytes == 0


def test_no_budget_gives_bitwise_the_same_runs_and_bounds_what_workers_keep(write_config, tmp_path):
    """Generated clients (every client evaluated each round) with nothing kept between uses: the same bits on 1
    and 3 ranks as with the default budget, and every evaluation makes every client again."""
    raw = _merge(GAUSSIAN, {"rounds": 3, "eval_every": 1, "eval_chunk": 7, "clients_per_round": 5})
    run_config(write_config(raw), tmp_path / "kept.h5")
    none = write_config(_merge(raw, {"data_memory_gb": 0}), "none.yaml")
    run_config(none, tmp_path / "none.h5")
    run_config(none, tmp_path / "none3.h5", ranks=3)
    reference = deterministic(tmp_path / "kept.h5")
    assert_same(reference, deterministic(tmp_path / "none.h5"))
    assert_same(reference, deterministic(tmp_path / "none3.h5"))
    with h5py.File(tmp_path / "kept.h5") as kept, h5py.File(tmp_path / "none.h5") as forgot:
        assert kept["ranks"]["client_data_loads"][0] == 30  # each made once, then kept
        assert forgot["ranks"]["client_data_loads"][0] >= 3 * 30 + 3 * 5  # every evaluation and round again


def test_file_backed_clients_are_read_again_bitwise_and_checked_at_start_up(tmp_path):
    """Prepared HDF5 and .npz clients with nothing kept: the same bits; a damaged .npz client (its features
    truncated inside the archive) is one line, exit 2, before training, although no round would need it yet.
    The five 3-rank jobs run in one launch (tests/batch.py)."""
    clients = own_clients()
    sources = {"h5": write_h5(tmp_path / "own.h5", clients), "npz": write_npz(tmp_path / "npz", clients)}
    shutil.copytree(tmp_path / "npz", tmp_path / "damaged")
    damaged = tmp_path / "damaged" / "client_004.npz"  # the unseen client: evaluated, never trained
    with zipfile.ZipFile(damaged) as archive:
        members = {n: archive.read(n) for n in archive.namelist()}
    with zipfile.ZipFile(damaged, "w") as archive:
        for n, data in members.items():
            archive.writestr(n, data[: len(data) // 2] if n.startswith("x_test") else data)
    sources["damaged"] = damaged.parent
    configs = {}
    for name, source in sources.items():  # each its own.yaml, in a folder of its own
        (tmp_path / f"config_{name}").mkdir()
        configs[name] = own_config(tmp_path / f"config_{name}", source)
    jobs = [["run", str(configs[name]), "--out", str(tmp_path / f"{name}_{budget}.h5"), "--quiet",
             "--set", f"data_memory_gb={budget}"] for name in ("h5", "npz") for budget in ("1", "0")]
    jobs.append(["run", str(configs["damaged"]), "--out", str(tmp_path / "bad.h5"), "--set", "data_memory_gb=0"])
    *runs, proc = run_mpifl_batch(jobs, 3, tmp_path / "batch")
    for run in runs:
        assert run.returncode == 0, run.stderr
    for name in ("h5", "npz"):
        assert_same(deterministic(tmp_path / f"{name}_1.h5"), deterministic(tmp_path / f"{name}_0.h5"))
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mpifl")]
    assert proc.returncode == 2 and len(lines) == 1 and "client_004.npz" in lines[0], proc.stderr
    assert not (tmp_path / "bad.h5").exists()


def test_generated_clients_are_made_before_the_first_round_while_they_fit(monkeypatch):
    """``up_front`` (the engine's store): every home client made at start-up when the budget allows, the
    same bits as made on first use; with a budget of 3.5 clients, no more than that kept."""
    cfg = parse_config(_merge(TINY, GAUSSIAN))
    dataset = build_federated_dataset(cfg.data, cfg.seed)
    cpu = torch.device("cpu")
    ahead = ClientStore(dataset, np.arange(30), cpu, float("inf"), up_front=True)
    assert ahead.loads == 30 and len(ahead.loaded) == 30
    late = gaussian_store(float("inf"))
    assert late.loads == 0
    for field in vars(late[7]):
        assert torch.equal(getattr(late[7], field), getattr(ahead.loaded[7], field))
    one = ahead.loaded_bytes / 30
    monkeypatch.setattr(store_module, "GENERATED_BATCH", 4)  # made 4 at a time: the first 4 overshoot the budget
    small = ClientStore(dataset, np.arange(30), cpu, 3.5 * one, up_front=True)
    assert small.loads == 4 and len(small.loaded) == 3
