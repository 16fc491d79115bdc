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
from mpifl.schema import INT32_MAX, ConfigError, build, limits, to_dict
from mpifl.training.config import ClientConfig


@dataclass(frozen=True)
class ServerConfig:
    """Server optimizer applied to the aggregated pseudo-gradient Δ (the averaged client update), for the
    algorithms whose server steps a global model from it (``mpifl.algorithms.fedavg.GlobalModel``)."""

    # sgd: θ ← θ + lr·v, v ← momentum·v + Δ (FedAvg, FedAvgM); adam, yogi, adagrad: FedAdam, FedYogi and
    # FedAdagrad (Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2)
    optimizer: Literal["sgd", "adam", "yogi", "adagrad"] = "sgd"
    lr: float = field(default=1.0, metadata=limits(gt=0))  # η_s: θ ← θ + η_s·v (FedAvg: 1; adaptive: try 0.01-0.1)
    momentum: float = field(default=0.0, metadata=limits(ge=0, lt=1))  # sgd's μ_s: v ← μ_s·v + Δ (FedAvg: 0)
    beta1: float = field(default=0.9, metadata=limits(ge=0, lt=1))  # adaptive: m ← β₁·m + (1 − β₁)·Δ
    beta2: float = field(default=0.99, metadata=limits(ge=0, lt=1))  # adam, yogi: decay of the second moment v
    # adaptive: τ, the adaptivity: θ ← θ + lr·m / (√v + τ), v starting at τ² (the paper's v₋₁ ≥ τ²)
    tau: float = field(default=1e-3, metadata=limits(gt=0))
    # how the server averages updates: by sample count (FedAvg), or equally (DP-FedAvg's noise is calibrated to
    # the uniform mean, whose sensitivity to one client is clip / cohort)
    weighting: Literal["samples", "uniform"] = "samples"
    # where the server's own networks compute (PeFLL's and pFedHN's hypernetwork and embeddings): cpu; cuda (a GPU
    # of rank 0's node, the one fewest workers share); auto (cuda where a GPU is visible). Messages stay numpy
    device: Literal["auto", "cpu", "cuda"] = "cpu"


@dataclass(frozen=True)
class FaultsConfig:
    """Faults the simulator emulates; every decision is a function of (seed, round, client) only."""

    # each sampled client fails before the round with this probability: it receives and sends nothing, and the
    # algorithm aggregates the clients that took part (/rounds/participants)
    dropout: float = field(default=0.0, metadata=limits(ge=0, lt=1))
    # seconds: a client whose expected round time exceeds it is dropped before the round. Expected time: the
    # network model's latency and bytes over bandwidth (the server's link shared with the round's other clients
    # when it is set) plus network.seconds_per_sample × the samples the algorithm passes in a round (its own step
    # count, e.g. FedALS's τ, FedDeper's two gradients per step); null: no deadline
    deadline_s: float | None = field(default=None, metadata=limits(gt=0))
    # sample ⌈(1 + o)·m⌉ clients (m = clients_per_round) and keep the m expected to finish first
    over_selection: float = field(default=0.0, metadata=limits(ge=0))
    # an update with NaN/Inf: skip rejects it with a warning (/rounds/rejected_updates; the client's state is
    # rolled back as if it had not been sampled), abort ends the job
    nonfinite: Literal["skip", "abort"] = "skip"
    # each participant's training uploads arrive as NaN with this probability (a diverged or faulty client;
    # exercises nonfinite)
    corrupt: float = field(default=0.0, metadata=limits(ge=0, le=1))


