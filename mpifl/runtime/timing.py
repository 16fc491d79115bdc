"""Where a rank's wall time goes: the parts of its round loop that do not overlap (never the simulated clock:
that is :mod:`.simtime`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TIME_PARTS = ("compute", "data", "server", "eval", "mpi", "serialization", "io")
"""The per-rank time breakdown (results: /ranks totals, /profile per round with --profile), as <part>_seconds."""


@dataclass
class RankTimes:
    """Where this rank's wall time went (seconds), in parts that do not overlap; waiting for MPI and packing
    its buffers are the transport's. The round loop's wall time minus all parts is bookkeeping."""

    compute: float = 0.0  # clients' local work: training, descriptors, gradients, packing their rows
    data: float = 0.0  # materializing clients' data (visitors under dynamic placement, generated clients)
    server: float = 0.0  # the server algorithm's steps
    evaluation: float = 0.0  # models evaluated on clients' test data
    serialization: float = 0.0  # checkpoint state and visiting clients' state to flat bytes
    io: float = 0.0  # writing the results file
    setup: float = 0.0  # building the layout, loading this rank's clients, restoring a checkpoint
    loop_wall: float = 0.0
    loop_cpu: float = 0.0


class Profile:
    """``--profile``: this rank's wall seconds and :data:`TIME_PARTS` of every round."""

    COLUMNS = ("round", "wall_seconds", *(f"{part}_seconds" for part in TIME_PARTS), "rank")

    def __init__(self, rank: int):
        self.rank = rank
        self._rows: list[np.ndarray] = []

    def add(self, round_: int, wall_seconds: float, parts: np.ndarray) -> None:
        self._rows.append(np.concatenate(([round_, wall_seconds], parts, [self.rank])))

    def rows(self) -> np.ndarray:
        return np.array(self._rows).reshape(-1, len(self.COLUMNS))

    @classmethod
    def table(cls, per_rank: list[np.ndarray]) -> dict[str, np.ndarray]:
        """Every rank's rows as the results file's /profile table."""
        rows = np.concatenate(per_rank)
        table = {name: rows[:, j] for j, name in enumerate(cls.COLUMNS)}
        for name in ("round", "rank"):
            table[name] = table[name].astype(np.int64)
        return table
