"""Synthetic generators. Every client's samples come from its own stream ``(seed, tag, client_id)``, so
a worker generates only its clients, and the layout is computed without generating images."""

from __future__ import annotations

import math

import numpy as np

from mpifl.data.base import (
    ClientSplit,
    FederatedDataset,
    FederatedLayout,
    Tag,
    image_transform,
    make_rng,
    padded_shape,
    require_training_samples,
    unseen_mask,
)
from mpifl.data.config import DataConfig
from mpifl.data.partition import apportion, partition_counts, split_counts
from mpifl.schema import INT64_MAX, ConfigError, gb, physical_memory


def _rows_split(x: np.ndarray, y: np.ndarray, sizes: tuple[int, ...]) -> ClientSplit:
    """Cut iid rows into consecutive (train, val, test) blocks."""
    a, b = sizes[0], sizes[0] + sizes[1]
    return ClientSplit(x[:a], y[:a], x[a:b], y[a:b], x[b:], y[b:])


class GaussianImagesDataset(FederatedDataset):
    """Class-conditional Gaussians: ``x = mean[y]·class_separation + N(0, I)``, class means shared by all
    clients. Label histograms come from the configured partitioner over a virtual balanced pool of
    ``num_clients·T`` samples, ``T = samples_per_client / (1 - test_fraction - val_fraction)`` rounded,
    so iid/classes/shards give every client T samples (about ``samples_per_client`` of them training)
    while the Dirichlet schemes vary sizes around it, as those schemes do. ``size_sigma > 0`` then
    rescales each client to a log-normal size of mean T (at least 2 samples), keeping its class mix."""

    generated = cheap_clients = True

    def __init__(self, cfg: DataConfig, seed: int):
        syn = cfg.synthetic
        self.seed, self.pad_to, self.separation = seed, cfg.pad_to, syn.class_separation
        self.shape = tuple(syn.image_shape)
        if not self.shape or min(self.shape) < 1:
            raise ConfigError(f"data.synthetic.image_shape: expected positive sizes, got {list(self.shape)}")
        per_client = int(round(syn.samples_per_client / (1.0 - cfg.test_fraction - cfg.val_fraction)))
        total = cfg.num_clients * per_client
        if total > INT64_MAX:
            raise ConfigError(f"data.num_clients: {cfg.num_clients} clients of {per_client} samples each are more "
                              "samples than a 64-bit count holds")
        check_label_counts(cfg, total)
        totals = total // syn.num_classes + (np.arange(syn.num_classes) < total % syn.num_classes)
        counts = partition_counts(cfg, totals.astype(np.int64), make_rng(seed, Tag.PARTITION))
        if syn.size_sigma > 0:  # unequal clients (as FEMNIST's), each keeping its class mix
            sigma = syn.size_sigma
            sizes = per_client * make_rng(seed, Tag.GAUSS_SIZES).lognormal(-sigma**2 / 2, sigma, cfg.num_clients)
            counts = apportion(counts, np.maximum(np.round(sizes), 2) / np.maximum(counts.sum(1), 1))
        self.splits = split_counts(counts, cfg.test_fraction, cfg.val_fraction)
        require_training_samples(self.splits[0].sum(1), f"partition {cfg.partition!r} of {total} virtual samples")
        self.means = make_rng(seed, Tag.GAUSS_MEANS).standard_normal((syn.num_classes, *self.shape), dtype=np.float32)
        self.layout = FederatedLayout(
            num_clients=cfg.num_clients,
            train_sizes=self.splits[0].sum(1),
            unseen=unseen_mask(cfg.num_clients, cfg.unseen_fraction),
            input_shape=padded_shape(self.shape, cfg.pad_to, cfg.dataset),
            num_classes=syn.num_classes,
            task="classification",
            input_dtype="float32",
            class_counts=self.splits[0],
        )

    def _load(self, client_ids: list[int]) -> dict[int, ClientSplit]:
        out = {}
        classes = np.arange(len(self.means))
        for c in client_ids:
            rng = make_rng(self.seed, Tag.GAUSS_SAMPLES, c)
            y = np.concatenate([rng.permutation(np.repeat(classes, split[c])) for split in self.splits])
            x = self.means[y] * np.float32(self.separation) + rng.standard_normal((len(y), *self.shape), np.float32)
            if len(self.shape) == 3:
                x = image_transform(x, None, None, self.pad_to)
            out[c] = _rows_split(x, y.astype(np.int64), tuple(int(s[c].sum()) for s in self.splits))
        return out


