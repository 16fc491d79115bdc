"""Label partitioners, all expressed as a count matrix ``counts[client, class]``.

Working on class totals instead of sample indices keeps every partitioner vectorized (100,000
clients cost milliseconds), lets synthetic datasets use a virtual pool without materializing it,
and makes "every sample used at most once" hold by construction: a pooled dataset turns the
matrix into indices by cutting a shuffled copy of each class consecutively (see ``pooled.py``).
"""

from __future__ import annotations

import numpy as np

from mpifl.data.config import DataConfig
from mpifl.schema import ConfigError

DIRICHLET_MAX_DRAWS = 100  # redraws before giving up on a Dirichlet split with an empty client


def partition_counts(cfg: DataConfig, totals: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Dispatch ``cfg.partition`` over a pool with ``totals[c]`` samples of class ``c``."""
    n = cfg.num_clients
    if n > totals.sum():  # before any per-client array is made: num_clients may be any 64-bit count
        raise ConfigError(f"data.num_clients: {n} clients exceed the {int(totals.sum())} samples of "
                          f"{cfg.dataset!r}: some would get 0 training samples; use fewer clients")
    if cfg.partition == "iid":
        return iid_counts(totals, n, rng)
    if cfg.partition == "classes":
        return classes_counts(totals, n, cfg.classes_per_client, rng)
    if cfg.partition == "dirichlet":
        for _ in range(DIRICHLET_MAX_DRAWS):
            counts = dirichlet_counts(totals, n, cfg.alpha, rng)
            if split_counts(counts, cfg.test_fraction, cfg.val_fraction)[0].sum(1).min() > 0:
                return counts
        raise ConfigError(
            f"data.alpha: {DIRICHLET_MAX_DRAWS} Dirichlet(alpha={cfg.alpha}) draws all left a client without "
            f"training samples for {n} clients over {int(totals.sum())} samples; raise alpha or lower num_clients"
        )
    if cfg.partition == "dirichlet_pefll":
        return dirichlet_pefll_counts(totals, n, cfg.alpha, rng)
    if cfg.partition == "shards":
        return shards_counts(totals, n, cfg.shards_per_client, rng)
    raise ConfigError(f"data.partition: {cfg.partition!r} does not apply to pooled dataset {cfg.dataset!r}")


def iid_counts(totals: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """Sizes differing by at most one; class mix distributed exactly as cutting a uniformly shuffled
    pool into consecutive chunks. Drawn by recursive halving with vectorized hypergeometric draws,
    so the pool is never materialized."""
    size, extra = divmod(int(totals.sum()), n)
    bounds = np.concatenate([[0], np.cumsum(size + (np.arange(n) < extra))])
    out = np.zeros((n, len(totals)), dtype=np.int64)
    lo, hi, cnt = np.array([0]), np.array([n]), totals[None, :].astype(np.int64)
    while len(lo):
        leaf = hi - lo == 1
        out[lo[leaf]] = cnt[leaf]
        lo, hi, cnt = lo[~leaf], hi[~leaf], cnt[~leaf]
        mid = (lo + hi) // 2
        left = _multivariate_hypergeometric(cnt, bounds[mid] - bounds[lo], rng)
        lo, hi, cnt = np.concatenate([lo, mid]), np.concatenate([mid, hi]), np.concatenate([left, cnt - left])
    return out


def _multivariate_hypergeometric(colors: np.ndarray, nsample: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Row-wise draws of ``nsample[r]`` items without replacement from urns ``colors[r]``."""
    out = np.zeros_like(colors)
    remaining_sample = nsample.astype(np.int64)
    remaining_after = np.cumsum(colors[:, ::-1], axis=1)[:, ::-1] - colors  # items in later colors
    for c in range(colors.shape[1]):
        out[:, c] = rng.hypergeometric(colors[:, c], remaining_after[:, c], remaining_sample)
        remaining_sample = remaining_sample - out[:, c]
    return out


def classes_counts(totals: np.ndarray, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """PeFLL's pathological split: ``k`` distinct classes per client chosen by balanced greedy, each
    class shared equally among the clients holding it."""
    num_classes = len(totals)
    if k > num_classes:
        raise ConfigError(f"data.classes_per_client: {k} exceeds the {num_classes} classes of the dataset")
    held = balanced_greedy_classes(n, k, num_classes, rng)
    owner = np.zeros((n, num_classes), dtype=bool)
    owner[np.repeat(np.arange(n), k), held.ravel()] = True
    holders = owner.sum(0)
    rank = np.cumsum(owner, axis=0) - 1  # position of each client among the holders of a class
    base, extra = np.divmod(totals, np.maximum(holders, 1))
    return np.where(owner, base + (rank < extra), 0).astype(np.int64)


def balanced_greedy_classes(n: int, k: int, num_classes: int, rng: np.random.Generator) -> np.ndarray:
    """``held[i]``: client i's k distinct classes. Each pick takes, among the classes the client does
    not hold yet, one with the most remaining slots (``ceil(k·n/C)`` per class), ties broken at random.
    Classes are kept in buckets by remaining slots, so a pick costs O(C) at worst."""
    slots = -(-k * n // num_classes)
    buckets: dict[int, list[int]] = {slots: list(range(num_classes))}
    top = slots
    ties = rng.random((n, k))
    held = np.empty((n, k), dtype=np.int64)
    for i in range(n):
        mine: list[int] = []
        for j in range(k):
            level = top
            while True:
                candidates = [c for c in buckets.get(level, ()) if c not in mine]
                if candidates:
                    break
                level -= 1
            pick = candidates[int(ties[i, j] * len(candidates))]
            buckets[level].remove(pick)
            buckets.setdefault(level - 1, []).append(pick)
            while not buckets.get(top):
                top -= 1
            mine.append(pick)
        held[i] = mine
    return held


def dirichlet_counts(totals: np.ndarray, n: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """Hsu et al. (2019) as commonly implemented: for each class, proportions over the clients are
    drawn from Dir(alpha·1_n) and the class is cut at the cumulative proportions (all samples used)."""
    props = rng.dirichlet(np.full(n, alpha), size=len(totals))  # [C, n]
    edges = np.minimum(np.floor(np.cumsum(props, axis=1) * totals[:, None]).astype(np.int64), totals[:, None])
    edges[:, -1] = totals
    return np.diff(edges, axis=1, prepend=0).T.copy()


def dirichlet_pefll_counts(totals: np.ndarray, n: int, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """PeFLL's variant: pi_i ~ Dir(alpha·1_C) per client, normalized per class over clients; client i
    gets ``int(N_c · pi_i[c] / sum_j pi_j[c])`` samples of class c (the rounding leftovers go unused)."""
    pi = rng.dirichlet(np.full(len(totals), alpha), size=n)  # [n, C]
    col = pi.sum(0)
    share = np.divide(pi, col, out=np.zeros_like(pi), where=col > 0)
    return np.floor(totals * share).astype(np.int64)


def shards_counts(totals: np.ndarray, n: int, per_client: int, rng: np.random.Generator) -> np.ndarray:
    """McMahan et al. (2017): sort the pool by label, cut it into ``n·per_client`` equal shards
    (the remainder is dropped) and give each client ``per_client`` random shards."""
    num_shards = n * per_client
    length = int(totals.sum()) // num_shards
    if length == 0:
        raise ConfigError(
            f"data.shards_per_client: {int(totals.sum())} samples cannot be cut into {num_shards} non-empty shards "
            f"({n} clients x {per_client})"
        )
    start = np.arange(num_shards)[:, None] * length
    bounds = np.concatenate([[0], np.cumsum(totals)])
    overlap = np.minimum(bounds[None, 1:], start + length) - np.maximum(bounds[None, :-1], start)
    shard_counts = np.maximum(overlap, 0)  # [shards, C]: class c inside sorted positions [start, start+length)
    owner = rng.permutation(num_shards).reshape(n, per_client)
    return shard_counts[owner].sum(axis=1).astype(np.int64)


def apportion(counts: np.ndarray, fraction: float | np.ndarray) -> np.ndarray:
    """Per-row stratified share: each row takes ``round(row_total·fraction)`` items (``fraction``: one
    for all rows, or one per row), spread over the columns by largest remainder, so every column gets
    floor or ceil of its own share."""
    fraction = np.asarray(fraction, dtype=np.float64)
    exact = counts * (fraction[:, None] if fraction.ndim else fraction)
    base = np.floor(exact).astype(np.int64)
    target = np.floor(counts.sum(1) * fraction + 0.5).astype(np.int64)
    deficit = np.clip(target - base.sum(1), 0, counts.shape[1])
    order = np.argsort(-(exact - base), axis=1, kind="stable")
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(counts.shape[1])[None, :].repeat(len(counts), 0), axis=1)
    return base + (rank < deficit[:, None])


def split_counts(counts: np.ndarray, test_fraction: float, val_fraction: float) -> tuple[np.ndarray, ...]:
    """``(train, val, test)`` count matrices: test is ``test_fraction`` of each client, val is
    ``val_fraction`` of it taken from what test left, both stratified by class."""
    test = apportion(counts, test_fraction)
    rest = counts - test
    val = apportion(rest, val_fraction / (1.0 - test_fraction))
    return rest - val, val, test