@dataclass(frozen=True)
class RunConfig:
    """The run: which algorithm, how long, how often to evaluate and checkpoint, and where each rank computes;
    each section below configures one part."""

    # a built-in algorithm (docs/reference/algorithms.md), an installed plug-in's entry-point name (group
    # mpifl.algorithms), or a module:attribute path (docs/tutorials/own-algorithm.md)
    algorithm: str = "fedavg"
    rounds: int = field(default=10, metadata=limits(ge=1))  # training rounds (FedBuff: server steps)
    # clients sampled each round, uniformly without replacement among the seen clients
    clients_per_round: int = field(default=5, metadata=limits(ge=1))
    # the only source of randomness: data split, initial model, sampling, batches, network draws, faults
    seed: int = field(default=0, metadata=limits(ge=0))
    eval_every: int = field(default=1, metadata=limits(ge=1))  # evaluate every client every N rounds and after the last
    # every rank saves its state into the shard folder beside the results file every N rounds; 0: never
    checkpoint_every: int = field(default=0, metadata=limits(ge=0))
    # a checkpoint also whenever this many minutes of training have passed since the last (rank 0's clock); 0: by
    # rounds only. The default bounds what a kill -9 loses; kept as checkpoint_keep says, like the others
    checkpoint_minutes: float = field(default=10.0, metadata=limits(ge=0))
    # checkpoints kept in the shard folder beside the results file (the newest first; an older one is resumed from
    # when a newer one's files are lost); older ones are deleted as each new one is committed
    checkpoint_keep: int = field(default=2, metadata=limits(ge=1))
    # evaluate this many clients per pass (bounds the server's per-client evaluation state, e.g. PeFLL's θ_i);
    # 0: all at once
    eval_chunk: int = field(default=0, metadata=limits(ge=0))
    # torch's intra-op threads on every rank (the Slurm scripts set it from --cpus-per-task; torch takes a C int):
    # a fixed count keeps results bitwise the same on any rank count (another count may change the bits, as it
    # changes how reductions are split)
    threads_per_rank: int = field(default=1, metadata=limits(ge=1, le=INT32_MAX))
    # client data a worker keeps between uses (GB); beyond it the least recently used clients are made or read
    # again when next needed, so a worker's memory does not grow with the clients it evaluates
    data_memory_gb: float = field(default=1.0, metadata=limits(ge=0))
    # committed client state a rank keeps in memory (GB; none: all of it); beyond it the least recently used
    # clients' states spill to files in state_spill_dir (default: the system's temporary folder), same results
    state_memory_gb: float | None = field(default=None, metadata=limits(ge=0))
    state_spill_dir: str | None = None  # where state_memory_gb spills (a temporary folder in it); null: the system's
    # GPU memory a rank's client states may keep on the GPU (GB; null: a quarter of the GPU's), where an algorithm
    # keeps them there (SCAFFOLD's control variates, FedALS's models and variates); beyond it the least recently
    # used come to host memory
    state_device_gb: float | None = field(default=None, metadata=limits(ge=0))
    # where each rank's clients compute: cpu; cuda (a GPU of the rank's node; an error where PyTorch sees none);
    # auto: cuda where a GPU is visible, else cpu (docs/how-to/gpus.md)
    device: Literal["auto", "cpu", "cuda"] = "cpu"
    # TF32 (10-bit mantissa) products in CUDA matmuls and cuDNN convolutions/RNNs: faster, ~1e-3 relative error
    allow_tf32: bool = False
    # static: each client lives on one worker for the whole run (balanced by sample count). dynamic: each round's
    # clients are re-spread over the workers by their work (greedy LPT), a visiting client's state moving along.
    # auto: dynamic where reading another worker's client costs only its own samples (generated data, digits,
    # uncompressed IDX, data.prepared files), static for gzipped IDX, CIFAR pickles, SVHN .mat and LEAF JSON
    # (mpifl prepare them, or ask for dynamic). Results are bitwise the same either way.
    placement: Literal["auto", "static", "dynamic"] = "auto"
    output: str = "results/run.h5"  # the results file (mpifl run --out overrides it)
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    client: ClientConfig = ClientConfig()
    server: ServerConfig = ServerConfig()
    network: NetworkConfig = NetworkConfig()
    faults: FaultsConfig = FaultsConfig()
    compression: CompressionConfig = CompressionConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    # secagg (Bonawitz et al. 2017) or secagg_plus (Bell et al. 2020): each round's key advertisements, encrypted
    # shares and unmasking messages enter the ledger and the simulated time (3 extra round trips), the update travels
    # as secagg.field_bits-bit masked field elements; the sum itself is computed in the clear (mpifl/comm/secagg.py)
    secure_aggregation: Literal["none", "secagg", "secagg_plus"] = "none"
    secagg: SecAggConfig = SecAggConfig()
    algorithm_options: Any = None  # the algorithm's own frozen options, built from its section


