"""Where a rank's wall time goes: the parts of its round loop that do not overlap (never the simulated clock:
that is :mod:`.simtime`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from mpifl.algorithms.base import ClientAlgorithm
    from mpifl.comm import Placement, Transport
    from mpifl.runtime.store import ClientStore
    from mpifl.runtime.visits import Visits

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


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far."""
    import resource

    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux reports KiB
    return int(kib) * 1024


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


def rank_summary(rank: int, placement: Placement, transport: Transport, visits: Visits,
                 client: ClientAlgorithm | None, store: ClientStore | None, times: RankTimes,
                 parts: np.ndarray) -> dict[str, Any]:
    """What this rank reports once, at the end (results table /ranks): its clients and counters, what MPI moved,
    and where its time went (``parts``: seconds of each of :data:`TIME_PARTS` during the round loop)."""
    visitor_bytes, visitor_wait = visits.traffic()
    return {"rank": rank, "clients": len(placement.clients_of(rank)),
            **(client.rank_stats() if client is not None else {}),
            **({"client_data_loads": store.loads} if store is not None else {}),
            **({"states_spilled": client.state.spills, "states_reloaded": client.state.reloads}
               if client is not None else {}),
            "mpi_bytes": transport.physical.total_bytes,
            "visitor_states_moved": visits.moved_states,
            "visitor_state_bytes": visitor_bytes, "visitor_state_wait": visitor_wait,  # (wait: seconds, part of mpi)
            **{f"{part}_seconds": t for part, t in zip(TIME_PARTS, parts)},
            "loop_wall_seconds": times.loop_wall, "loop_cpu_seconds": times.loop_cpu,
            "setup_wall_seconds": times.setup, "peak_rss_bytes": peak_rss_bytes()}
