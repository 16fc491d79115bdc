"""Algorithm registry: name → (options schema, server side, client side)."""

from __future__ import annotations

from dataclasses import dataclass

from mpifl.algorithms.base import ClientAlgorithm, NoOptions, ServerAlgorithm


@dataclass(frozen=True)
class AlgorithmEntry:
    name: str
    options_type: type
    server: type[ServerAlgorithm]
    client: type[ClientAlgorithm]


def _registry() -> dict[str, AlgorithmEntry]:
    from mpifl.algorithms.fedavg import FedAvgClient, FedAvgServer
    from mpifl.algorithms.local import LocalClient, LocalServer

    entries = [
        AlgorithmEntry("fedavg", NoOptions, FedAvgServer, FedAvgClient),
        AlgorithmEntry("local", NoOptions, LocalServer, LocalClient),
    ]
    return {e.name: e for e in entries}


def known_algorithms() -> list[str]:
    return sorted(_registry())


def get_algorithm(name: str) -> AlgorithmEntry:
    return _registry()[name]