LABEL_COUNT_COPIES = 8
"""How many ``num_clients × num_classes`` count arrays of int64 the layout holds at once while it is built (the
partition, its halving, the splits): what :func:`check_label_counts` bounds."""
PARTITION_MAX_SAMPLES = 10**9
"""The partitioner's hypergeometric draws (numpy's) count fewer than 10⁹ items."""


def check_label_counts(cfg: DataConfig, total: int) -> None:
    """Refuse, before anything is allocated, a virtual pool the layout cannot be built for: more classes than
    samples, more samples than the partitioner counts, or label counts past half this machine's memory."""
    classes = cfg.synthetic.num_classes
    if classes > total:
        raise ConfigError(f"data.synthetic.num_classes: {classes:,} classes for {total:,} samples in all (every "
                          "class needs one)")
    if total >= PARTITION_MAX_SAMPLES:
        raise ConfigError(f"data.num_clients: {cfg.num_clients:,} clients of about "
                          f"{cfg.synthetic.samples_per_client:,} samples are {total:,} in all; the partition draws "
                          f"fewer than {PARTITION_MAX_SAMPLES:,}")
    held = LABEL_COUNT_COPIES * 8 * cfg.num_clients * classes + 4 * classes * math.prod(cfg.synthetic.image_shape)
    memory = physical_memory()
    if held > memory // 2:
        raise ConfigError(f"data.num_clients: {cfg.num_clients:,} clients × {classes:,} classes of label counts "
                          f"(and the class means) take about {gb(held)}, more than half this machine's memory "
                          f"({gb(memory)})")


class LeafSyntheticDataset(FederatedDataset):
    """LEAF Synthetic(alpha, beta) as generated by FedProx's ``generate_niid.py``: per client
    u ~ N(0, alpha²) (alpha is the std, as in that code), W ~ N(u, 1), b ~ N(u, 1), B ~ N(0, beta²),
    v ~ N(B, 1), x ~ N(v, diag(j^-1.2)), y = argmax(Wᵀx + b); client sizes ``int(lognormal(4, 2)) + 50``
    as in LEAF (``samples_per_client`` does not apply). Labels depend on x, so the layout generates
    every client once and keeps only the label histograms."""

    generated = cheap_clients = True

    def __init__(self, cfg: DataConfig, seed: int):
        syn = cfg.synthetic
        self.seed, self.alpha, self.beta = seed, syn.leaf_alpha, syn.leaf_beta
        self.num_features, self.num_classes = syn.num_features, syn.num_classes
        self.x_std = np.arange(1, syn.num_features + 1, dtype=np.float64) ** -0.6
        labels = [self._generate(c)[1] for c in range(cfg.num_clients)]
        totals = np.array([[len(y)] for y in labels], dtype=np.int64)
        train, val, test = split_counts(totals, cfg.test_fraction, cfg.val_fraction)
        self.sizes = np.hstack([train, val, test])
        require_training_samples(train[:, 0], "LEAF synthetic client sizes")
        train_labels = [y[:t] for y, t in zip(labels, train[:, 0], strict=True)]
        class_counts = np.stack([np.bincount(y, minlength=self.num_classes) for y in train_labels])
        self.layout = FederatedLayout(
            num_clients=cfg.num_clients,
            train_sizes=train[:, 0],
            unseen=unseen_mask(cfg.num_clients, cfg.unseen_fraction),
            input_shape=(syn.num_features,),
            num_classes=syn.num_classes,
            task="classification",
            input_dtype="float32",
            class_counts=class_counts.astype(np.int64),
        )

    def _generate(self, client: int) -> tuple[np.ndarray, np.ndarray]:
        rng = make_rng(self.seed, Tag.LEAF_SYNTHETIC, client)
        size = int(rng.lognormal(4, 2)) + 50
        u, b_shift = rng.normal(0, self.alpha), rng.normal(0, self.beta)
        v = rng.normal(b_shift, 1, self.num_features)
        w = rng.normal(u, 1, (self.num_features, self.num_classes))
        b = rng.normal(u, 1, self.num_classes)
        x = v + rng.standard_normal((size, self.num_features)) * self.x_std
        return x.astype(np.float32), np.argmax(x @ w + b, axis=1).astype(np.int64)

    def _load(self, client_ids: list[int]) -> dict[int, ClientSplit]:
        return {c: _rows_split(*self._generate(c), tuple(int(s) for s in self.sizes[c])) for c in client_ids}


