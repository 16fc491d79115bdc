"""FedDeper: FedAvg's bytes, reduction to FedAvg at ρ = 0, rank invariance (its steps: test_references.py)."""

import numpy as np

from mpifl.report import logical_totals
from tests.algorithms.conftest import assert_rank_invariant


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


def test_results_do_not_depend_on_the_rank_count(run_algo, tmp_path):
    assert_rank_invariant(run_algo, tmp_path, "feddeper", {"clients_per_round": 3})
