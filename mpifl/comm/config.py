"""The ``network:`` section of a run config: the emulated client links."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mpifl.schema import limits


@dataclass(frozen=True)
class NetworkConfig:
    """Emulated links: per-client latency and bandwidth, fixed or log-normal around the given value."""

    latency_s: float = field(default=0.05, metadata=limits(ge=0))
    up_mbps: float = field(default=10.0, metadata=limits(gt=0))
    down_mbps: float = field(default=50.0, metadata=limits(gt=0))
    distribution: Literal["fixed", "lognormal"] = "fixed"
    sigma: float = field(default=0.5, metadata=limits(ge=0))
    seconds_per_sample: float = field(default=0.0, metadata=limits(ge=0))  # expected compute, for deadlines
