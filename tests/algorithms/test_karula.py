"""Karula end to end on a small synthetic ridge problem: set-up bytes, the estimator, the t = 0 limit,
and rank invariance of Karula and the new baselines."""

from __future__ import annotations

import itertools
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

from mpifl.algorithms.base import RunContext
from mpifl.algorithms.karula import KarulaServer, curvature, estimation_errors, theory_step_size
from mpifl.data import build_federated_dataset
from mpifl.registry import parse_config
from mpifl.results import read_results
from mpifl.schema import ConfigError
from tests.algorithms.conftest import CLIENTS, FEATURES, KARULA, N0, RIDGE
from tests.conftest import _merge, rank_dependent, run_config


def run(tmp_path: Path, overrides: dict, ranks: int = 0, tag: str = "run") -> Path:
    config, out = tmp_path / f"{tag}.yaml", tmp_path / f"{tag}_p{ranks}.h5"
    config.write_text(yaml.safe_dump(_merge(RIDGE, overrides)))
    run_config(config, out, ranks)
    return out


def test_setup_messages_have_exact_bytes(tmp_path):
    res = read_results(run(tmp_path, KARULA))
    ledger, attrs = res.table("ledger"), res.table_attrs["ledger"]
    p, numel = FEATURES + 1, FEATURES + 1  # ξ = (x, y); a linear model has weights and a bias
    expected = {"data_moments": (2 * p + 1) * 8, "standardizer": 2 * p * 8, "reference_set": N0 * p * 4,
                "embedding": N0 * p * 4, "initial_gradient": numel * 4}
    setup = ledger["stage"] == attrs["stages"].index("setup")
    for name, nbytes in expected.items():
        rows = setup & (ledger["message"] == attrs["message_names"].index(name))
        assert sorted(ledger["client"][rows]) == list(range(CLIENTS)), name
        assert (ledger["bytes"][rows] == nbytes).all(), name
        assert (ledger["round"][rows] == 0).all()
    assert set(np.array(attrs["message_names"])[np.unique(ledger["message"][setup])]) == set(expected)
    rounds = res.table("rounds")
    assert (rounds["proj_max_violation"] <= 1e-9).all()
    assert np.isfinite(rounds["estimation_error"]).all() and (rounds["proj_delta"] >= 0).all()


@pytest.mark.parametrize("estimator", ["unbiased", "literal"])
def test_estimator_expectation_over_all_subsets(estimator):
    """Averaged over every s-subset, the default ν is the full gradient; the paper's literal form is not."""
    cfg = parse_config(_merge(RIDGE, {"karula": {"estimator": estimator, "reference_size": N0}}))
    layout = build_federated_dataset(cfg.data, cfg.seed).layout
    rng = np.random.default_rng(0)
    stale, fresh = rng.normal(size=(CLIENTS, 4)), rng.normal(size=(CLIENTS, 4))
    server = KarulaServer(RunContext(cfg, layout))
    subsets = list(itertools.combinations(range(CLIENTS), cfg.clients_per_round))
    mean = np.zeros_like(fresh)
    for subset in subsets:
        server.table = stale / CLIENTS
        mean += server.direction(np.array(subset), fresh[list(subset)]) / len(subsets)
    unbiased = np.allclose(mean, fresh / CLIENTS, rtol=1e-12, atol=1e-14)
    assert unbiased == (estimator == "unbiased")


def test_t_zero_with_full_participation_is_fedsgd(tmp_path):
    """t = 0 projects onto consensus and s = n makes ν exact, so Karula with η = n·lr is FedSGD."""
    full = {"clients_per_round": CLIENTS}
    karula = read_results(run(tmp_path, {**full, "karula": {"t": 0.0, "lr": CLIENTS * 0.01, "reference_size": N0}},
                              tag="karula"))
    fedsgd = read_results(run(tmp_path, {**full, "algorithm": "fedsgd"}, tag="fedsgd"))
    a, b = karula.table("eval"), fedsgd.table("eval")
    np.testing.assert_allclose(a["personal.seen.loss"], b["global.seen.loss"], rtol=1e-5)
    models = karula.table("model")["personal_models"]
    np.testing.assert_allclose(models, np.tile(fedsgd.table("model")["global_model"], (CLIENTS, 1)), rtol=1e-5)
    assert a["personal.seen.loss"][-1] < a["personal.seen.loss"][0]


def deterministic(path: Path) -> dict[str, np.ndarray]:
    """What must not depend on the rank count: evaluations, ledger, final models, solver statistics."""
    out = {}
    with h5py.File(path) as f:
        for table in ("eval", "ledger", "model", "clients", "rounds"):
            for key in f[table]:
                if not rank_dependent(key):
                    out[f"{table}/{key}"] = f[table][key][()]
    return out


