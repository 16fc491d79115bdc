"""What each rank reports once, at the end of a run (the results file's /ranks table): its clients and counters,
what MPI moved, where its time went and its peak memory."""

from __future__ import annotations

from typing import Any

import numpy as np

from mpifl.algorithms.base import ClientAlgorithm
from mpifl.comm import Placement, Transport
from mpifl.runtime.store import ClientStore
from mpifl.runtime.timing import TIME_PARTS, RankTimes
from mpifl.runtime.visits import Visits


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far."""
    import resource

    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux reports KiB
    return int(kib) * 1024


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
