"""Transport and accounting: message declarations, MPI collectives, ledger, network model.

The names below load on first use (PEP 562), so importing one submodule, such as the config sections that
``mpifl.config`` reads, loads neither the rest of the package nor torch, h5py or MPI."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mpifl.comm.ledger import Ledger, PhysicalLog
    from mpifl.comm.messages import LOCAL, LocalCompute, Message, Step
    from mpifl.comm.placement import Placement
    from mpifl.comm.transport import Transport

_HOMES = {name: module for module, names in {
    "mpifl.comm.ledger": ("Ledger", "PhysicalLog"),
    "mpifl.comm.messages": ("LOCAL", "LocalCompute", "Message", "Step"),
    "mpifl.comm.placement": ("Placement",),
    "mpifl.comm.transport": ("Transport",),
}.items() for name in names}
__all__ = ["LOCAL", "Ledger", "LocalCompute", "Message", "PhysicalLog", "Placement", "Step", "Transport"]


def __getattr__(name: str) -> Any:  # noqa: ANN401 - whichever object the name stands for
    if name in _HOMES:
        return getattr(import_module(_HOMES[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
