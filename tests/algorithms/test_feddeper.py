"""FedDeper: FedAvg's bytes, reduction to FedAvg at ρ = 0, personalized state that survives any rank count."""

import numpy as np
from mpi4py import MPI

from mpifl.config import parse_config
from mpifl.report import logical_totals
from mpifl.runtime.engine import Engine
from tests.algorithms.conftest import SHARDS, _merge, assert_rank_invariant


def test_same_bytes_as_fedavg_and_two_evaluated_models(run_algo):
    fedavg, deper = run_algo("fedavg"), run_algo("feddeper")
    assert logical_totals(deper)["train"] == logical_totals(fedavg)["train"]
    assert np.array_equal(deper.table("rounds")["logical_up_bytes"], fedavg.table("rounds")["logical_up_bytes"])
    assert list(deper.attrs["eval_kinds"]) == ["global", "personal"]
    clients = deper.table("clients")
    assert np.all(np.isfinite(clients["personal.acc"])) and np.all(np.isfinite(clients["global.acc"]))


def test_without_the_penalty_the_global_model_is_fedavg(run_algo):
    """ρ = 0 leaves y's steps plain SGD on the same batches, so x follows FedAvg bitwise (v only evaluates)."""
    fedavg = run_algo("fedavg")
    deper = run_algo("feddeper", {"feddeper": {"rho": 0.0}})
    assert np.array_equal(deper.table("model")["global_model"], fedavg.table("model")["global_model"])
    penalized = run_algo("feddeper", {"feddeper": {"rho": 0.03}}, tag="rho")
    assert not np.array_equal(penalized.table("model")["global_model"], fedavg.table("model")["global_model"])


def test_personal_models_mix_and_persist_only_for_sampled_clients(tmp_path):
    """v_i = (1 − λ)v + λy after each participation; unsampled clients keep theirs (here: the initial model)."""
    cfg = parse_config(_merge(SHARDS, {"algorithm": "feddeper", "rounds": 1, "eval_every": 1, "clients_per_round": 2,
                                       "feddeper": {"mixing": 1.0, "rho": 0.0}}))
    engine = Engine(cfg, MPI.COMM_SELF, tmp_path / "e.h5")
    engine.setup()
    engine.run(progress=False)
    client = engine.client
    sampled = client.state.clients()
    assert len(sampled) == 2
    for c in range(cfg.data.num_clients):
        client.eval_model(c, "personal")
        mine = client.workspace.numpy().copy()
        if c in sampled:  # λ = 1, ρ = 0: v is the client's own trained y, i.e. x⁰ + its delta
            assert not np.array_equal(mine, client.initial)
        else:
            assert np.array_equal(mine, client.initial)


def test_results_do_not_depend_on_the_rank_count(run_algo, tmp_path):
    assert_rank_invariant(run_algo, tmp_path, "feddeper", {"clients_per_round": 3})
