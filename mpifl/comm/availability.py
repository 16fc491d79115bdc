"""When clients are online, on the simulated clock: always, seeded on/off periods, or a trace file.

Real clients are not always reachable (a phone is charging on Wi-Fi a few hours a day), and which ones are
reachable when the server samples a cohort changes who trains and how long a run takes. Every rank asks the
same question (who is online at simulated second ``t``) and gets the same answer: the on/off periods are a
function of (seed, client, period index) only, never of which rank asks or how often.

Trace files are CSV with the header ``client,start_s,end_s``, one row per interval ``[start_s, end_s)`` in
which that client is online; a client with no row is never online; a client's intervals must not overlap.
The trace repeats with the period ``trace_period_s`` (default: its last ``end_s``), so a run may outlast it.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mpifl.comm.config import AvailabilityConfig
from mpifl.schema import ConfigError

_AVAILABILITY_TAG = 0x61766169
_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def uniform_draws(seed: int, clients: np.ndarray, index: np.ndarray, tag: int = _AVAILABILITY_TAG) -> np.ndarray:
    """A uniform number in (0, 1) for each (client, index) pair: SplitMix64 of a key mixing the run's seed, the
    stream's ``tag``, the client id and the period index, so any period of any client is drawn in O(1),
    vectorized, and in any order (a counter-based generator: no state to carry or checkpoint)."""
    with np.errstate(over="ignore"):
        key = (np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15) ^ np.uint64(tag)) & _MASK64
        z = key ^ (clients.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9)) ^ (
            index.astype(np.uint64) * np.uint64(0x94D049BB133111EB))
        for shift, factor in ((30, 0xBF58476D1CE4E5B9), (27, 0x94D049BB133111EB)):
            z = (z ^ (z >> np.uint64(shift))) * np.uint64(factor)
        z = z ^ (z >> np.uint64(31))
    return ((z >> np.uint64(11)).astype(np.float64) + 0.5) / 2.0**53


@dataclass
class OnOffPeriods:
    """Alternating exponential on/off periods per client, started in the stationary state: online with
    probability on/(on + off) at time 0, the first period's remainder exponential like every period (the
    exponential is memoryless), so the first round is not special.

    The clock only moves forward, so each client keeps its current period (its index, whether it is on, when it
    ends) and advances it when asked about a later time; going back to an earlier time starts over from 0."""

    mean_on_s: float
    mean_off_s: float
    seed: int
    num_clients: int

    def __post_init__(self) -> None:
        self._start()

    def _start(self) -> None:
        clients = np.arange(self.num_clients)
        self.index = np.zeros(self.num_clients, dtype=np.int64)
        p_on = self.mean_on_s / (self.mean_on_s + self.mean_off_s)
        self.online = uniform_draws(self.seed, clients, np.full(self.num_clients, -1)) < p_on
        self.ends = self._duration(clients, self.index, self.online)
        self.now = 0.0

    def _duration(self, clients: np.ndarray, index: np.ndarray, online: np.ndarray) -> np.ndarray:
        mean = np.where(online, self.mean_on_s, self.mean_off_s)
        return -mean * np.log(uniform_draws(self.seed, clients, index))

    def available(self, t: float) -> np.ndarray:
        if t < self.now:
            self._start()
        self.now = t
        behind = np.flatnonzero(self.ends <= t)
        while len(behind):  # each pass moves these clients one period on
            self.index[behind] += 1
            self.online[behind] = ~self.online[behind]
            self.ends[behind] += self._duration(behind, self.index[behind], self.online[behind])
            behind = behind[self.ends[behind] <= t]
        return self.online.copy()

    def next_online(self, t: float) -> float:
        online = self.available(t)
        return float(self.ends[~online].min(initial=math.inf))


@dataclass
class TraceIntervals:
    """Online intervals read from a trace file, sorted by (client, start), repeating every ``period_s``."""

    clients: np.ndarray
    starts: np.ndarray
    ends: np.ndarray
    period_s: float
    num_clients: int

    def available(self, t: float) -> np.ndarray:
        phase = math.fmod(t, self.period_s)
        online = np.zeros(self.num_clients, dtype=bool)
        online[self.clients[(self.starts <= phase) & (phase < self.ends)]] = True
        return online

    def next_online(self, t: float) -> float:
        """The first interval start after ``t`` (in this period, or the next period's first)."""
        cycle = math.floor(t / self.period_s) * self.period_s
        later = self.starts[self.starts > t - cycle]
        return cycle + float(later.min()) if len(later) else cycle + self.period_s + float(self.starts.min())


class Availability:
    """Who is online at a simulated time; ``always`` (the default) is everyone at every time."""

    def __init__(self, cfg: AvailabilityConfig, num_clients: int, seed: int):
        self.mode = cfg.mode
        self.num_clients = num_clients
        self._periods: OnOffPeriods | TraceIntervals | None = None
        if cfg.mode == "onoff":
            self._periods = OnOffPeriods(cfg.mean_on_s, cfg.mean_off_s, seed, num_clients)
        elif cfg.mode == "trace":
            self._periods = read_trace(cfg.trace, cfg.trace_period_s, num_clients)

    @property
    def always(self) -> bool:
        return self._periods is None

    def available(self, t: float) -> np.ndarray:
        """A bool per client id: online at simulated second ``t``."""
        if self._periods is None:
            return np.ones(self.num_clients, dtype=bool)
        return self._periods.available(t)

    def next_online(self, t: float) -> float:
        """The earliest time after ``t`` at which a client comes online (for a server with nobody to sample)."""
        return t if self._periods is None else self._periods.next_online(t)


def csv_rows(path: str, header: list[str], where: str) -> list[list[str]]:
    """The rows after the ``header`` line of a CSV file (a missing or unreadable file, or another first line, is
    one :class:`ConfigError` line starting with ``where``)."""
    try:
        with open(Path(path), newline="") as f:
            rows = list(csv.reader(f))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise ConfigError(f"{where}: cannot read it ({exc})") from None
    if not rows or [c.strip() for c in rows[0]] != header:
        raise ConfigError(f"{where}: the first line must be the header {','.join(header)}")
    return rows[1:]


def read_trace(path: str | None, period_s: float | None, num_clients: int) -> TraceIntervals:
    """A trace file's intervals, checked: bad rows are one :class:`ConfigError` line naming the file and row."""
    if path is None:
        raise ConfigError("network.availability.trace: a trace file is required with mode: trace")
    where = f"network.availability.trace: {path}"
    body = [r for r in csv_rows(path, ["client", "start_s", "end_s"], where) if r]
    if not body:
        raise ConfigError(f"{where}: no intervals")
    values = np.zeros((len(body), 3))
    for i, row in enumerate(body, start=2):
        try:
            values[i - 2] = [float(x) for x in row] if len(row) == 3 else []
        except ValueError:
            raise ConfigError(f"{where}: line {i}: expected client,start_s,end_s numbers, got {','.join(row)}"
                              ) from None
    clients, starts, ends = values[:, 0], values[:, 1], values[:, 2]
    checks = (
        (~np.isfinite(values).all(axis=1), "values must be finite numbers"),
        ((clients != np.round(clients)) | (clients < 0) | (clients >= num_clients),
         f"client ids must be integers in [0, {num_clients})"),
        (starts < 0, "start_s must be ≥ 0"),
        (ends <= starts, "end_s must be greater than start_s"),
    )
    for bad, what in checks:
        if bad.any():
            raise ConfigError(f"{where}: line {int(np.argmax(bad)) + 2}: {what}")
    order = np.lexsort((starts, clients))
    clients, starts, ends = clients[order].astype(np.int64), starts[order], ends[order]
    overlap = (clients[1:] == clients[:-1]) & (starts[1:] < ends[:-1])
    if overlap.any():
        raise ConfigError(f"{where}: client {clients[1:][overlap][0]} has overlapping intervals")
    period = float(ends.max()) if period_s is None else period_s
    if ends.max() > period:
        raise ConfigError(f"{where}: an interval ends at {ends.max():g} s, after trace_period_s = {period:g}")
    return TraceIntervals(clients, starts, ends, period, num_clients)
