"""FedProx: FedAvg's messages, and μ = 0 is FedAvg bitwise (its proximal step: test_references.py)."""

import numpy as np

from mpifl.report import logical_totals


def test_mu_zero_is_fedavg(run_algo):
    fedavg = run_algo("fedavg")
    free = run_algo("fedprox", {"fedprox": {"mu": 0.0}})
    assert np.array_equal(free.table("model")["global_model"], fedavg.table("model")["global_model"])
    assert logical_totals(free)["train"] == logical_totals(fedavg)["train"]
