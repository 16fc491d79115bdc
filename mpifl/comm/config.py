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

    # always online; onoff: exponential periods, seeded, started stationary; trace: a CSV file's intervals. Needs
    # network.compute: model (the cohort depends on the clock); not with privacy
    mode: Literal["always", "onoff", "trace"] = "always"
    mean_on_s: float = field(default=3600.0, metadata=limits(gt=0))  # onoff: mean online period, seconds
    mean_off_s: float = field(default=3600.0, metadata=limits(gt=0))  # onoff: mean offline period, seconds
    # trace: the CSV file of online intervals (docs/reference/data-format.md#client-availability-traces)
    trace: str | None = None
    # trace: the trace repeats with this period, seconds; null: its last interval's end
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

    latency_s: float = field(default=0.05, metadata=limits(ge=0))  # a client's one-way latency, paid per message
    up_mbps: float = field(default=10.0, metadata=limits(gt=0))  # a client's upload bandwidth, Mbit/s
    down_mbps: float = field(default=50.0, metadata=limits(gt=0))  # a client's download bandwidth, Mbit/s
    # fixed: every client has the values above; lognormal: each client's drawn once around them (the medians), seeded
    distribution: Literal["fixed", "lognormal"] = "fixed"
    sigma: float = field(default=0.5, metadata=limits(ge=0))  # lognormal: σ of the log of each drawn value
    # a client's expected compute per training sample, seconds (per client log-normal with distribution lognormal),
    # for deadlines, over-selection and compute: model
    seconds_per_sample: float = field(default=0.0, metadata=limits(ge=0))
    # the server's upload link, Mbit/s, shared max-min fairly by a round's downloads; null: infinite (every client
    # limited only by its own link)
    server_up_mbps: float | None = field(default=None, metadata=limits(gt=0))
    # the server's download link, Mbit/s, shared max-min fairly by a round's uploads; null: infinite
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

    codec: CodecName = "none"  # the encoding; exact bytes per codec: docs/explanation/bytes.md
    bits: int = field(default=8, metadata=limits(ge=2, le=16))  # qsgd: bits per entry, sign included
    fraction: float = field(default=0.01, metadata=limits(gt=0, le=1))  # topk, randk: the share of entries sent
    # uploads: keep what the encoding lost in the client's state and add it to the next upload
    error_feedback: bool = False


@dataclass(frozen=True)
class CompressionConfig:
    """Codecs on the wire: ``up`` for every float upload, ``down`` for every float download, and ``messages``
    (message name → codec section) to override either for one message. An algorithm never sees the codec."""

    up: CodecConfig = CodecConfig()
    down: CodecConfig = CodecConfig()
    # per message name, a codec section overriding up/down (e.g. {delta: {codec: topk, fraction: 0.01}}); a name the
    # algorithm does not send is refused
    messages: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PrivacyConfig:
    """Differential privacy on model updates (DP-FedAvg, McMahan et al. 2018): each client's update is clipped
    to L2 norm ``clip``; Gaussian noise of std ``noise_multiplier``·``clip`` is added to the sum by the server
    (``central``) or to each update by its client (``local``). ε at ``delta`` is reported every round."""

    # DP-FedAvg on every update message (deltas, gradients): local (each client clips and adds its noise) or central
    # (each client clips, the server adds the noise to the sum; needs server.weighting: uniform); off
    mode: Literal["off", "central", "local"] = "off"
    clip: float = field(default=1.0, metadata=limits(gt=0))  # C: each update's L2 norm bound
    noise_multiplier: float = field(default=1.0, metadata=limits(ge=0))  # z: the noise's std is z·C
    delta: float = field(default=1e-5, metadata=limits(gt=0, lt=1))  # the δ at which ε is reported each round
    # how a round's cohort is drawn (and accounted): fixed (clients_per_round, without replacement); poisson (each
    # seen client joins with probability clients_per_round / seen clients; the mean divides by that expected size)
    sampling: Literal["fixed", "poisson"] = "fixed"
    # Google's dp-accounting (extra mpifl[dp]): RDP, or PLD (Poisson sampling only); ε lands in /rounds/epsilon
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
    dropout_rate: float = field(default=0.33, metadata=limits(ge=0, lt=1))  # the threat model's dropped share
