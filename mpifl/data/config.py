"""The ``data:`` section of a run config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from mpifl import plugins
from mpifl.schema import ConfigError, limits

DATASETS = (
    "digits",
    "fashion_mnist",
    "mnist",
    "cifar10",
    "cifar100",
    "svhn",
    "femnist",
    "shakespeare",
    "gaussian_images",
    "leaf_synthetic",
    "karula_ridge",
)
"""The built-in datasets; any other name is a plug-in (:mod:`mpifl.plugins`)."""
PLUGIN_CONTRACT = "a callable (data config, seed) -> (features, labels)"
NATURAL_DATASETS = ("femnist", "shakespeare", "leaf_synthetic", "karula_ridge")
"""Datasets whose clients are defined by the data itself (writers, users, generated client distributions)."""
PartitionName = Literal["iid", "classes", "dirichlet", "dirichlet_pefll", "shards", "natural"]


@dataclass(frozen=True)
class SyntheticConfig:
    """Knobs of the synthetic generators (ignored by file-backed datasets)."""

    samples_per_client: int = field(default=64, metadata=limits(ge=1))
    # gaussian_images: client sizes log-normal with this sigma around samples_per_client (0: equal)
    size_sigma: float = field(default=0.0, metadata=limits(ge=0))
    num_classes: int = field(default=10, metadata=limits(ge=2))
    image_shape: tuple[int, ...] = field(default=(1, 28, 28), metadata=limits(ge=1))
    num_features: int = field(default=60, metadata=limits(ge=1))
    class_separation: float = field(default=1.0, metadata=limits(ge=0))
    leaf_alpha: float = field(default=1.0, metadata=limits(ge=0))
    leaf_beta: float = field(default=1.0, metadata=limits(ge=0))
    ridge_min_samples: int = field(default=10, metadata=limits(ge=1))
    ridge_max_samples: int = field(default=100, metadata=limits(ge=1))
    ridge_noise_std: float = field(default=1.0, metadata=limits(ge=0))
    # std of each coordinate of a client's true θ around its group mean (Karula §5.1 leaves it open; 0.1 the
    # spec's proposal, 1 what the paper's Table 1(a) numbers point to: docs/karula.md)
    ridge_theta_std: float = field(default=0.1, metadata=limits(ge=0))
    ridge_feature_groups: Literal["aligned", "crossed"] = "aligned"


@dataclass(frozen=True)
class DataConfig:
    dataset: str = "digits"  # one of DATASETS, or a plug-in: entry point of group mpifl.datasets, module:callable
    root: str | None = None
    num_clients: int = field(default=10, metadata=limits(ge=1))
    partition: PartitionName | None = None  # None: 'natural' where the data defines clients, else 'iid'
    classes_per_client: int = field(default=2, metadata=limits(ge=1))
    alpha: float = field(default=0.5, metadata=limits(gt=0))
    shards_per_client: int = field(default=2, metadata=limits(ge=1))
    unseen_fraction: float = field(default=0.0, metadata=limits(ge=0, lt=1))
    val_fraction: float = field(default=0.0, metadata=limits(ge=0, lt=1))
    test_fraction: float = field(default=0.2, metadata=limits(gt=0, lt=1))
    max_clients: int | None = field(default=None, metadata=limits(ge=1))
    normalize: bool = True
    pad_to: int | None = field(default=None, metadata=limits(ge=1))
    synthetic: SyntheticConfig = SyntheticConfig()
    prepared: str | None = None  # federated-data HDF5 file or .npz directory (docs/data_format.md)
    options: dict[str, Any] = field(default_factory=dict)  # a plug-in's own settings, handed to it as they are

    @property
    def source(self) -> str:
        """Where the clients' data comes from, in words (the start-up line)."""
        return f"prepared data {self.prepared}" if self.prepared else self.dataset

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:  # a plug-in is imported and checked with the config, not at training
            loader = plugins.resolve(plugins.DATASETS, self.dataset, DATASETS)
            plugins.require_callable(plugins.DATASETS, self.dataset, loader, PLUGIN_CONTRACT)
        elif self.options:
            raise ConfigError(f"data.options: only plug-in datasets take options; {self.dataset!r} is built in")
        if self.partition is None:
            natural = self.dataset in NATURAL_DATASETS
            object.__setattr__(self, "partition", "natural" if natural else "iid")
