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
    from mpifl.algorithms.fedals import FedALSClient, FedALSOptions, FedALSServer
    from mpifl.algorithms.fedavg import FedAvgClient, FedAvgServer
    from mpifl.algorithms.feddeper import FedDeperClient, FedDeperOptions, FedDeperServer
    from mpifl.algorithms.fedprox import FedProxClient, FedProxOptions
    from mpifl.algorithms.fedsgd import FedSGDClient, FedSGDServer
    from mpifl.algorithms.ifca import IFCAClient, IFCAOptions, IFCAServer
    from mpifl.algorithms.karula import KarulaClient, KarulaOptions, KarulaServer
    from mpifl.algorithms.local import LocalClient, LocalServer
    from mpifl.algorithms.pefll import PeFLLClient, PeFLLOptions, PeFLLServer
    from mpifl.algorithms.pfedhn import PFedHNClient, PFedHNOptions, PFedHNServer
    from mpifl.algorithms.pfedme import PFedMeClient, PFedMeOptions, PFedMeServer
    from mpifl.algorithms.scaffold import ScaffoldClient, ScaffoldServer

    entries = [
        AlgorithmEntry("fedavg", NoOptions, FedAvgServer, FedAvgClient),
        AlgorithmEntry("local", NoOptions, LocalServer, LocalClient),
        AlgorithmEntry("fedals", FedALSOptions, FedALSServer, FedALSClient),
        AlgorithmEntry("feddeper", FedDeperOptions, FedDeperServer, FedDeperClient),
        AlgorithmEntry("fedprox", FedProxOptions, FedAvgServer, FedProxClient),
        AlgorithmEntry("scaffold", NoOptions, ScaffoldServer, ScaffoldClient),
        AlgorithmEntry("karula", KarulaOptions, KarulaServer, KarulaClient),
        AlgorithmEntry("fedsgd", NoOptions, FedSGDServer, FedSGDClient),
        AlgorithmEntry("pfedme", PFedMeOptions, PFedMeServer, PFedMeClient),
        AlgorithmEntry("ifca", IFCAOptions, IFCAServer, IFCAClient),
        AlgorithmEntry("pefll", PeFLLOptions, PeFLLServer, PeFLLClient),
        AlgorithmEntry("pfedhn", PFedHNOptions, PFedHNServer, PFedHNClient),
    ]
    return {e.name: e for e in entries}


def known_algorithms() -> list[str]:
    return sorted(_registry())


def get_algorithm(name: str) -> AlgorithmEntry:
    return _registry()[name]
