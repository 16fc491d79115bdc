"""Where a rank's time goes: the parts of its round loop that do not overlap."""

from __future__ import annotations

from dataclasses import dataclass

TIME_PARTS = ("compute", "data", "server", "eval", "mpi", "serialization", "io")
"""The per-rank time breakdown (results: /ranks totals, /profile per round with --profile), as <part>_seconds."""


@dataclass
class RankClock:
    """Where this rank's time went (seconds), in parts that do not overlap; waiting for MPI and packing
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
