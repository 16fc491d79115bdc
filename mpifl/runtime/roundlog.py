"""What every round reports, whether its clients train together or one event at a time (:mod:`.asynchronous`):
the participants' compute seconds and training losses, gathered from the workers (simulator bookkeeping, never
logical traffic), and rank 0's row of the rounds table."""

from __future__ import annotations

import time

import numpy as np

from mpifl.comm import Message, Placement
from mpifl.runtime.rank import RankContext
from mpifl.runtime.recorder import Recorder
from mpifl.runtime.walker import Walk

TELEMETRY_FIELDS = ("compute_s", "train_loss")


class RoundLog:
    def __init__(self, rank: RankContext, recorder: Recorder, samples_per_round: np.ndarray):
        self.transport, self.ledger, self.server, self.client = rank.transport, rank.ledger, rank.server, rank.client
        self.recorder, self.samples = recorder, samples_per_round
        self.msg = Message("telemetry", "up", len(TELEMETRY_FIELDS), "float64", logical=False)

    def telemetry(self, round_: int, walk: Walk) -> np.ndarray | None:
        """Each client still in ``walk``: its compute seconds and mean training loss (rows on rank 0, in client-id
        order; ``None`` elsewhere). A collective."""
        rows = np.empty((len(walk.local), len(TELEMETRY_FIELDS)))
        rows[:, 0] = walk.seconds
        rows[:, 1] = [self.client.take_train_loss(int(c)) for c in walk.local] if self.client else []
        return self.transport.up(round_, self.msg, rows, walk.clients)

    def record(self, round_: int, started: float, server_s: float, sim_time_s: float, telemetry: np.ndarray,
               clients: np.ndarray, placement: Placement, rejected: int, **extra: float) -> None:
        """Rank 0: the round's row (``started``: its wall-clock start, ``clients``: those who trained), with the
        server algorithm's own diagnostics."""
        totals = self.ledger.round_totals(round_)
        losses = telemetry[:, 1]
        self.recorder.record_round({
            "round": round_,
            "sim_time_s": sim_time_s,
            "wall_time_s": time.perf_counter() - started,
            "server_time_s": server_s,
            "client_compute_time_s": float(telemetry[:, 0].sum()),  # ÷ workers: the round's ideal time
            "train_loss": float(np.nanmean(losses)) if np.isfinite(losses).any() else np.nan,
            "logical_up_bytes": totals["up"],
            "logical_down_bytes": totals["down"],
            "participants": len(clients),
            "load_imbalance": self.load_imbalance(placement, clients),
            "rejected_updates": rejected,
            **extra,
        }, self.server.round_metrics() if self.server is not None else {})

    def load_imbalance(self, placement: Placement, clients: np.ndarray) -> float:
        """The busiest worker's planned samples over the mean worker's (1 = perfectly balanced round)."""
        size = self.transport.size
        work = np.bincount(placement.owner[clients], self.samples[clients], minlength=size)
        work = work[1:] if size > 1 else work
        return float(work.max() / work.mean()) if work.sum() else 1.0
