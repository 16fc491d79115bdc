"""The run configuration: YAML → validated, frozen :class:`RunConfig`.

Top-level names (``algorithm``, ``rounds``, ``clients_per_round``, ``seed``, ``eval_every``,
``checkpoint_every``, ``data``, ``model``, ``client``, ``server``, ``network``) are stable so
scripts can rely on them. Algorithm-specific options live in a section named after the
algorithm (e.g. ``fedprox: {mu: 0.01}``), validated by that algorithm's own schema; a config may hold
the sections of several algorithms (each validated), and the one named by ``algorithm`` applies.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, Protocol

import yaml

from mpifl.comm.config import CompressionConfig, NetworkConfig, PrivacyConfig, SecAggConfig
from mpifl.data.config import DataConfig
from mpifl.models.config import ModelConfig
from mpifl.schema import ConfigError, build, limits, to_dict
from mpifl.training.config import ClientConfig


@dataclass(frozen=True)
class ServerConfig:
    """Server optimizer applied to the aggregated pseudo-gradient."""

    lr: float = field(default=1.0, metadata=limits(gt=0))
    momentum: float = field(default=0.0, metadata=limits(ge=0, lt=1))
    # how the server averages updates: by sample count (FedAvg), or equally (DP-FedAvg's noise is calibrated to
    # the uniform mean, whose sensitivity to one client is clip / cohort)
    weighting: Literal["samples", "uniform"] = "samples"


@dataclass(frozen=True)
class FaultsConfig:
    """Faults the simulator emulates; every decision is a function of (seed, round, client) only."""

    dropout: float = field(default=0.0, metadata=limits(ge=0, lt=1))  # a sampled client fails before it sends
    deadline_s: float | None = field(default=None, metadata=limits(gt=0))  # drop clients expected to finish later
    over_selection: float = field(default=0.0, metadata=limits(ge=0))  # sample (1+o)·m, keep the m fastest
    nonfinite: Literal["skip", "abort"] = "skip"  # an update with NaN/Inf: drop that client, or stop the job
    corrupt: float = field(default=0.0, metadata=limits(ge=0, le=1))  # a participant's uploads arrive as NaN


@dataclass(frozen=True)
class RunConfig:
    algorithm: str = "fedavg"
    rounds: int = field(default=10, metadata=limits(ge=1))
    clients_per_round: int = field(default=5, metadata=limits(ge=1))
    seed: int = field(default=0, metadata=limits(ge=0))
    eval_every: int = field(default=1, metadata=limits(ge=1))
    checkpoint_every: int = field(default=0, metadata=limits(ge=0))
    eval_chunk: int = field(default=0, metadata=limits(ge=0))  # clients per evaluation pass; 0: all at once
    # torch's intra-op threads on every rank: a fixed count keeps results bitwise the same on any rank count
    # (another count may change the bits, as it changes how reductions are split)
    threads_per_rank: int = field(default=1, metadata=limits(ge=1))
    # client data a worker keeps between uses (GB); beyond it the least recently used clients are made or read
    # again when next needed, so a worker's memory does not grow with the clients it evaluates
    data_memory_gb: float = field(default=1.0, metadata=limits(ge=0))
    # committed client state a rank keeps in memory (GB; none: all of it); beyond it the least recently used
    # clients' states spill to files in state_spill_dir (default: the system's temporary folder), same results
    state_memory_gb: float | None = field(default=None, metadata=limits(ge=0))
    state_spill_dir: str | None = None
    device: Literal["auto", "cpu", "cuda"] = "cpu"
    # static: each client lives on one worker for the whole run. dynamic: each round's clients are
    # re-spread over the workers by their work, state and all. auto: dynamic where allowed
    # and where reading another client is cheap (generated data, uncompressed IDX, digits).
    placement: Literal["auto", "static", "dynamic"] = "auto"
    output: str = "results/run.h5"
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    client: ClientConfig = ClientConfig()
    server: ServerConfig = ServerConfig()
    network: NetworkConfig = NetworkConfig()
    faults: FaultsConfig = FaultsConfig()
    compression: CompressionConfig = CompressionConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    # counts the bytes and round trips of secure aggregation of the updates (the sum itself is computed in the clear)
    secure_aggregation: Literal["none", "secagg", "secagg_plus"] = "none"
    secagg: SecAggConfig = SecAggConfig()
    algorithm_options: Any = None  # the algorithm's own frozen options, built from its section


def _parse_scalar(text: str) -> Any:
    """Interpret a ``--set`` value the way YAML would (``0.1`` → float, ``[1, 2]`` → list)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set value {text!r} is not valid YAML: {exc}") from None


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=value`` overrides to a raw config mapping (returns a copy)."""
    out = copy.deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, text = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ConfigError(f"--set key {key!r} is empty or malformed")
        node = out
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"--set {key}: {part!r} is not a section")
            node = child
        node[parts[-1]] = _parse_scalar(text)
    return out


def load_raw(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of config keys")
    return raw


class AlgorithmCatalog(Protocol):
    """Where the algorithms' option schemas come from (:mod:`mpifl.registry`, which sits above the algorithms:
    the config layer never imports them)."""

    def options_type(self, name: str) -> type:
        """The options dataclass of algorithm ``name`` (a :class:`ConfigError` for a name that is none)."""

    def builtin_names(self) -> list[str]:
        """The built-in algorithms."""

    def plugin_names(self) -> list[str]:
        """The installed plug-in algorithms (package metadata only: nothing is imported)."""


def build_config(raw: dict[str, Any], algorithms: AlgorithmCatalog) -> RunConfig:
    """Validate a raw mapping into a :class:`RunConfig` (static checks only, no data access), the algorithms'
    sections against ``algorithms``' schemas."""
    raw = dict(raw)
    name = raw.get("algorithm", RunConfig.algorithm)
    if not isinstance(name, str):
        raise ConfigError(f"algorithm: expected a name, got {name!r}")
    options_type = algorithms.options_type(name)  # built in, or a plug-in imported and checked here
    # A config may carry the options of several algorithms (a paper config holding every compared method's
    # settings, picked with --set algorithm=...): each section is validated, the named algorithm's applies.
    sections = {other: raw.pop(other) for other in sorted({name, *algorithms.builtin_names()}) if other in raw}
    unknown = set(raw) - {f.name for f in fields(RunConfig)}
    if unknown:  # sections of installed plug-ins (only those present get imported); the rest are unknown keys
        sections.update({other: raw.pop(other) for other in sorted(unknown & set(algorithms.plugin_names()))})
    for other, options in sections.items():
        if other != name:
            build(algorithms.options_type(other), options, other)
    section = sections.get(name)
    if "algorithm_options" in raw:
        raise ConfigError(f"config: unknown key 'algorithm_options' (put options under '{name}:')")
    cfg = build(RunConfig, raw)
    options = build(options_type, section, name)
    cfg = RunConfig(**{**cfg.__dict__, "algorithm_options": options})
    _check_cross_fields(cfg)
    return cfg


