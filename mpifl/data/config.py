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

    # gaussian_images: samples per client (the mean with size_sigma); leaf_synthetic draws its own sizes
    samples_per_client: int = field(default=64, metadata=limits(ge=1))
    # gaussian_images: client sizes log-normal with this sigma around samples_per_client (0: equal)
    size_sigma: float = field(default=0.0, metadata=limits(ge=0))
    num_classes: int = field(default=10, metadata=limits(ge=2))  # gaussian_images, leaf_synthetic: classes
    # gaussian_images: one sample's shape, (C, H, W) for images or e.g. [60] for tabular data
    image_shape: tuple[int, ...] = field(default=(1, 28, 28), metadata=limits(ge=1))
    num_features: int = field(default=60, metadata=limits(ge=1))  # leaf_synthetic, karula_ridge: input dimension
    # gaussian_images: x = mean[y]·class_separation + N(0, I), the class means shared by all clients
    class_separation: float = field(default=1.0, metadata=limits(ge=0))
    leaf_alpha: float = field(default=1.0, metadata=limits(ge=0))  # leaf_synthetic: std of a client's model mean u
    leaf_beta: float = field(default=1.0, metadata=limits(ge=0))  # leaf_synthetic: std of a client's feature mean B
    ridge_min_samples: int = field(default=10, metadata=limits(ge=1))  # karula_ridge: fewest training rows
    ridge_max_samples: int = field(default=100, metadata=limits(ge=1))  # karula_ridge: most training rows
    ridge_noise_std: float = field(default=1.0, metadata=limits(ge=0))  # karula_ridge: std of y's noise
    # std of each coordinate of a client's true θ around its group mean (Karula §5.1 leaves it open; 0.1 the
    # spec's proposal, 1 what the paper's Table 1(a) numbers point to: docs/papers/karula.md)
    ridge_theta_std: float = field(default=0.1, metadata=limits(ge=0))
    # karula_ridge: a client's feature group is its parameter group (aligned), or (id // 3) mod 3 (crossed: every
    # pair of groups occurs, so feature clusters cut across parameter clusters)
    ridge_feature_groups: Literal["aligned", "crossed"] = "aligned"


@dataclass(frozen=True)
class DataConfig:
    """The federated dataset: which data, how it is split over clients, and each client's train/val/test split
    (docs/tutorials/own-data.md)."""

    # digits (scikit-learn's, embedded), fashion_mnist (default root: Debian's /usr/share/datasets/fashion-mnist),
    # mnist (IDX), cifar10/cifar100 (python-pickle batches), svhn (train_32x32.mat, test_32x32.mat),
    # femnist/shakespeare (LEAF JSON train/, test/), gaussian_images, leaf_synthetic, karula_ridge; or a plug-in
    # (an entry point of group mpifl.datasets, or module:callable)
    dataset: str = "digits"
    root: str | None = None  # the folder with the dataset's standard files
    num_clients: int = field(default=10, metadata=limits(ge=1))  # clients (natural datasets: given by the data)
    # iid; classes: classes_per_client classes per client (PeFLL's balanced greedy); dirichlet: per class over
    # clients, Dir(alpha); dirichlet_pefll: per client, column-normalized; shards: McMahan's sorted-label shards;
    # natural: the data's writers/users. null: natural for femnist, shakespeare, leaf_synthetic, karula_ridge,
    # else iid
    partition: PartitionName | None = None
    classes_per_client: int = field(default=2, metadata=limits(ge=1))  # partition classes: classes per client
    alpha: float = field(default=0.5, metadata=limits(gt=0))  # partition dirichlet, dirichlet_pefll: concentration
    shards_per_client: int = field(default=2, metadata=limits(ge=1))  # partition shards: shards per client
    # this fraction of clients never train and are only evaluated: the last client ids (pooled data, whose ids are
    # already random), a seeded random choice of writers (LEAF)
    unseen_fraction: float = field(default=0.0, metadata=limits(ge=0, lt=1))
    # each client's validation split, stratified like its training split (report --select best-val uses it)
    val_fraction: float = field(default=0.0, metadata=limits(ge=0, lt=1))
    test_fraction: float = field(default=0.2, metadata=limits(gt=0, lt=1))  # each client's stratified test split
    max_clients: int | None = field(default=None, metadata=limits(ge=1))  # natural datasets: only the first k clients
    normalize: bool = True  # standardize the features (each dataset with its usual constants)
    # zero-pad images to this square size (e.g. 32 for FEMNIST into LeNet, 16 for digits)
    pad_to: int | None = field(default=None, metadata=limits(ge=1))
    synthetic: SyntheticConfig = SyntheticConfig()
    # read the clients from a federated-data file instead: an HDF5 file written by mpifl prepare for the same data
    # settings and seed (checked), or data partitioned elsewhere, one HDF5 file or a folder of .npz files
    # (docs/reference/data-format.md); no other data setting then applies
    prepared: str | None = None
    # a dataset plug-in's own settings, handed to it as they are (built-in datasets take none)
    options: dict[str, Any] = field(default_factory=dict)

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
