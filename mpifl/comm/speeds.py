"""Per-client compute speed on the simulated clock (device heterogeneity, ``network.speed``).

Real devices differ in how fast they train: FedScale's device-capacity traces (AI Benchmark measurements of
phones) spread seconds per sample over more than an order of magnitude. A client's speed is what its simulated
compute costs per training sample: deadlines and over-selection expect it, ``network.compute: model`` charges
it, FedBuff's arrivals follow it. Three sources:

* ``network`` (default): ``network.seconds_per_sample`` for every client, or log-normal with the links under
  ``network.distribution: lognormal`` (one draw for all clients from the seed);
* ``lognormal``: ``seconds_per_sample`` × exp(σ·z) with z standard normal, drawn from (seed, client id) alone:
  the same on every rank and any rank count, and a client keeps its speed when the run has more clients;
* ``file``: a CSV file with the header ``client,seconds_per_sample`` and one row per client id, every client of
  the data exactly once (docs/how-to/client-speeds.md).
"""

from __future__ import annotations

import numpy as np

from mpifl.comm.availability import csv_rows, uniform_draws
from mpifl.schema import ConfigError

_SPEED_TAG = 0x73706565
HEADER = ["client", "seconds_per_sample"]


def lognormal_factors(seed: int, clients: np.ndarray, sigma: float) -> np.ndarray:
    """exp(σ·z) for each client, z standard normal from (seed, client id) by Box–Muller on two counter-based
    uniforms: median 1, the same for a client whatever else is drawn."""
    first = uniform_draws(seed, clients, np.zeros(len(clients), dtype=np.int64), _SPEED_TAG)
    second = uniform_draws(seed, clients, np.ones(len(clients), dtype=np.int64), _SPEED_TAG)
    z = np.sqrt(-2.0 * np.log(first)) * np.cos(2.0 * np.pi * second)
    return np.exp(sigma * z)


def read_speeds(path: str | None, num_clients: int) -> np.ndarray:
    """Every client's seconds per sample from a speed file, checked: a bad file is one :class:`ConfigError`
    line naming the file (and the line where one is at fault)."""
    if path is None:
        raise ConfigError("network.speed.file: a CSV file is required with mode: file")
    where = f"network.speed.file: {path}"
    rows = csv_rows(path, HEADER, where)
    speeds = np.full(num_clients, np.nan)
    for line, row in enumerate(rows, start=2):
        if not row:
            continue
        try:
            client_text, seconds_text = row
            client, seconds = float(client_text), float(seconds_text)
        except ValueError:
            raise ConfigError(f"{where}: line {line}: expected client,seconds_per_sample numbers, got "
                              f"{','.join(row)}") from None
        if not (np.isfinite(client) and client == int(client) and 0 <= client < num_clients):
            raise ConfigError(f"{where}: line {line}: client ids must be integers in [0, {num_clients}) (the "
                              f"data's clients), got {client_text.strip()}")
        if not (np.isfinite(seconds) and seconds >= 0):
            raise ConfigError(f"{where}: line {line}: seconds_per_sample must be a finite number ≥ 0, got "
                              f"{seconds_text.strip()}")
        if not np.isnan(speeds[int(client)]):
            raise ConfigError(f"{where}: line {line}: client {int(client)} appears twice")
        speeds[int(client)] = seconds
    missing = np.flatnonzero(np.isnan(speeds))
    if len(missing):
        raise ConfigError(f"{where}: {len(missing)} of the data's {num_clients} clients have no row (first: client "
                          f"{missing[0]}); name every client once")
    return speeds
