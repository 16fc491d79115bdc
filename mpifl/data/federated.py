"""``build_federated_dataset``: the one entry point, checking the config combination before any I/O."""

from __future__ import annotations

import numbers

from mpifl.data.base import FederatedDataset, dataset_root
from mpifl.data.config import DATASETS, NATURAL_DATASETS, DataConfig
from mpifl.data.leaf import LeafDataset
from mpifl.data.pooled import PooledDataset, cifar_pool, digits_pool, idx_pool, plugin_pool, svhn_pool
from mpifl.data.synthetic import GaussianImagesDataset, KarulaRidgeDataset, LeafSyntheticDataset
from mpifl.schema import ConfigError

POOLS = {
    "digits": digits_pool,
    "mnist": idx_pool,
    "fashion_mnist": idx_pool,
    "cifar10": cifar_pool,
    "cifar100": cifar_pool,
    "svhn": svhn_pool,
}
LEAF_DATASETS = ("femnist", "shakespeare")  # test rows come from LEAF's own test split: test_fraction unused



def build_federated_dataset(cfg: DataConfig, seed: int) -> FederatedDataset:
    """The federated dataset of ``cfg``: a deterministic function of ``(cfg, seed)``, so every rank
    builds the same layout without talking to the others."""
    if not isinstance(seed, numbers.Integral) or seed < 0:
        raise ConfigError(f"seed: expected a non-negative integer for the data streams, got {seed!r}")
    seed = int(seed)
    if cfg.prepared is not None:
        from mpifl.data.prepared import open_prepared

        return open_prepared(cfg, seed)
    if cfg.dataset not in LEAF_DATASETS and cfg.test_fraction + cfg.val_fraction >= 1:
        raise ConfigError(
            f"data.val_fraction: test_fraction + val_fraction = {cfg.test_fraction + cfg.val_fraction} leaves "
            "nothing to train on; it must be < 1"
        )
    natural = cfg.dataset in NATURAL_DATASETS
    if natural != (cfg.partition == "natural"):
        expected = "'natural'" if natural else "one of 'iid', 'classes', 'dirichlet', 'dirichlet_pefll', 'shards'"
        raise ConfigError(f"data.partition: dataset {cfg.dataset!r} needs partition {expected}, got {cfg.partition!r}")
    if cfg.dataset in POOLS:
        return PooledDataset(cfg, seed, POOLS[cfg.dataset](cfg))
    if cfg.dataset not in DATASETS:  # a plug-in's (features, labels), partitioned like a built-in pool
        return PooledDataset(cfg, seed, plugin_pool(cfg, seed))
    if cfg.dataset in LEAF_DATASETS:
        return LeafDataset(cfg, dataset_root(cfg, "LEAF's train/ and test/ folders"), seed)
    if cfg.dataset == "gaussian_images":
        return GaussianImagesDataset(cfg, seed)
    if cfg.dataset == "leaf_synthetic":
        return LeafSyntheticDataset(cfg, seed)
    return KarulaRidgeDataset(cfg, seed)
