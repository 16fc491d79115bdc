"""Model registry: builds the configured architecture for a dataset's input shape and task (:mod:`.build`).

The names below load on first use (PEP 562), so importing one submodule, such as the config sections that
``mpifl.config`` reads, loads neither the rest of the package nor torch, h5py or MPI."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mpifl.models.build import FlatModel, build_model, loss_function

_HOMES = {name: module for module, names in {
    "mpifl.models.build": ("FlatModel", "build_model", "loss_function"),
}.items() for name in names}
__all__ = ["FlatModel", "build_model", "loss_function"]


def __getattr__(name: str) -> Any:  # noqa: ANN401 - whichever object the name stands for
    if name in _HOMES:
        return getattr(import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