def _check_cross_fields(cfg: RunConfig) -> None:
    d = cfg.data
    if d.partition != "natural" and cfg.clients_per_round > d.num_clients:
        raise ConfigError(
            f"clients_per_round: {cfg.clients_per_round} exceeds data.num_clients ({d.num_clients})"
        )
    if d.test_fraction + d.val_fraction >= 1:
        raise ConfigError("data: test_fraction + val_fraction must leave training samples (sum < 1)")
    if d.synthetic.ridge_min_samples > d.synthetic.ridge_max_samples:
        raise ConfigError("data.synthetic: ridge_min_samples must be <= ridge_max_samples")
    if cfg.privacy.mode == "central" and cfg.server.weighting != "uniform":
        raise ConfigError("privacy.mode: central noise is calibrated to the uniform mean of the updates; set "
                          "server.weighting: uniform")
    if cfg.compression.down.error_feedback:
        raise ConfigError("compression.down.error_feedback: error feedback is client state, for uploads only")
    availability = cfg.network.availability.mode
    if availability != "always" and cfg.network.compute != "model":
        raise ConfigError(f"network.availability: with mode {availability}, who is sampled depends on the simulated "
                          "clock, which must not depend on this machine's load; set network.compute: model")
    if availability != "always" and cfg.privacy.mode != "off":
        raise ConfigError("network.availability: the privacy accountant assumes every seen client can be "
                          "sampled in every round; availability breaks that amplification-by-sampling bound")


REQUIRED = ("algorithm", "data.dataset")  # what a run trains, and on what: never silently the defaults


def check_required(raw: dict[str, Any], source: str | Path, keys: tuple[str, ...] = REQUIRED) -> None:
    """An empty or truncated config file must not run on defaults: name what it lacks (a key under a
    non-mapping counts as present; the schema reports that)."""
    def given(key: str) -> bool:
        node: Any = raw
        for part in key.split("."):
            if not isinstance(node, dict):
                return True
            if part not in node:
                return False
            node = node[part]
        return True

    # data.prepared names the data as data.dataset does (clients written elsewhere: docs/data_format.md)
    missing = [key for key in keys if not given(key) and not (key == "data.dataset" and given("data.prepared"))]
    if missing:
        raise ConfigError(f"{source}: missing {' and '.join(missing)}; name {'them' if len(missing) > 1 else 'it'} "
                          "in the file or with --set (e.g. algorithm: fedavg, data: {dataset: digits})")


def config_to_dict(cfg: RunConfig) -> dict[str, Any]:
    """The resolved config as plain data (what the results file stores)."""
    out = to_dict(cfg)
    options = out.pop("algorithm_options")
    if options:
        out[cfg.algorithm] = options
    return out
