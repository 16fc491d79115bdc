"""Euclidean projection onto Karula's constraint set 𝒦 = {θ ∈ R^{n×d} : ‖θ_i − θ_j‖² ≤ r²_ij for all i < j}.

The projection has no closed form (karula.md §4), so Karula's server step is δ-inexact: it must return a
*feasible* point whose distance to ϑ exceeds the optimal one by a certified amount. Two solvers:

* ``dual`` (default): L-BFGS-B on the Lagrange dual, one multiplier λ_ij ≥ 0 per pair. For fixed λ the
  primal minimizer is θ(λ) = W ϑ with W = (I + L_λ)⁻¹ (L_λ the weighted graph Laplacian), so the dual value
  and gradient depend on ϑ only through the n×n Gram matrix Q = ϑϑᵀ. Cost: O(n²d) for Q and O(n²d) for the
  final θ = Wϑ, plus O(n³) per dual iteration; memory O(n² + nd). Between the two O(n²d) products the cost
  does not depend on d, which is what makes neural-network sized models affordable.
* ``dykstra``: Dykstra's alternating projections over the n − 1 perfect matchings of a round-robin
  schedule. Pairs within a matching are disjoint, so projecting onto a matching is one vectorized
  closed-form pair projection. Cost O(n²d) per sweep, memory O(n²d) for the corrections. Exact in the
  limit but slow when many constraints are active; it is the independent check of the dual solver.

Both warm-start from the previous call (λ, or Dykstra's corrections): consecutive rounds project nearby
points. Both finish with the same feasibility restoration, a contraction toward the client mean
θ̄ + c(θ − θ̄) with the largest c ≤ 1 that satisfies every constraint. It keeps the mean (as the exact
projection does) and makes weak duality certify the result:
``gap = ½‖θ − ϑ‖² − dual value ≥ ½‖θ − ϑ‖² − ½‖Π_𝒦(ϑ) − ϑ‖²``, i.e. Karula's δ times the step size η.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy import linalg, optimize
from threadpoolctl import threadpool_limits

Solver = Literal["dual", "dykstra"]


@dataclass(frozen=True)
class ProjectionResult:
    theta: np.ndarray  # float64 [n, d], feasible
    iterations: int  # dual iterations or Dykstra sweeps
    gap: float  # certified bound on ½‖θ − ϑ‖² − ½‖Π_𝒦(ϑ) − ϑ‖²
    max_violation: float  # max_ij ‖θ_i − θ_j‖² − r²_ij (≤ 0 up to rounding)


def pair_indices(n: int) -> tuple[np.ndarray, np.ndarray]:
    """The n(n−1)/2 pairs i < j in the order every pair vector (r², λ) uses."""
    return np.triu_indices(n, 1)


def gram_sq_dists(gram: np.ndarray) -> np.ndarray:
    """Pairwise squared distances ‖θ_i − θ_j‖² (pair order) from the Gram matrix θθᵀ."""
    i, j = pair_indices(len(gram))
    diag = np.diag(gram)
    return np.maximum(diag[i] + diag[j] - 2 * gram[i, j], 0.0)


def contraction(sq_dists: np.ndarray, r2: np.ndarray) -> float:
    """The largest c ≤ 1 such that c²·‖θ_i − θ_j‖² ≤ r²_ij for every pair."""
    over = sq_dists > r2
    if not over.any():
        return 1.0
    return float(np.sqrt(np.min(r2[over] / sq_dists[over])))


class Projector:
    """Π_𝒦 for fixed radii, solved to relative tolerance ``tol``: stop once the certified gap is at most
    ``tol`` · ½‖ϑ − ϑ̄‖² (the distance to consensus, which bounds the optimal value) or after ``max_iter``."""

    def __init__(self, r2: np.ndarray, solver: Solver = "dual", tol: float = 1e-6, max_iter: int = 10_000):
        self.r2 = np.asarray(r2, dtype=np.float64)
        self.n = int(round((1 + np.sqrt(1 + 8 * len(self.r2))) / 2))
        if self.n * (self.n - 1) // 2 != len(self.r2) or (self.r2 < 0).any():
            raise ValueError("r2 must hold n(n−1)/2 non-negative squared radii in pair order")
        self.solver, self.tol, self.max_iter = solver, tol, max_iter
        self._lam = np.zeros_like(self.r2)
        self._corrections: np.ndarray | None = None

    def __call__(self, target: np.ndarray) -> ProjectionResult:
        target = np.asarray(target, dtype=np.float64)
        mean = target.mean(axis=0)
        centered = target - mean
        scale = 0.5 * float(np.sum(centered * centered))
        if scale == 0.0 or not self.r2.any():  # consensus is the exact answer (t = 0: plain average)
            return ProjectionResult(np.broadcast_to(mean, target.shape).copy(), 0, 0.0, 0.0)
        solve = self._dual if self.solver == "dual" else self._dykstra
        with threadpool_limits(1, user_api="blas"):  # n×n algebra: threads only contend (and cost determinism)
            theta, iterations, gap, sq_dists = solve(centered, self.tol * scale)
        return ProjectionResult(theta + mean, iterations, gap, float(np.max(sq_dists - self.r2)))

    # ------------------------------------------------------------------ dual
    def _dual(self, centered: np.ndarray, tolerance: float) -> tuple[np.ndarray, int, float, np.ndarray]:
        dual = _LaplacianDual(gram_factor(centered), self.r2)
        best = dual.certificate(self._lam)
        iterations = 0

        def check(intermediate_result: optimize.OptimizeResult) -> None:
            nonlocal best, iterations
            iterations += 1
            certificate = dual.certificate(intermediate_result.x)
            best = min(best, certificate, key=lambda cert: cert[0])
            if certificate[0] <= tolerance:
                raise StopIteration

        if best[0] > tolerance:
            optimize.minimize(dual.negative, self._lam, jac=True, method="L-BFGS-B", callback=check,
                              bounds=optimize.Bounds(0.0, np.inf),
                              options={"maxiter": self.max_iter, "ftol": 0.0, "gtol": 0.0})
        gap, lam, c, factor, sq_dists = best
        self._lam = lam
        theta = c * linalg.cho_solve(factor, centered)
        return theta, iterations, gap, c * c * sq_dists

    # --------------------------------------------------------------- dykstra
    def _dykstra(self, centered: np.ndarray, tolerance: float) -> tuple[np.ndarray, int, float, np.ndarray]:
        schedule = round_robin(self.n)
        pairs_i, pairs_j = pair_indices(self.n)
        pair_id = np.empty((self.n, self.n), dtype=np.int64)
        pair_id[pairs_i, pairs_j] = np.arange(len(pairs_i))
        radii = [np.sqrt(self.r2[pair_id[a, b]]) for a, b in schedule]
        shape = (len(schedule), self.n // 2, centered.shape[1])
        if self._corrections is None or self._corrections.shape != shape:
            self._corrections = np.zeros(shape)
        corr = self._corrections
        x = centered.copy()  # invariant: x = ϑ − Σ corrections
        for (a, b), u in zip(schedule, corr):
            x[a] -= u
            x[b] += u
        best: tuple[float, int, np.ndarray, np.ndarray] | None = None
        for sweep in range(1, self.max_iter + 1):
            for (a, b), r, u in zip(schedule, radii, corr):
                x[a] += u
                x[b] -= u
                diff = x[a] - x[b]
                dist = np.sqrt(np.einsum("kd,kd->k", diff, diff))
                shrink = np.where(dist > r, 0.5 * (1.0 - r / np.where(dist > 0, dist, 1.0)), 0.0)
                np.multiply(diff, shrink[:, None], out=u)
                x[a] -= u
                x[b] += u
            sq_dists = gram_sq_dists(x @ x.T)
            c = contraction(sq_dists, self.r2)
            support = sum(float(r @ np.sqrt(np.einsum("kd,kd->k", u, u))) for r, u in zip(radii, corr))
            dual_value = 0.5 * float(np.sum(centered * centered) - np.sum(x * x)) - support
            gap = 0.5 * float(np.sum((c * x - centered) ** 2)) - dual_value
            if best is None or gap < best[0]:
                best = (gap, sweep, c * x, c * c * sq_dists)
            if gap <= tolerance:
                break
        if best is None:
            raise ValueError("projection: max_inner must be at least 1")
        gap, _, theta, sq_dists = best
        return theta, sweep, gap, sq_dists


def gram_factor(centered: np.ndarray) -> np.ndarray:
    """F with FFᵀ = ϑϑᵀ and at most min(n, d) columns: ϑ itself when d ≤ n, else from the Gram matrix
    (the only O(n²d) step of the dual solver besides the final θ = Wϑ)."""
    n, d = centered.shape
    if d <= n:
        return centered
    values, vectors = linalg.eigh(centered @ centered.T)
    keep = values > values[-1] * n * np.finfo(float).eps
    return vectors[:, keep] * np.sqrt(values[keep])


class _LaplacianDual:
    """g(λ) = ½ tr Q − ½ tr(W Q) − ½ λ·r² with W = (I + L_λ)⁻¹ and Q = FFᵀ the centered Gram matrix;
    ∂g/∂λ_ij = ½(‖θ_i − θ_j‖² − r²_ij) at θ = Wϑ (Danskin). Each evaluation is one Cholesky factorization
    of I + L_λ and one solve with F: O(n³), whatever d is. Q·1 = 0, so W never needs the mean."""

    def __init__(self, factor: np.ndarray, r2: np.ndarray):
        self.factor, self.r2 = factor, r2
        self.n = len(factor)
        self.trace = float(np.sum(factor * factor))
        self.i, self.j = pair_indices(self.n)
        self._cache: tuple | None = None

    def evaluate(self, lam: np.ndarray) -> tuple:
        """(g(λ), Cholesky factor of I + L_λ, squared pair distances of θ(λ), tr(WQ), tr(WQW))."""
        if self._cache is not None and np.array_equal(self._cache[0], lam):
            return self._cache[1:]
        system = np.zeros((self.n, self.n))
        system[self.i, self.j] = -lam
        system[self.j, self.i] = -lam
        system[np.diag_indices(self.n)] = 1.0 - system.sum(axis=1)
        cholesky = linalg.cho_factor(system)
        mixed = linalg.cho_solve(cholesky, self.factor)  # W F, so θ(λ)θ(λ)ᵀ = (WF)(WF)ᵀ
        tr_wq, tr_wqw = float(np.sum(self.factor * mixed)), float(np.sum(mixed * mixed))
        value = 0.5 * (self.trace - tr_wq) - 0.5 * float(lam @ self.r2)
        self._cache = (lam.copy(), value, cholesky, gram_sq_dists(mixed @ mixed.T), tr_wq, tr_wqw)
        return self._cache[1:]

    def negative(self, lam: np.ndarray) -> tuple[float, np.ndarray]:
        value, _, sq_dists, _, _ = self.evaluate(lam)
        return -value, -0.5 * (sq_dists - self.r2)

    def certificate(self, lam: np.ndarray) -> tuple[float, np.ndarray, float, tuple, np.ndarray]:
        """(gap, λ, c, Cholesky factor, squared distances of Wϑ) for the restored point c·Wϑ (centered)."""
        value, cholesky, sq_dists, tr_wq, tr_wqw = self.evaluate(lam)
        c = contraction(sq_dists, self.r2)
        primal = 0.5 * (c * c * tr_wqw - 2 * c * tr_wq + self.trace)
        return primal - value, lam.copy(), c, cholesky, sq_dists


def round_robin(n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """The circle method: n − 1 (n even) or n (n odd) matchings covering every pair exactly once."""
    players = list(range(n)) + ([-1] if n % 2 else [])
    m = len(players)
    rounds = []
    for _ in range(m - 1):
        pairs = [(players[k], players[m - 1 - k]) for k in range(m // 2)]
        pairs = [(min(p), max(p)) for p in pairs if -1 not in p]
        rounds.append((np.array([p[0] for p in pairs]), np.array([p[1] for p in pairs])))
        players = [players[0], players[-1], *players[1:-1]]
    return rounds
