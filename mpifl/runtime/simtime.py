"""The simulated clock: what a round would take in a real deployment, from the bytes each client moves, the
network model's links and the compute model.

One source for what a client moves: :meth:`SimulatedTime.traffic` reads it off the plan (each logical message at
its size on the wire, :meth:`~mpifl.comm.wire.WireFormat.nbytes`, the size the ledger records too) plus secure
aggregation's own messages. Deadlines and
over-selection ask for a client's expected finish before the round with it; the round's simulated seconds after
the round use it again for the clients whose updates were accepted; the ledger records the same bytes (a test
checks they agree). Asynchronous rounds time each dispatched client alone with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mpifl.comm import Message, Step
from mpifl.comm.network import NetworkModel
from mpifl.comm.wire import WireFormat
from mpifl.results import Results


@dataclass(frozen=True)
class Traffic:
    """What each client of a round moves, per direction: logical bytes and messages (one entry per client), and
    the bytes of the round's broadcasts (which a multicast sends once)."""

    down_bytes: np.ndarray
    down_messages: np.ndarray
    up_bytes: np.ndarray
    up_messages: np.ndarray
    broadcast_bytes: int

    def of(self, rows: np.ndarray | slice) -> Traffic:
        """The traffic of some of the clients (``rows``: positions among them)."""
        return Traffic(self.down_bytes[rows], self.down_messages[rows], self.up_bytes[rows], self.up_messages[rows],
                       self.broadcast_bytes)


class SimulatedTime:
    """The simulated clock (``now_s``: on rank 0 the end of the last round; with availability, on every rank the
    start of the current one) and the network model that moves it."""

    def __init__(self, network: NetworkModel, wire: WireFormat, samples_per_round: np.ndarray, turns: bool):
        self.network, self.wire, self.samples, self.turns = network, wire, samples_per_round, turns
        self.now_s = 0.0

    def traffic(self, plan: Sequence[Step], clients: np.ndarray, cohort: int | None = None) -> Traffic:
        """What each of ``clients`` moves in a round of ``plan`` that it completes, as a real deployment sends it:
        every logical message of the plan at its encoded (or masked) size, and under secure aggregation the
        protocol's own messages for a round of ``cohort`` participants (default: ``clients``) of whom ``clients``
        survive."""
        logical = [m for m in plan if isinstance(m, Message) and m.logical]
        if self.wire.masks:
            numel = sum(m.numel for m in logical if m.update)
            logical += [m for m, _ in self.wire.secagg_round(len(clients) if cohort is None else cohort, len(clients),
                                                              numel)]
        sizes = {d: [self.wire.nbytes(m) for m in logical if m.direction == d] for d in ("down", "up")}
        broadcast = sum(self.wire.nbytes(m) for m in logical if m.direction == "down" and m.broadcast)
        n = len(clients)
        return Traffic(np.full(n, sum(sizes["down"]), np.int64), np.full(n, len(sizes["down"]), np.int64),
                       np.full(n, sum(sizes["up"]), np.int64), np.full(n, len(sizes["up"]), np.int64), broadcast)

    def modeled_compute(self, clients: np.ndarray) -> np.ndarray:
        """``seconds_per_sample`` × the clients' planned samples: compute as the network model predicts it."""
        return self.network.seconds_per_sample[clients] * self.samples[clients]

    def expected_finish(self, clients: np.ndarray, traffic: Traffic) -> np.ndarray:
        """Each client's expected finish when ``clients`` run a round together (before it starts: for deadlines
        and over-selection)."""
        t = traffic
        return self.network.round_seconds(clients, t.down_bytes, t.down_messages, t.up_bytes, t.up_messages,
                                          self.modeled_compute(clients), t.broadcast_bytes)

    def alone(self, clients: np.ndarray, traffic: Traffic) -> np.ndarray:
        """Each client's download + modeled compute + upload time on its own link (an asynchronous dispatch)."""
        t = traffic
        return self.network.client_seconds(clients, t.down_bytes, t.down_messages, t.up_bytes, t.up_messages,
                                           self.modeled_compute(clients))

    def round_seconds(self, clients: np.ndarray, traffic: Traffic, measured_compute: np.ndarray) -> float:
        """The clients' side of a round that ``clients`` completed: the last finish of the flow schedule, or
        (``turns``: one client after another) the sum of each client's time alone. Compute is ``measured``
        (wall seconds) unless the network model predicts it (``network.compute: model``)."""
        compute = self.network.compute_seconds(clients, self.samples[clients], measured_compute)
        if self.turns:
            alone = [self._finish(clients[i : i + 1], traffic.of(slice(i, i + 1)), compute[i : i + 1])
                     for i in range(len(clients))]
            return float(np.concatenate(alone).sum()) if alone else 0.0
        return float(self._finish(clients, traffic, compute).max(initial=0.0))

    def _finish(self, clients: np.ndarray, t: Traffic, compute: np.ndarray) -> np.ndarray:
        return self.network.round_seconds(clients, t.down_bytes, t.down_messages, t.up_bytes, t.up_messages,
                                          compute, t.broadcast_bytes)

    def resume(self, saved: Results, round_: int) -> None:
        """Rank 0: the clock as the run in ``saved`` summed it up to ``round_``."""
        rounds = saved.table("rounds")
        for seconds in rounds["sim_time_s"][rounds["round"] <= round_]:
            self.now_s += float(seconds)

    def advance(self, start_s: float, server_s: float, clients_s: float) -> float:
        """Move the clock past a round that started at ``start_s`` (later than the clock when the server waited
        for a client to come online); returns the round's simulated seconds: the wait, the server's measured
        compute (none when compute is modeled: nothing may depend on the machine), and the clients' side."""
        seconds = (start_s - self.now_s) + (0.0 if self.network.modeled_compute else server_s) + clients_s
        self.now_s = self.now_s + seconds
        return seconds
