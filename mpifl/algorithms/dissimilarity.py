"""Karula's federated W1 surrogate (karula.md §2): a linear optimal-transport embedding per client.

Every client solves *one* exact OT problem, between the server's reference set 𝒟₀ (N0 points) and its own
points ξ = (x, y), instead of the n(n−1)/2 pairwise plans exact W1 would need. The barycentric map
M_i = N0·π_i·𝒟_i sends each reference point to the average of the client points it is matched to; the
embedding Φ_i = (M_i − 𝒟₀)/√N0 goes to the server, which compares embeddings row by row.

Points live in a standardized space: features (and a regression target) are z-scored with pooled
statistics the server forms from per-client sums, and a class label becomes a one-hot vector times
``label_scale``, so no coordinate dominates the ground metric by its units alone.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import ot

Metric = Literal["l21", "l1"]


def data_points(x: np.ndarray, y: np.ndarray, num_classes: int, label_scale: float) -> np.ndarray:
    """The OT points ξ = (flattened x, y) as float64 rows; y one-hot × ``label_scale`` for classification."""
    flat = x.reshape(len(x), -1).astype(np.float64)
    if num_classes == 0:
        label = y.reshape(-1, 1).astype(np.float64)
    else:
        label = np.zeros((len(y), num_classes))
        label[np.arange(len(y)), y] = label_scale
    return np.hstack([flat, label])


def moments(points: np.ndarray) -> np.ndarray:
    """[count, Σξ, Σξ²]: what a client shares so the server can pool means and variances exactly."""
    return np.concatenate([[len(points)], points.sum(axis=0), (points * points).sum(axis=0)])


def pooled_standardizer(rows: np.ndarray, continuous: int) -> np.ndarray:
    """[mean, std] (2p) of the pooled data from per-client :func:`moments` rows, summed in client order.
    Only the first ``continuous`` coordinates are scaled (one-hot labels are left alone); constant
    coordinates keep std 1."""
    total = np.zeros(rows.shape[1])
    for row in rows:
        total += row
    p = (len(total) - 1) // 2
    mean = total[1 : p + 1] / total[0]
    var = np.maximum(total[p + 1 :] / total[0] - mean * mean, 0.0)
    std = np.where(var > 0, np.sqrt(var), 1.0)
    mean[continuous:], std[continuous:] = 0.0, 1.0
    return np.concatenate([mean, std])


def reference_set(seed: int, size: int, dim: int) -> np.ndarray:
    """N0 i.i.d. N(0, I) points in the standardized space, drawn from the run seed alone."""
    return np.random.default_rng(np.random.SeedSequence([seed, 0x4B41524C])).standard_normal((size, dim))


def lot_embedding(reference: np.ndarray, points: np.ndarray) -> np.ndarray:
    """Φ = (N0·π·points − reference)/√N0 with π the exact Euclidean-cost OT plan (network simplex) between
    the uniform measures on ``reference`` and ``points``."""
    n0 = len(reference)
    cost = ot.dist(reference, points, metric="euclidean")
    plan = ot.emd(ot.unif(n0), ot.unif(len(points)), cost, numItermax=10_000_000)
    return (n0 * plan @ points - reference) / np.sqrt(n0)


def dissimilarities(embeddings: np.ndarray, metric: Metric = "l21") -> np.ndarray:
    """D (n×n) from embeddings [n, N0, p].

    ``l21``: D_ij = (1/N0) Σ_r ‖M_i[r] − M_j[r]‖₂ = (1/√N0) Σ_r ‖Φ_i[r] − Φ_j[r]‖₂, the W1 cost of moving
    T_i#μ₀ to T_j#μ₀ along the reference coupling (an upper bound on their W1). ``l1``: the paper's literal
    entrywise ‖Φ_i − Φ_j‖₁. Any constant factor is absorbed by t; the two differ in relative values.
    """
    n, n0 = embeddings.shape[:2]
    out = np.zeros((n, n))
    for i in range(n):
        diff = embeddings[i + 1 :] - embeddings[i]
        if metric == "l21":
            dist = np.sqrt(np.einsum("krp,krp->kr", diff, diff)).sum(axis=1) / np.sqrt(n0)
        else:
            dist = np.abs(diff).sum(axis=(1, 2))
        out[i, i + 1 :] = out[i + 1 :, i] = dist
    return out
