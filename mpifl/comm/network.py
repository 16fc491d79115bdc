"""Emulated client links: turns a client's logical bytes and compute time into simulated seconds."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpifl.comm.config import NetworkConfig

_NETWORK_TAG = 0x6E6574


@dataclass(frozen=True)
class NetworkModel:
    """Per-client latency (s) and bandwidth (bytes/s), fixed or drawn once from a seeded log-normal."""

    latency_s: np.ndarray
    up_bytes_per_s: np.ndarray
    down_bytes_per_s: np.ndarray
    seconds_per_sample: np.ndarray

    @classmethod
    def from_config(cls, cfg: NetworkConfig, num_clients: int, seed: int) -> NetworkModel:
        scale = np.ones((4, num_clients))
        if cfg.distribution == "lognormal":
            rng = np.random.default_rng(np.random.SeedSequence([seed, _NETWORK_TAG]))
            # Median-preserving draws: the configured value is each quantity's median over clients.
            scale = rng.lognormal(mean=0.0, sigma=cfg.sigma, size=(4, num_clients))
        return cls(
            latency_s=cfg.latency_s * scale[0],
            up_bytes_per_s=cfg.up_mbps * 1e6 / 8 / scale[1],
            down_bytes_per_s=cfg.down_mbps * 1e6 / 8 / scale[2],
            seconds_per_sample=cfg.seconds_per_sample * scale[3],
        )

    def client_seconds(
        self,
        clients: np.ndarray,
        down_bytes: np.ndarray,
        down_messages: int | np.ndarray,
        up_bytes: np.ndarray,
        up_messages: int | np.ndarray,
        compute_s: np.ndarray,
    ) -> np.ndarray:
        """Download + compute + upload time of each client; every message pays its link's latency."""
        return (
            (down_messages + up_messages) * self.latency_s[clients]
            + down_bytes / self.down_bytes_per_s[clients]
            + compute_s
            + up_bytes / self.up_bytes_per_s[clients]
        )
