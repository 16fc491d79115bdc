"""Summaries of the ledger's per-client rows that the results file keeps beside them (what ``mpifl report``
shows without reading every row)."""

from __future__ import annotations

import numpy as np


def ledger_summaries(rows: dict[str, np.ndarray], directions: list[str]
                     ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Two small tables of ledger rows covering whole rounds: the bytes per (round, stage, message) and, per
    (round, stage, direction), the spread of what one client moved in that round (``clients``, ``bytes_min``,
    ``bytes_max``, ``bytes_sum``) — what ``report`` shows without reading per-client rows."""
    rounds, stages, messages, nbytes = rows["round"], rows["stage"], rows["message"], rows["bytes"]
    keys, which = np.unique(np.stack([rounds, stages, messages], axis=1), axis=0, return_inverse=True)
    keys = keys.reshape(-1, 3)
    totals: dict[str, np.ndarray] = {"round": keys[:, 0].astype(np.int64), "stage": keys[:, 1].astype(np.int8),
              "message": keys[:, 2].astype(np.int32),
              "bytes": np.bincount(which.ravel(), weights=nbytes, minlength=len(keys)).astype(np.int64)}
    up = np.array([d == "up" for d in directions], dtype=np.int64)
    direction = up[messages] if len(up) else np.zeros(0, np.int64)
    pairs, which = np.unique(np.stack([rounds, stages, direction, rows["client"]], axis=1), axis=0,
                             return_inverse=True)
    pairs = pairs.reshape(-1, 4)
    sums = np.bincount(which.ravel(), weights=nbytes, minlength=len(pairs)).astype(np.int64)
    groups, which = np.unique(pairs[:, :3], axis=0, return_inverse=True)
    groups, which = groups.reshape(-1, 3), which.ravel()
    low, high = np.full(len(groups), np.iinfo(np.int64).max), np.zeros(len(groups), np.int64)
    np.minimum.at(low, which, sums)
    np.maximum.at(high, which, sums)
    spread: dict[str, np.ndarray] = {"round": groups[:, 0].astype(np.int64), "stage": groups[:, 1].astype(np.int8),
              "direction": groups[:, 2].astype(np.int8),
              "clients": np.bincount(which, minlength=len(groups)).astype(np.int64), "bytes_min": low,
              "bytes_max": high, "bytes_sum": np.bincount(which, weights=sums, minlength=len(groups)).astype(np.int64)}
    return totals, spread