def _parse_scalar(text: str) -> Any:
    """Interpret a ``--set`` value the way YAML would (``0.1`` → float, ``[1, 2]`` → list)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set value {text!r} is not valid YAML: {yaml_problem(exc)}") from None


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error as one line: where (line and column, counted from 1) and why, a tab named as the cause (YAML
    indents with spaces; PyYAML says only that it "cannot start any token")."""
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    if "'\\t'" in problem:
        problem = "a tab character (YAML indents with spaces, never tabs)"
    return where + problem


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
        raise ConfigError(f"{path} is not valid YAML: {yaml_problem(exc)}") from None
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
    if unknown:  # sections of installed plug-ins and of plug-ins named by path (only those present get imported)
        plugins = (unknown & set(algorithms.plugin_names())) | {key for key in unknown if ":" in str(key)}
        sections.update({other: raw.pop(other) for other in sorted(plugins, key=str)})
    for other, options in sections.items():
        if other != name:
            try:
                build(algorithms.options_type(other), options, other)
            except ConfigError as exc:
                raise ConfigError(f"{exc} (this section holds {other}'s options, not those of the run's algorithm, "
                                  f"{name}: correct it, or drop the section to run {name})") from None
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
    if cfg.server.optimizer != "sgd" and cfg.server.momentum:
        raise ConfigError(f"server.momentum: momentum is sgd's; {cfg.server.optimizer}'s first moment decays with "
                          "server.beta1")
    if cfg.privacy.mode == "central" and cfg.server.weighting != "uniform":
        raise ConfigError("privacy.mode: central noise is calibrated to the uniform mean of the updates; set "
                          "server.weighting: uniform")
    if cfg.compression.down.error_feedback:
        raise ConfigError("compression.down.error_feedback: error feedback is client state, for uploads only")
    speed, seconds_per_sample = cfg.network.speed, cfg.network.seconds_per_sample
    if speed.file is not None and speed.mode != "file":
        raise ConfigError(f"network.speed.file: read only with mode: file (the mode is {speed.mode})")
    if speed.mode == "file" and seconds_per_sample:
        raise ConfigError("network.seconds_per_sample: network.speed.file gives every client's; leave it out")
    if speed.mode == "lognormal" and not seconds_per_sample:
        raise ConfigError("network.speed: mode lognormal scales network.seconds_per_sample, which is 0; set it to "
                          "the median client's seconds per sample")
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

    # data.prepared names the data as data.dataset does (clients written elsewhere: docs/reference/data-format.md)
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


RESULT_NEUTRAL = ("output", "data_memory_gb", "state_memory_gb", "state_spill_dir", "state_device_gb",
                  "checkpoint_keep", "checkpoint_minutes")
"""Config keys that change no bit of a run's results (where it writes, how much memory it may use, how many
checkpoints it keeps): two configs that differ only there describe the same run."""


def config_differences(saved: dict[str, Any], given: dict[str, Any], prefix: str = "") -> list[str]:
    """Where two configs (as :func:`config_to_dict` gives them) differ, key by key: ``"client.lr: 0.05 in the
    file, 0.1 given"``, in key order."""
    out = []
    for key in sorted(set(saved) | set(given)):
        a, b, name = saved.get(key), given.get(key), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += config_differences(a, b, f"{name}.")
        elif a != b:
            out.append(f"{name}: {_shown(a)} in the file, {_shown(b)} given")
    return out


def _shown(value: Any) -> str:
    return "(unset)" if value is None else yaml.safe_dump(value, default_flow_style=True).strip().removesuffix(
        "...").strip()
