"""Emulated links: turns a round's logical bytes and compute time into simulated seconds.

Each client has its own latency and up/down link; the server's link (``server_up_mbps``/``server_down_mbps``)
is shared by all of a round's transfers. A round is a small flow schedule: every download starts at the round's
start, the client computes once its download (and the download's per-message latencies) is done, then uploads.
Concurrent flows share links max-min fairly (fluid processor sharing, each flow also limited by its client's
own link), simulated event by event, exact for the piecewise-constant rates this gives."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mpifl.comm.config import NetworkConfig
from mpifl.comm.speeds import lognormal_factors, read_speeds

_NETWORK_TAG = 0x6E6574


@dataclass(frozen=True)
class NetworkModel:
    """Per-client latency (s), bandwidth (bytes/s) and compute speed (s/sample), fixed or drawn once from a
    seeded log-normal (the speed also per client id, or from a file: :mod:`mpifl.comm.speeds`); the server's
    link (bytes/s, infinite by default) and how compute is counted."""

    latency_s: np.ndarray
    up_bytes_per_s: np.ndarray
    down_bytes_per_s: np.ndarray
    seconds_per_sample: np.ndarray
    server_up_bytes_per_s: float = np.inf
    server_down_bytes_per_s: float = np.inf
    multicast: bool = False
    modeled_compute: bool = False  # compute seconds from seconds_per_sample, not the measured wall time

    @classmethod
    def from_config(cls, cfg: NetworkConfig, num_clients: int, seed: int) -> NetworkModel:
        scale = np.ones((4, num_clients))
        if cfg.distribution == "lognormal":
            rng = np.random.default_rng(np.random.SeedSequence([seed, _NETWORK_TAG]))
            # Median-preserving draws: the configured value is each quantity's median over clients.
            scale = rng.lognormal(mean=0.0, sigma=cfg.sigma, size=(4, num_clients))
        seconds_per_sample = cfg.seconds_per_sample * scale[3]
        if cfg.speed.mode == "lognormal":
            seconds_per_sample = cfg.seconds_per_sample * lognormal_factors(seed, np.arange(num_clients),
                                                                            cfg.speed.sigma)
        elif cfg.speed.mode == "file":
            seconds_per_sample = read_speeds(cfg.speed.file, num_clients)
        return cls(
            latency_s=cfg.latency_s * scale[0],
            up_bytes_per_s=cfg.up_mbps * 1e6 / 8 / scale[1],
            down_bytes_per_s=cfg.down_mbps * 1e6 / 8 / scale[2],
            seconds_per_sample=seconds_per_sample,
            server_up_bytes_per_s=_bytes_per_s(cfg.server_up_mbps),
            server_down_bytes_per_s=_bytes_per_s(cfg.server_down_mbps),
            multicast=cfg.multicast,
            modeled_compute=cfg.compute == "model",
        )

    def compute_seconds(self, clients: np.ndarray, samples: np.ndarray, measured: np.ndarray) -> np.ndarray:
        """The clients' simulated compute: ``measured`` wall seconds, or (``compute: model``) their drawn
        seconds per sample × ``samples``, which no machine load can change."""
        return self.seconds_per_sample[clients] * samples if self.modeled_compute else measured

    def cohort_seconds(self, clients: np.ndarray, moved: dict[str, tuple[np.ndarray, np.ndarray]],
                       compute_s: np.ndarray, broadcast_bytes: int, turns: bool) -> float:
        """A round's client-side time: the last finish of the flow schedule, or (``turns``: one client after
        another) the sum of each client's time alone. ``moved``: each client's bytes and messages by direction
        (``Ledger.client_round_bytes``)."""
        (down, down_messages), (up, up_messages) = moved["down"], moved["up"]
        if turns:
            alone = [self.round_seconds(clients[i : i + 1], down[i : i + 1], down_messages[i : i + 1], up[i : i + 1],
                                        up_messages[i : i + 1], compute_s[i : i + 1], broadcast_bytes)
                     for i in range(len(clients))]
            return float(np.concatenate(alone).sum()) if alone else 0.0
        finish = self.round_seconds(clients, down, down_messages, up, up_messages, compute_s, broadcast_bytes)
        return float(finish.max(initial=0.0))

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

    def round_seconds(
        self,
        clients: np.ndarray,
        down_bytes: np.ndarray,
        down_messages: np.ndarray,
        up_bytes: np.ndarray,
        up_messages: np.ndarray,
        compute_s: np.ndarray,
        broadcast_bytes: int = 0,
    ) -> np.ndarray:
        """Each client's finish time when ``clients`` run one round together over the shared server link.

        ``broadcast_bytes`` of each client's ``down_bytes`` are the round's broadcasts: with ``multicast`` they
        cross the server's downlink once, as one stream every client receives (at the pace of the slowest
        receiver's share); otherwise they are part of each client's own download. With an infinite server link
        and no multicast the schedule has no contention and this is exactly :meth:`client_seconds`."""
        if not self.multicast and np.isinf(self.server_down_bytes_per_s) and np.isinf(self.server_up_bytes_per_s):
            return self.client_seconds(clients, down_bytes, down_messages, up_bytes, up_messages, compute_s)
        n = len(clients)
        latency = self.latency_s[clients]
        shared = np.minimum(broadcast_bytes, down_bytes) if self.multicast else np.zeros(n)
        sizes = (down_bytes - shared).astype(float)
        if self.multicast:  # one more flow: the stream through the server's downlink to every client
            sizes = np.append(sizes, float(shared.max(initial=0)))
        flows = fluid_schedule(np.zeros(len(sizes)), sizes, self.server_down_bytes_per_s,
                               self.down_bytes_per_s[clients], self.multicast)
        downloaded = np.maximum(flows[:n], flows[n] if self.multicast else 0.0) + down_messages * latency
        uploaded = fluid_schedule(downloaded + compute_s, up_bytes.astype(float), self.server_up_bytes_per_s,
                                  self.up_bytes_per_s[clients])
        return uploaded + up_messages * latency


def _bytes_per_s(mbps: float | None) -> float:
    return np.inf if mbps is None else mbps * 1e6 / 8


def water_fill(capacity: float, caps: np.ndarray) -> np.ndarray:
    """Max-min fair rates of flows sharing one link of ``capacity``, each also limited to its own cap: every
    flow gets min(cap, L), the level L filling the link (or its cap when the caps do not fill it)."""
    if caps.sum() <= capacity:
        return caps.astype(float)
    order = np.sort(caps)
    n = len(order)
    # with the k smallest flows at their caps, the others share what is left equally; the first k for which
    # that share does not exceed the next cap is the level
    levels = (capacity - np.concatenate(([0.0], np.cumsum(order[:-1])))) / (n - np.arange(n))
    return np.minimum(caps, levels[np.argmax(levels <= order)])


def star_rates(server: float, caps: np.ndarray, unicast: np.ndarray, stream: bool) -> tuple[np.ndarray, float]:
    """Max-min fair rates of one round direction: client i's flow (where ``unicast``) crosses the server's link
    and its own (``caps``); with ``stream``, one more flow (a multicast) crosses the server's link and every
    client's. Progressive filling: all rates grow together until a link is full; the stream stops growing first
    (it crosses every link), at the server's equal share or at the tightest client link it shares, then the
    unicast flows fill what the stream left. Returns the unicast rates (0 where not ``unicast``), the stream's."""
    x = 0.0
    if stream:
        x = min(server / (int(unicast.sum()) + 1), float((caps / np.where(unicast, 2, 1)).min(initial=np.inf)))
    rates = np.zeros(len(caps))
    rates[unicast] = water_fill(server - x, caps[unicast] - x)
    return rates, x


