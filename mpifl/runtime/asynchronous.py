"""Asynchronous rounds (FedBuff): clients dispatched and arriving one event at a time on the simulated clock.

One engine round is one server step. The server decides every event (it alone knows who is in flight and
when each arrives), so the workers need no copy of that state: before each event it broadcasts the clients it
dispatches now, or that the step is complete. Each dispatch is a walk of the protocol's training plan among
those clients (download the current model, train, upload the delta); the server holds each delta until its
client's simulated arrival, then buffers it (``mpifl.algorithms.fedbuff``).

A client's arrival is its dispatch time plus its time alone on the network model: the download and the upload
of the plan's messages at their nominal sizes over its own link, each message with its latency, and
``seconds_per_sample`` × its planned samples of compute (``network.compute: model``, so the order of events
never depends on this machine's load). Which idle client a freed slot gets is drawn from (seed, dispatch
event); with ``network.availability`` only among the clients online at that time. The ledger counts a
client's messages in the round of its dispatch.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from mpifl.algorithms.fedbuff import FedBuffServer
from mpifl.comm import Message

if TYPE_CHECKING:
    from mpifl.runtime.engine import Engine

_DISPATCH_TAG = 0x64697370


class AsynchronousRounds:
    def __init__(self, engine: Engine):
        self.engine = engine
        concurrency = engine.protocol.concurrency  # type: ignore[attr-defined]
        # [step complete?, the dispatched clients, -1 padding]: the server's decision, on every rank
        self.decision_msg = Message("dispatch", "down", concurrency + 1, "int64", broadcast=True, logical=False)

    def train_round(self, round_: int) -> None:
        """Events until the server's next step: dispatches walked, arrivals buffered; rank 0 records the step."""
        e = self.engine
        server = e.server if isinstance(e.server, FedBuffServer) else None
        start, server_before = time.perf_counter(), e.clock.server
        clock_before = server.clock if server is not None else 0.0
        plan = e.protocol.train_plan(round_)
        e.walker.rejected = 0
        dispatched, telemetry = [], []
        while True:
            started = time.perf_counter()
            payload = self._decide(round_, server)
            e.clock.server += time.perf_counter() - started if server is not None else 0.0
            decision = e.transport.broadcast(round_, self.decision_msg, payload)
            if decision[0]:
                break
            clients = decision[1:][decision[1:] >= 0]
            if len(clients):
                dispatched.append(clients)
                walk = e.walker.walk(round_, "train", plan, clients)
                e._end_round()
                rows = np.empty((len(walk.local), 2))
                rows[:, 0] = walk.seconds
                rows[:, 1] = [e.client.take_train_loss(int(c)) for c in walk.local] if e.client else []
                gathered = e.transport.up(round_, "train", e.telemetry_msg, rows, walk.clients)
                telemetry.append(gathered if gathered is not None else np.zeros((0, 2)))
        if server is None:
            return
        clients = np.concatenate(dispatched) if dispatched else np.zeros(0, np.int64)
        seen = np.concatenate(telemetry) if telemetry else np.zeros((0, 2))
        totals = e.transport.ledger.round_totals(round_)
        e.recorder.record_round({
            "round": round_,
            "sim_time_s": server.clock - clock_before,  # from the previous step to this one
            "wall_time_s": time.perf_counter() - start,
            "server_time_s": e.clock.server - server_before,
            "client_compute_time_s": float(seen[:, 0].sum()),
            "train_loss": float(np.nanmean(seen[:, 1])) if np.isfinite(seen[:, 1]).any() else np.nan,
            "logical_up_bytes": totals["up"],
            "logical_down_bytes": totals["down"],
            "participants": len(clients),  # clients dispatched (trained) during this step
            "load_imbalance": e._load_imbalance(e.placement, clients),
            "rejected_updates": e.walker.rejected,
            "sim_clock_s": server.clock,  # when this step was taken
        }, server.round_metrics())

    def _decide(self, round_: int, server: FedBuffServer | None) -> np.ndarray | None:
        """Rank 0: the next event's outcome, to broadcast: the step is complete (``[1, ...]``), or the clients that
        train now (``[0, clients..., -1...]``). Arrivals due by the current time are all taken before any free
        slot is refilled, so clients arriving together all see the step they complete."""
        if server is None:
            return None
        decision = np.full(self.decision_msg.numel, -1, dtype=np.int64)
        decision[0] = 1
        while True:
            if server.arrival_s and server.next_arrival()[1] <= server.clock:
                if server.arrive():
                    return decision
                continue
            training = self._dispatch(round_, server)
            if training is not None:
                decision[0] = 0
                decision[1 : 1 + len(training)] = training
                return decision
            if server.arrival_s:  # nobody to dispatch now: on to the next arrival
                if server.arrive():
                    return decision
                continue
            # nobody in flight and nobody idle online: wait until someone comes online
            server.clock = max(self.engine.availability.next_online(server.clock),
                               float(np.nextafter(server.clock, np.inf)))

    def _dispatch(self, round_: int, server: FedBuffServer) -> np.ndarray | None:
        """Fill the free slots now from the idle clients online (None: no slot or nobody to fill it); returns
        the dispatched clients that train (one that drops out, ``faults.dropout``, is in flight but its update
        never arrives)."""
        e = self.engine
        idle = np.setdiff1d(e.seen, server.in_flight())
        online = idle[e.availability.available(server.clock)[idle]]
        count = min(server.free_slots, len(online))
        if count == 0:
            return None
        rng = np.random.default_rng(np.random.SeedSequence([e.cfg.seed, _DISPATCH_TAG, server.dispatches]))
        clients = np.sort(rng.choice(online, size=count, replace=False))
        server.dispatch(clients, server.clock + self._seconds_alone(round_, clients))
        return e.faults.participants(round_, clients, count, 0, 0, (0, 0), e.samples_per_round)

    def _seconds_alone(self, round_: int, clients: np.ndarray) -> np.ndarray:
        """Each client's download + compute + upload time on its own link (the plan's nominal message sizes)."""
        e = self.engine
        logical = [m for m in e.protocol.train_plan(round_) if isinstance(m, Message) and m.logical]
        down = [m for m in logical if m.direction == "down"]
        up = [m for m in logical if m.direction == "up"]
        n = len(clients)
        return e.network.client_seconds(
            clients, np.full(n, sum(map(e.wire.nominal_nbytes, down))), len(down),
            np.full(n, sum(map(e.wire.nominal_nbytes, up))), len(up),
            e.network.seconds_per_sample[clients] * e.samples_per_round[clients])
