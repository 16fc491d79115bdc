"""The wire sections of a run config: emulated client links (``network``), codecs (``compression``), differential
privacy (``privacy``) and the secure-aggregation cost model (``secagg``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from mpifl.schema import limits


@dataclass(frozen=True)
class AvailabilityConfig:
    """When clients are online on the simulated clock (``mpifl.comm.availability``): ``always``; ``onoff``:
    alternating exponential periods of mean ``mean_on_s`` online and ``mean_off_s`` offline per client, seeded;
    ``trace``: the intervals of a CSV file (``client,start_s,end_s``) repeating every ``trace_period_s``
    (default: the file's last end). A round samples only among the clients online at its simulated start."""

    mode: Literal["always", "onoff", "trace"] = "always"
    mean_on_s: float = field(default=3600.0, metadata=limits(gt=0))
    mean_off_s: float = field(default=3600.0, metadata=limits(gt=0))
    trace: str | None = None
    trace_period_s: float | None = field(default=None, metadata=limits(gt=0))


@dataclass(frozen=True)
class SpeedConfig:
    """Each client's compute speed on the simulated clock, in seconds per training sample (what deadlines,
    over-selection, ``compute: model`` and FedBuff's arrivals charge): ``network`` (default):
    ``network.seconds_per_sample``, log-normal with the links under ``distribution: lognormal``; ``lognormal``:
    ``seconds_per_sample`` times a log-normal factor of median 1 and ``sigma``, drawn from (seed, client id)
    alone; ``file``: a CSV file ``client,seconds_per_sample`` naming every client (docs/how-to/client-speeds.md)."""

    mode: Literal["network", "lognormal", "file"] = "network"  # where each client's seconds per sample come from
    sigma: float = field(default=1.0, metadata=limits(ge=0))  # lognormal: σ of log(speed) around its median
    file: str | None = None  # file: the CSV of every client's seconds per sample (FedScale-style device traces)


@dataclass(frozen=True)
class NetworkConfig:
    """Emulated links: per-client latency and bandwidth, fixed or log-normal around the given value, and the
    server's link every client of a round shares (none: infinite)."""

    latency_s: float = field(default=0.05, metadata=limits(ge=0))
    up_mbps: float = field(default=10.0, metadata=limits(gt=0))
    down_mbps: float = field(default=50.0, metadata=limits(gt=0))
    distribution: Literal["fixed", "lognormal"] = "fixed"
    sigma: float = field(default=0.5, metadata=limits(ge=0))
    seconds_per_sample: float = field(default=0.0, metadata=limits(ge=0))  # for deadlines and compute: model
    server_up_mbps: float | None = field(default=None, metadata=limits(gt=0))
    server_down_mbps: float | None = field(default=None, metadata=limits(gt=0))
    multicast: bool = False  # a broadcast crosses the server's downlink once, not once per client
    # simulated compute: the measured wall time, or seconds_per_sample × samples (reproducible bit for bit)
    compute: Literal["measured", "model"] = "measured"
    availability: AvailabilityConfig = AvailabilityConfig()
    speed: SpeedConfig = SpeedConfig()  # per-client compute speed (device heterogeneity)


CodecName = Literal["none", "fp16", "bf16", "qsgd", "topk", "randk", "sign"]


@dataclass(frozen=True)
class CodecConfig:
    """How one message's payload is encoded on the wire (``mpifl.comm.codecs``).

    ``qsgd``: stochastic uniform quantization to ``bits`` bits per entry (sign included) with the row's L2 norm;
    ``topk``/``randk``: the ``fraction`` largest-magnitude (or random) entries as indices + values; ``sign``: one
    bit per entry and one scale (the mean magnitude). ``error_feedback`` keeps what the encoding lost in the
    client's state and adds it to the next upload (up messages only).
    """

    codec: CodecName = "none"
    bits: int = field(default=8, metadata=limits(ge=2, le=16))
    fraction: float = field(default=0.01, metadata=limits(gt=0, le=1))
    error_feedback: bool = False


@dataclass(frozen=True)
class CompressionConfig:
    """Codecs on the wire: ``up`` for every float upload, ``down`` for every float download, and ``messages``
    (message name → codec section) to override either for one message. An algorithm never sees the codec."""

    up: CodecConfig = CodecConfig()
    down: CodecConfig = CodecConfig()
    messages: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PrivacyConfig:
    """Differential privacy on model updates (DP-FedAvg, McMahan et al. 2018): each client's update is clipped
    to L2 norm ``clip``; Gaussian noise of std ``noise_multiplier``·``clip`` is added to the sum by the server
    (``central``) or to each update by its client (``local``). ε at ``delta`` is reported every round."""

    mode: Literal["off", "central", "local"] = "off"
    clip: float = field(default=1.0, metadata=limits(gt=0))
    noise_multiplier: float = field(default=1.0, metadata=limits(ge=0))
    delta: float = field(default=1e-5, metadata=limits(gt=0, lt=1))
    sampling: Literal["fixed", "poisson"] = "fixed"  # how a round's cohort is drawn (and accounted)
    accountant: Literal["rdp", "pld"] = "rdp"


@dataclass(frozen=True)
class SecAggConfig:
    """Parameters of the secure-aggregation cost model (``secure_aggregation:`` names the protocol)."""

    degree: int = field(default=0, metadata=limits(ge=0))  # SecAgg+ neighbours; 0: the paper's choice for n
    field_bits: int = field(default=32, metadata=limits(ge=8, le=64))  # bits per masked entry
    key_bytes: int = field(default=32, metadata=limits(ge=1))  # one public key (X25519: 32)
    share_bytes: int = field(default=16, metadata=limits(ge=1))  # one Shamir share of a 128-bit secret
    aead_overhead_bytes: int = field(default=28, metadata=limits(ge=0))  # nonce + tag of one encrypted share
    # the threat model SecAgg+'s default degree is sized for (Bell et al.): fractions of corrupt and dropped clients
    adversarial_rate: float = field(default=0.33, metadata=limits(ge=0, lt=1))
    dropout_rate: float = field(default=0.33, metadata=limits(ge=0, lt=1))
