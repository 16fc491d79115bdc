"""End-to-end runs in one process: exact ledger, results file, report and plot."""

import h5py
import numpy as np
import pytest
import torch
import yaml

from mpifl.cli import main
from mpifl.comm import Placement
from mpifl.data import build_federated_dataset
from mpifl.data.config import DataConfig
from mpifl.registry import load_config
from mpifl.report import logical_totals, report
from mpifl.results import read_results
from mpifl.runtime.sampling import sample_clients
from mpifl.runtime.store import ClientStore


def run(config, out, *extra):
    assert main(["run", str(config), "--out", str(out), "--quiet", *extra]) == 0
    return read_results(out)


def model_numel(res):
    return res.table("model")["global_model"].size


def test_fedavg_ledger_is_exactly_4d_each_way_per_participating_client(write_config, tmp_path):
    res = run(write_config(), tmp_path / "r.h5")
    cfg = load_config(write_config())
    d = model_numel(res)
    ledger, names = res.table("ledger"), res.table_attrs["ledger"]["message_names"]
    train = ledger["stage"] == 0
    for round_ in range(1, cfg.rounds + 1):
        sampled = sample_clients(cfg.seed, round_, np.arange(8), cfg.clients_per_round)
        for name in ("model", "delta"):
            rows = train & (ledger["round"] == round_) & (ledger["message"] == names.index(name))
            assert np.array_equal(np.sort(ledger["client"][rows]), sampled)
            assert np.all(ledger["bytes"][rows] == 4 * d)
    totals = logical_totals(res)["train"]
    assert totals["down"] == {"model": cfg.rounds * cfg.clients_per_round * 4 * d}
    assert totals["up"] == {"delta": cfg.rounds * cfg.clients_per_round * 4 * d}
    per_round = res.table("rounds")
    assert np.all(per_round["logical_up_bytes"] == cfg.clients_per_round * 4 * d)
    # evaluation traffic is accounted apart from the protocol's cost
    assert logical_totals(res)["eval"]["down"]["eval_model"] == cfg.rounds * 10 * 4 * d


def test_local_training_sends_nothing_and_is_evaluated_per_client(write_config, tmp_path):
    res = run(write_config({"algorithm": "local", "rounds": 4, "client": {"epochs": 5}}), tmp_path / "r.h5")
    assert "train" not in logical_totals(res)
    ev = res.table("eval")
    assert ev["local.seen.acc_pooled"][-1] > 0.5
    assert np.all(ev["cum_logical_bytes"] == 0)


def test_results_file_holds_config_metrics_and_metadata(write_config, tmp_path):
    config = write_config()
    res = run(config, tmp_path / "r.h5", "--set", "rounds=2")
    assert res.attrs["status"] == "completed" and res.attrs["rounds_completed"] == 2
    assert yaml.safe_load(res.attrs["config"])["rounds"] == 2
    assert res.attrs["world_size"] == 1 and res.attrs["mpi_library"]
    assert list(res.table("eval")["round"]) == [1, 2]
    rounds = res.table("rounds")
    assert np.all(rounds["sim_time_s"] > rounds["server_time_s"])
    clients = res.table("clients")
    assert clients["unseen"].sum() == 2 and np.all(clients["global.n_test"] > 0)
    ev = res.table("eval")
    assert 0 <= ev["global.unseen.acc_pooled"][-1] <= 1
    # pooled accuracy is the sample-weighted mean of the per-client accuracies
    seen = clients["unseen"] == 0
    w = clients["global.n_test"][seen]
    assert ev["global.seen.acc_pooled"][-1] == pytest.approx(np.sum(clients["global.acc"][seen] * w) / w.sum())


def test_simulated_time_follows_the_network_model(write_config, tmp_path):
    slow = run(write_config({"network": {"latency_s": 1.0, "up_mbps": 0.1, "down_mbps": 0.1}}), tmp_path / "a.h5")
    d = model_numel(slow)
    # two messages of 4d bytes at 0.1 Mbit/s plus two latencies dominate every round
    expected = 2 * 1.0 + 2 * 4 * d * 8 / 0.1e6
    sim = slow.table("rounds")["sim_time_s"]
    assert np.all(sim >= expected) and np.all(sim < expected + 5)


