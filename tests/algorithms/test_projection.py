"""Karula's projection solvers and the W1 surrogate."""

from __future__ import annotations

import numpy as np
import ot
import pytest
from scipy import stats

from mpifl.algorithms.dissimilarity import dissimilarities, lot_embedding, reference_set
from mpifl.algorithms.projection import Projector, gram_sq_dists, pair_indices, round_robin

SOLVERS = ("dual", "dykstra")


def instance(seed: int, n: int, d: int, t: float) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    target = rng.normal(size=(n, d)) + rng.normal(size=d)  # an offset, so mean preservation is not trivial
    r2 = t * d * rng.uniform(0.2, 2.0, n * (n - 1) // 2)
    return target, r2


@pytest.mark.parametrize("solver", SOLVERS)
def test_t_zero_gives_the_plain_average(solver):
    target, r2 = instance(0, 7, 5, 0.0)
    result = Projector(r2, solver)(target)
    np.testing.assert_allclose(result.theta, np.tile(target.mean(0), (7, 1)), rtol=0, atol=1e-12)


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("seed,n,d,t", [(1, 8, 20, 0.3), (2, 11, 6, 0.1), (3, 16, 40, 0.05)])
def test_feasible_mean_preserving_and_certified(solver, seed, n, d, t):
    target, r2 = instance(seed, n, d, t)
    result = Projector(r2, solver, tol=1e-7)(target)
    sq = gram_sq_dists((result.theta - result.theta.mean(0)) @ (result.theta - result.theta.mean(0)).T)
    assert np.max(sq - r2) <= 1e-9 * r2.max()
    assert result.max_violation <= 1e-9 * r2.max()
    np.testing.assert_allclose(result.theta.mean(0), target.mean(0), atol=1e-12)
    centered = target - target.mean(0)
    assert 0 <= result.gap <= 1e-7 * 0.5 * np.sum(centered**2)
    assert np.max(gram_sq_dists(centered @ centered.T) - r2) > 0  # the instance is not trivially feasible


@pytest.mark.parametrize("seed", range(4))
def test_solvers_agree_within_their_certificates(seed):
    """½‖θ − Π(ϑ)‖² ≤ gap (strong convexity), so two certified answers are within √(2g₁) + √(2g₂)."""
    target, r2 = instance(10 + seed, 9 + seed, 12, 0.2)
    dual = Projector(r2, "dual", tol=1e-9)(target)
    dykstra = Projector(r2, "dykstra", tol=1e-9)(target)
    distance = np.linalg.norm(dual.theta - dykstra.theta)
    assert distance <= np.sqrt(2 * dual.gap) + np.sqrt(2 * dykstra.gap) + 1e-9
    assert np.linalg.norm(dual.theta - target) > 100 * distance  # the projection moved the point


@pytest.mark.parametrize("solver", SOLVERS)
def test_feasible_point_is_left_alone_and_warm_start_is_cheap(solver):
    target, r2 = instance(5, 6, 4, 100.0)
    result = Projector(r2, solver)(target)
    np.testing.assert_allclose(result.theta, target, atol=1e-12)
    tight, r2 = instance(6, 10, 8, 0.1)
    projector = Projector(r2, solver, tol=1e-6)
    first = projector(tight)
    again = projector(tight + 1e-4)
    assert again.iterations < first.iterations


@pytest.mark.parametrize("n", [5, 6, 9])
def test_round_robin_covers_every_pair_once(n):
    pairs = sorted((int(a), int(b)) for i, j in round_robin(n) for a, b in zip(i, j))
    assert pairs == sorted(zip(*(idx.tolist() for idx in pair_indices(n))))


def test_lot_surrogate_ranks_like_exact_w1():
    """D from one OT plan per client ranks client pairs as the exact empirical W1 (n(n−1)/2 plans) does."""
    rng = np.random.default_rng(0)
    clouds = [rng.normal(rng.uniform(-2, 2, 3), rng.uniform(0.5, 1.5), (int(rng.integers(30, 60)), 3))
              for _ in range(8)]
    reference = reference_set(0, 60, 3)
    embeddings = np.stack([lot_embedding(reference, c) for c in clouds])
    surrogate = dissimilarities(embeddings, "l21")
    exact = np.array([[ot.emd2(ot.unif(len(a)), ot.unif(len(b)), ot.dist(a, b, metric="euclidean")) for b in clouds]
                      for a in clouds])
    i, j = pair_indices(len(clouds))
    assert stats.spearmanr(surrogate[i, j], exact[i, j]).statistic > 0.9
    literal = dissimilarities(embeddings, "l1")
    assert stats.spearmanr(literal[i, j], exact[i, j]).statistic > 0.8
    for d in (surrogate, literal):  # a pseudo-metric: symmetric, zero diagonal, triangle inequality
        np.testing.assert_array_equal(d, d.T)
        assert not np.diag(d).any()
        assert (d[:, :, None] <= d[:, None, :] + d.T[None, :, :] + 1e-9).all()
