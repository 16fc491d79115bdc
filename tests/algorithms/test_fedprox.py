"""FedProx: FedAvg's messages; μ = 0 is FedAvg bitwise, μ > 0 pulls clients towards the global model."""

import numpy as np

from mpifl.config import parse_config
from mpifl.data import build_federated_dataset
from mpifl.models import FlatModel, build_model
from mpifl.report import logical_totals
from tests.algorithms.conftest import SHARDS


def test_mu_zero_is_fedavg(run_algo):
    fedavg = run_algo("fedavg")
    free = run_algo("fedprox", {"fedprox": {"mu": 0.0}})
    assert np.array_equal(free.table("model")["global_model"], fedavg.table("model")["global_model"])
    assert logical_totals(free)["train"] == logical_totals(fedavg)["train"]


def test_proximal_term_shortens_the_round_step(run_algo):
    one_round = {"rounds": 1, "eval_every": 1}
    cfg = parse_config(SHARDS)
    initial = FlatModel(build_model(cfg.model, build_federated_dataset(cfg.data, cfg.seed).layout, cfg.seed)).numpy()
    step = {}
    for name, extra in (("fedavg", {}), ("fedprox", {"fedprox": {"mu": 5.0}})):
        step[name] = np.linalg.norm(run_algo(name, {**one_round, **extra}).table("model")["global_model"] - initial)
    assert step["fedprox"] < 0.9 * step["fedavg"]
