"""Algorithm registry: name → (options schema, server side, client side).

Entries are imported on first use, one algorithm at a time: importing all of them would load
scipy, POT, scikit-learn and networkx into every rank of a FedAvg job (about 74 MB each).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the registry names algorithm modules; it imports one only when asked for it
    from mpifl.algorithms.base import ClientAlgorithm, ServerAlgorithm


@dataclass(frozen=True)
class AlgorithmEntry:
    name: str
    options_type: type
    server: type[ServerAlgorithm]
    client: type[ClientAlgorithm]


# name → options class (None: no options), server class, client class, as "module.Class" in mpifl.algorithms
_REGISTRY: dict[str, tuple[str | None, str, str]] = {
    "fedavg": (None, "fedavg.FedAvgServer", "fedavg.FedAvgClient"),
    "local": ("local.LocalOptions", "local.LocalServer", "local.LocalClient"),
    "fedals": ("fedals.FedALSOptions", "fedals.FedALSServer", "fedals.FedALSClient"),
    "feddeper": ("feddeper.FedDeperOptions", "feddeper.FedDeperServer", "feddeper.FedDeperClient"),
    "fedprox": ("fedprox.FedProxOptions", "fedavg.FedAvgServer", "fedprox.FedProxClient"),
    "scaffold": (None, "scaffold.ScaffoldServer", "scaffold.ScaffoldClient"),
    "karula": ("karula.KarulaOptions", "karula.KarulaServer", "karula.KarulaClient"),
    "fedsgd": (None, "fedsgd.FedSGDServer", "fedsgd.FedSGDClient"),
    "pfedme": ("pfedme.PFedMeOptions", "pfedme.PFedMeServer", "pfedme.PFedMeClient"),
    "ifca": ("ifca.IFCAOptions", "ifca.IFCAServer", "ifca.IFCAClient"),
    "pefll": ("pefll.PeFLLOptions", "pefll.PeFLLServer", "pefll.PeFLLClient"),
    "pfedhn": ("pfedhn.PFedHNOptions", "pfedhn.PFedHNServer", "pfedhn.PFedHNClient"),
    "perfedavg": ("perfedavg.PerFedAvgOptions", "perfedavg.PerFedAvgServer", "perfedavg.PerFedAvgClient"),
    "fedrep": ("fedrep.FedRepOptions", "fedrep.FedRepServer", "fedrep.FedRepClient"),
    "knnper": ("knnper.KNNPerOptions", "knnper.KNNPerServer", "knnper.KNNPerClient"),
}


def known_algorithms() -> list[str]:
    return sorted(_REGISTRY)


@cache
def get_algorithm(name: str) -> AlgorithmEntry:
    options, server, client = _REGISTRY[name]
    no_options = _load("base.NoOptions")
    return AlgorithmEntry(name, _load(options) if options else no_options, _load(server), _load(client))


def _load(path: str) -> type:
    module, cls = path.rsplit(".", 1)
    return getattr(importlib.import_module(f"mpifl.algorithms.{module}"), cls)
