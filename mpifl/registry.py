"""Algorithm registry: name → (options schema, server side, client side), and run configs read with it.

Entries are imported on first use, one algorithm at a time: importing all of them would load
scipy, POT, scikit-learn and networkx into every rank of a FedAvg job (about 74 MB each). A name
that is not built in is a plug-in (:mod:`mpifl.plugins`): an entry point of group ``mpifl.algorithms``
or a ``module:attribute`` path whose object is a tuple like the built-in entries, with classes instead
of names: (options dataclass or None, ServerAlgorithm subclass, ClientAlgorithm subclass).

The registry sits above the algorithms in the import layers (it names their modules), and the config layer
below them knows the algorithms' option schemas only through the :class:`~mpifl.config.AlgorithmCatalog` the
registry hands it: :func:`parse_config` and :func:`load_config` are how a run config is read.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, is_dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpifl import plugins
from mpifl.config import REQUIRED, RunConfig, apply_overrides, build_config, check_required, load_raw
from mpifl.schema import ConfigError

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
    "fedbuff": ("fedbuff.FedBuffOptions", "fedbuff.FedBuffServer", "fedbuff.FedBuffClient"),
    "fedasync": ("fedasync.FedAsyncOptions", "fedasync.FedAsyncServer", "fedasync.FedAsyncClient"),
    "pfedme": ("pfedme.PFedMeOptions", "pfedme.PFedMeServer", "pfedme.PFedMeClient"),
    "ifca": ("ifca.IFCAOptions", "ifca.IFCAServer", "ifca.IFCAClient"),
    "pefll": ("pefll.PeFLLOptions", "pefll.PeFLLServer", "pefll.PeFLLClient"),
    "pfedhn": ("pfedhn.PFedHNOptions", "pfedhn.PFedHNServer", "pfedhn.PFedHNClient"),
    "perfedavg": ("perfedavg.PerFedAvgOptions", "perfedavg.PerFedAvgServer", "perfedavg.PerFedAvgClient"),
    "fedrep": ("fedrep.FedRepOptions", "fedrep.FedRepServer", "fedrep.FedRepClient"),
    "knnper": ("knnper.KNNPerOptions", "knnper.KNNPerServer", "knnper.KNNPerClient"),
}


def known_algorithms() -> list[str]:
    """The built-in algorithms (plug-ins: :func:`mpifl.plugins.installed`)."""
    return sorted(_REGISTRY)


@cache
def get_algorithm(name: str) -> AlgorithmEntry:
    """The algorithm ``name``: built in, else a plug-in, checked here (a ConfigError if it is not one)."""
    no_options = _load("context.NoOptions")
    if name in _REGISTRY:
        options, server, client = _REGISTRY[name]
        return AlgorithmEntry(name, _load(options) if options else no_options, _load(server), _load(client))
    value = plugins.resolve(plugins.ALGORITHMS, name, tuple(known_algorithms()))
    return _plugin_entry(name, value, no_options)


def _plugin_entry(name: str, value: Any, no_options: type) -> AlgorithmEntry:
    server_base, client_base = _load("base.ServerAlgorithm"), _load("base.ClientAlgorithm")
    fits = isinstance(value, (tuple, list)) and len(value) == 3
    if fits:
        options, server, client = value
        fits = ((options is None or isinstance(options, type) and is_dataclass(options))
                and isinstance(server, type) and issubclass(server, server_base)
                and isinstance(client, type) and issubclass(client, client_base))
    if not fits:
        raise ConfigError(f"algorithm: plug-in {name!r} must be a tuple (options dataclass or None, "
                          f"ServerAlgorithm subclass, ClientAlgorithm subclass), got {value!r}")
    from mpifl.algorithms.base import stale_overrides  # (loaded with the plug-in, as its bases above are)

    stale = [*stale_overrides(server), *stale_overrides(client)]
    if stale:  # an override mpifl would not call: refused, never silently ignored
        raise ConfigError(f"algorithm: plug-in {name!r}: {stale[0]}")
    return AlgorithmEntry(name, options or no_options, server, client)


def _load(path: str) -> type:
    module, cls = path.rsplit(".", 1)
    return getattr(importlib.import_module(f"mpifl.algorithms.{module}"), cls)


class _Catalog:
    """The registry as the config layer sees it (:class:`~mpifl.config.AlgorithmCatalog`)."""

    def options_type(self, name: str) -> type:
        return get_algorithm(name).options_type

    def builtin_names(self) -> list[str]:
        return known_algorithms()

    def plugin_names(self) -> list[str]:
        return plugins.installed(plugins.ALGORITHMS)


def parse_config(raw: dict[str, Any]) -> RunConfig:
    """Validate a raw mapping into a :class:`~mpifl.config.RunConfig` (static checks only, no data access)."""
    cfg = build_config(raw, _Catalog())
    if cfg.server.optimizer != "sgd" and not get_algorithm(cfg.algorithm).server.server_optimizer:
        raise ConfigError(f"server.optimizer: {cfg.server.optimizer} steps a global model from the averaged update; "
                          f"{cfg.algorithm}'s server has none (only sgd, the default, applies)")
    if cfg.server.device != "cpu" and not get_algorithm(cfg.algorithm).server.networks:
        raise ConfigError(f"server.device: {cfg.algorithm}'s server has no networks to put on a GPU (pefll's and "
                          "pfedhn's have); leave it cpu")
    return cfg


def load_config(path: str | Path, overrides: list[str] | None = None, required: tuple[str, ...] = REQUIRED
                ) -> RunConfig:
    """The run config in the YAML file ``path``, with ``--set`` ``overrides`` applied and ``required`` keys given."""
    raw = apply_overrides(load_raw(path), overrides or [])
    check_required(raw, path, required)
    return parse_config(raw)