def test_report_and_plot(write_config, tmp_path, capsys):
    out = tmp_path / "r.h5"
    run(write_config(), out)
    summary = report(str(out))
    assert summary["status"] == "completed" and "global.seen.acc_pooled" in summary["final"]
    assert main(["report", str(out), "--json"]) == 0
    assert '"algorithm": "fedavg"' in capsys.readouterr().out
    png = tmp_path / "fig.png"
    assert main(["plot", str(out), "-o", str(png)]) == 0
    assert png.stat().st_size > 10_000


def test_results_are_replaced_atomically(write_config, tmp_path):
    out = tmp_path / "r.h5"
    run(write_config(), out)
    leftovers = [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert leftovers == []
    with h5py.File(out) as f:
        assert f.attrs["status"] == "completed"


def test_sampling_depends_only_on_seed_and_round():
    seen = np.arange(50)
    a = sample_clients(3, 7, seen, 10)
    assert np.array_equal(a, sample_clients(3, 7, seen, 10))
    assert not np.array_equal(a, sample_clients(3, 8, seen, 10))
    assert len(np.unique(a)) == 10 and np.all(np.diff(a) > 0)


def test_placement_balances_sample_counts():
    sizes = np.random.default_rng(0).lognormal(4, 1, size=500).astype(int) + 1
    placement = Placement.balanced(sizes, 5)
    loads = np.bincount(placement.owner, weights=sizes, minlength=5)
    assert loads[0] == 0 and set(np.unique(placement.owner)) == {1, 2, 3, 4}
    assert loads[1:].max() - loads[1:].min() <= sizes.max()
    assert np.all(Placement.balanced(sizes, 1).owner == 0)
    perm, counts = placement.rank_order(np.arange(20))
    assert np.all(np.diff(placement.owner[np.arange(20)][perm]) >= 0) and counts.sum() == 20


def test_round_placement_respreads_only_the_rounds_clients():
    sizes = np.random.default_rng(1).lognormal(4, 1.5, size=300).astype(int) + 1
    static = Placement.balanced(sizes, 3)
    clients = np.sort(np.random.default_rng(2).choice(300, 40, replace=False))
    placed = static.for_round(clients, sizes[clients])
    others = np.setdiff1d(np.arange(300), clients)
    assert np.array_equal(placed.owner[others], static.owner[others])
    loads = np.bincount(placed.owner[clients], weights=sizes[clients], minlength=3)
    static_loads = np.bincount(static.owner[clients], weights=sizes[clients], minlength=3)
    assert loads[0] == 0 and loads[1:].max() - loads[1:].min() <= sizes[clients].max()
    assert loads[1:].max() <= static_loads[1:].max()
    assert static.for_round(clients, sizes[clients]).owner.tolist() == placed.owner.tolist()  # same on every rank
    assert Placement.balanced(sizes, 1).for_round(clients, sizes[clients]).owner.max() == 0


def test_client_store_stages_generated_clients_lazily_and_drops_visitors():
    cpu = torch.device("cpu")
    generated = build_federated_dataset(DataConfig(dataset="gaussian_images", num_clients=100_000), 0)
    store = ClientStore(generated, np.arange(0, 100_000, 2), cpu)
    assert not store.loaded and len(store) == 50_000 and 4 in store and 5 not in store
    store.stage([2, 4])
    assert sorted(store.loaded) == [2, 4]
    store.visit(np.array([4, 5]))
    assert np.array_equal(store[5].x_train.numpy(), generated.load_clients([5])[5].x_train)
    store.end_visits()
    assert sorted(store.loaded) == [2, 4] and 5 not in store
    with pytest.raises(KeyError):
        store.stage([7])

    files = build_federated_dataset(DataConfig(dataset="digits", num_clients=6), 0)
    assert sorted(ClientStore(files, np.array([1, 3]), cpu).loaded) == [1, 3]  # read (and checked) up front
    assert generated.cheap_clients and files.cheap_clients  # both may place clients anew every round


@pytest.mark.parametrize("algorithm", ["fedavg", "local"])
def test_chunked_evaluation_changes_nothing_but_peak_memory(write_config, tmp_path, algorithm):
    whole = run(write_config({"algorithm": algorithm}), tmp_path / "whole.h5")
    chunked = run(write_config({"algorithm": algorithm, "eval_chunk": 3}), tmp_path / "chunked.h5")
    for table in ("eval", "ledger", "clients"):
        for key, values in whole.table(table).items():
            assert np.array_equal(values, chunked.table(table)[key], equal_nan=True), f"{table}/{key}"