def fluid_schedule(start: np.ndarray, sizes: np.ndarray, server: float, caps: np.ndarray,
                   stream: bool = False) -> np.ndarray:
    """Finish time of each client's flow (``sizes[i]`` bytes from ``start[i]``) sharing the server's link max-min
    fairly, each limited by its client's link (``caps``); with ``stream`` the last flow is a multicast to every
    client (:func:`star_rates`).

    Event-driven: rates are constant between consecutive flow starts and finishes, so each step advances to the
    next event exactly. An empty flow finishes when it starts."""
    n = len(caps)
    finish = np.where(sizes > 0, np.inf, start)
    remaining = sizes.astype(float)
    pending = sizes > 0
    t = float(start[pending].min(initial=np.inf))
    while pending.any():
        active = pending & (start <= t)
        unicast, stream_rate = star_rates(server, caps, active[:n], stream and bool(active[n:].any()))
        rate = np.append(unicast, stream_rate) if stream else unicast
        with np.errstate(divide="ignore", invalid="ignore"):
            until_done = np.where(active, remaining / rate, np.inf)
            dt = min(until_done.min(), start[pending & ~active].min(initial=np.inf) - t)
            done = active & (until_done <= dt)
            remaining = np.where(active & ~done, np.maximum(remaining - rate * dt, 0.0), remaining)
        t += dt
        finish[done] = t
        pending &= ~done
    return finish
