"""Federated datasets: a cheap layout shared by all ranks and per-client arrays loaded on demand.

The names below load on first use (PEP 562), so importing one submodule, such as the config sections that
``mpifl.config`` reads, loads neither the rest of the package nor torch, h5py or MPI."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mpifl.data.base import ClientSplit, FederatedDataset, FederatedLayout
    from mpifl.data.federated import build_federated_dataset
    from mpifl.data.synthetic import KarulaRidgeDataset

_HOMES = {name: module for module, names in {
    "mpifl.data.base": ("ClientSplit", "FederatedDataset", "FederatedLayout"),
    "mpifl.data.federated": ("build_federated_dataset",),
    "mpifl.data.synthetic": ("KarulaRidgeDataset",),
}.items() for name in names}
__all__ = ["ClientSplit", "FederatedDataset", "FederatedLayout", "KarulaRidgeDataset", "build_federated_dataset"]


def __getattr__(name: str) -> Any:  # noqa: ANN401 - whichever object the name stands for
    if name in _HOMES:
        return getattr(import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