RIDGE_THETA_MEANS = (1.0, 1.5, 2.0)
RIDGE_FEATURE_MEANS = (0.0, 0.5, 1.0)


class KarulaRidgeDataset(FederatedDataset):
    """Karula's 3-group ridge regression (karula.md §5.2 proposal): theta_i ~ N(m_g·1, theta_std²·I) with
    m_g in (1, 1.5, 2) for parameter group g = i mod 3; x ~ N(mu_f·1, I) with mu_f in (0, 0.5, 1) for
    feature group f = g ("aligned") or f = (i // 3) mod 3 ("crossed": every (g, f) pair occurs, so
    feature clusters cut across parameter clusters); N_i ~ U{min..max} training rows plus val/test rows
    in proportion; y = xᵀtheta_i + N(0, noise²)."""

    generated = cheap_clients = True

    def __init__(self, cfg: DataConfig, seed: int):
        syn = cfg.synthetic
        if syn.ridge_min_samples > syn.ridge_max_samples:
            raise ConfigError(
                f"data.synthetic.ridge_min_samples: {syn.ridge_min_samples} exceeds ridge_max_samples "
                f"{syn.ridge_max_samples}"
            )
        self.seed, self.num_features, self.noise = seed, syn.num_features, syn.ridge_noise_std
        self.theta_std = syn.ridge_theta_std
        ids = np.arange(cfg.num_clients)
        self.groups = ids % 3
        self.feature_groups = self.groups.copy() if syn.ridge_feature_groups == "aligned" else (ids // 3) % 3
        for arr in (self.groups, self.feature_groups):
            arr.setflags(write=False)
        rng = make_rng(seed, Tag.RIDGE_SIZES)
        train = rng.integers(syn.ridge_min_samples, syn.ridge_max_samples + 1, cfg.num_clients)
        scale = 1.0 - cfg.test_fraction - cfg.val_fraction
        held = [apportion(train[:, None], fraction / scale)[:, 0] for fraction in (cfg.val_fraction, cfg.test_fraction)]
        self.sizes = np.stack([train, *held], axis=1)
        self.layout = FederatedLayout(
            num_clients=cfg.num_clients,
            train_sizes=train.astype(np.int64),
            unseen=unseen_mask(cfg.num_clients, cfg.unseen_fraction),
            input_shape=(syn.num_features,),
            num_classes=0,
            task="regression",
            input_dtype="float32",
            class_counts=np.zeros((cfg.num_clients, 0), dtype=np.int64),
        )

    def true_parameters(self, client_id: int) -> np.ndarray:
        """The ground-truth theta (float64 [num_features]) client ``client_id``'s targets were drawn with."""
        mean = RIDGE_THETA_MEANS[self.groups[client_id]]
        return make_rng(self.seed, Tag.RIDGE_THETA, client_id).normal(mean, self.theta_std, self.num_features)

    def _load(self, client_ids: list[int]) -> dict[int, ClientSplit]:
        out = {}
        for c in client_ids:
            rng = make_rng(self.seed, Tag.RIDGE_SAMPLES, c)
            n = int(self.sizes[c].sum())
            x = rng.normal(RIDGE_FEATURE_MEANS[self.feature_groups[c]], 1.0, (n, self.num_features))
            y = x @ self.true_parameters(c) + rng.normal(0.0, self.noise, n)
            out[c] = _rows_split(x.astype(np.float32), y.astype(np.float32), tuple(int(s) for s in self.sizes[c]))
        return out
