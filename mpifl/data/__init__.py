"""Federated datasets: a cheap layout shared by all ranks and per-client arrays loaded on demand."""

from mpifl.data.base import ClientSplit, FederatedDataset, FederatedLayout
from mpifl.data.federated import build_federated_dataset
from mpifl.data.synthetic import KarulaRidgeDataset

__all__ = ["ClientSplit", "FederatedDataset", "FederatedLayout", "KarulaRidgeDataset", "build_federated_dataset"]