@pytest.mark.parametrize("algorithm,overrides", [
    ("karula", KARULA),
    pytest.param("karula", {"karula": {**KARULA["karula"], "lr_rule": "theory"}}, marks=pytest.mark.slow),
    pytest.param("ifca", {"ifca": {"clusters": 2}}, marks=pytest.mark.slow),
    pytest.param("pfedme", {"pfedme": {"inner_steps": 2}}, marks=pytest.mark.slow),
    pytest.param("fedsgd", {}, marks=pytest.mark.slow),
])
def test_three_ranks_reproduce_one_bitwise(tmp_path, algorithm, overrides):
    settings = {"algorithm": algorithm, **overrides}
    one = deterministic(run(tmp_path, settings, ranks=0, tag=algorithm))
    three = deterministic(run(tmp_path, settings, ranks=3, tag=algorithm))
    assert one.keys() == three.keys()
    for key, value in one.items():
        assert np.array_equal(value, three[key], equal_nan=value.dtype.kind == "f"), key


def test_theta_std_scales_the_spread_around_the_group_means():
    """θ_i = m_g + theta_std·z_i with the same z_i for any theta_std: 0 gives the group means exactly."""
    def truth(std: float) -> np.ndarray:
        cfg = parse_config(_merge(RIDGE, {"data": {"synthetic": {"ridge_theta_std": std}}}))
        dataset = build_federated_dataset(cfg.data, cfg.seed)
        return np.stack([dataset.true_parameters(c) for c in range(CLIENTS)])

    means = np.array([1.0, 1.5, 2.0, 1.0, 1.5, 2.0])[:, None]  # group g = i mod 3
    np.testing.assert_array_equal(truth(0.0), np.broadcast_to(means, (CLIENTS, FEATURES)))
    np.testing.assert_allclose(truth(2.0) - means, 2 * (truth(1.0) - means), rtol=1e-12)
    with pytest.raises(ConfigError, match="ridge_theta_std"):
        parse_config(_merge(RIDGE, {"data": {"synthetic": {"ridge_theta_std": -1}}}))


def test_estimation_error_squared_and_norm_by_hand():
    models, truth = np.array([[3.0, 4.0], [1.0, 1.0]]), np.array([[0.0, 0.0], [1.0, 2.0]])
    np.testing.assert_array_equal(estimation_errors(models, truth), [25.0, 1.0])
    np.testing.assert_array_equal(estimation_errors(models, truth, "norm"), [5.0, 1.0])


def test_logged_norm_error_is_the_mean_distance_of_the_final_models(tmp_path):
    res = read_results(run(tmp_path, {**KARULA, "karula": {**KARULA["karula"], "estimation_error": "norm"}}))
    cfg = parse_config(_merge(RIDGE, KARULA))
    dataset = build_federated_dataset(cfg.data, cfg.seed)
    truth = np.stack([np.append(dataset.true_parameters(c), 0.0) for c in range(CLIENTS)])
    models = res.table("model")["personal_models"]
    expected = np.mean(np.linalg.norm(models - truth, axis=1))
    assert np.isclose(res.table("rounds")["estimation_error"][-1], expected, rtol=1e-12)


def test_curvature_of_a_hand_quadratic():
    """∇(p) = A·p − b with A = [[3, 1], [1, 3]]: eigenvalues 4 and 2, so λ_max = 4."""
    a, b = np.array([[3.0, 1.0], [1.0, 3.0]]), np.array([1.0, -2.0])
    assert np.isclose(curvature(lambda p: a @ p - b, np.zeros(2), np.array([1.0, 0.0])), 4.0, rtol=1e-10)
    assert theory_step_size(np.array([0.5, 2.0]), np.array([4.0, 1.0])) == (3 / 16, 2.0)  # L = max(2, 2)
    with pytest.raises(ConfigError, match="lr_rule"):
        theory_step_size(np.ones(2), np.zeros(2))


def test_theory_step_size_is_three_eighths_over_the_ridge_smoothness(tmp_path):
    """η = 3/(8L), L = max_i α_i·λ_max(2/N_i·Z_iᵀZ_i + wd·I), Z_i = [X_i, 1] (MSE of a linear model)."""
    theory = {"karula": {**KARULA["karula"], "lr_rule": "theory"}}
    res = read_results(run(tmp_path, theory))
    cfg = parse_config(_merge(RIDGE, theory))
    dataset = build_federated_dataset(cfg.data, cfg.seed)
    splits = dataset.load_clients(range(CLIENTS))
    sizes = dataset.layout.train_sizes.astype(np.float64)
    curv = []
    for c in range(CLIENTS):
        z = np.hstack([splits[c].x_train.astype(np.float64), np.ones((len(splits[c].x_train), 1))])
        curv.append(np.linalg.eigvalsh(2 / len(z) * z.T @ z)[-1] + cfg.client.weight_decay)
    smoothness = np.max(CLIENTS * sizes / sizes.sum() * np.array(curv))
    rounds = res.table("rounds")
    np.testing.assert_allclose(rounds["smoothness_L"], smoothness, rtol=1e-4)
    np.testing.assert_allclose(rounds["step_size"], 3 / (8 * smoothness), rtol=1e-4)
    ledger, attrs = res.table("ledger"), res.table_attrs["ledger"]
    rows = ledger["message"] == attrs["message_names"].index("curvature")
    assert sorted(ledger["client"][rows]) == list(range(CLIENTS)) and (ledger["bytes"][rows] == 8).all()
