"""Pooling per-client evaluation rows into the numbers a paper reports."""

from __future__ import annotations

import numpy as np

from mpifl.training.sgd import EVAL_FIELDS

N, CORRECT, LOSS, Y_SUM, Y_SQ = range(len(EVAL_FIELDS))


def summarize(rows: np.ndarray, regression: bool) -> dict[str, float]:
    """Sample-weighted (pooled) and mean-of-clients scores of ``rows`` (one row per client).

    Classification reports accuracy; regression reports R² (as ``acc`` so curves line up) and MSE.
    """
    if len(rows) == 0:
        return {}
    n = rows[:, N]
    total = n.sum()
    out = {"loss": float(rows[:, LOSS].sum() / total)}
    if regression:
        sst = rows[:, Y_SQ] - rows[:, Y_SUM] ** 2 / np.maximum(n, 1)
        pooled_sst = rows[:, Y_SQ].sum() - rows[:, Y_SUM].sum() ** 2 / total
        out["acc_pooled"] = float(1 - rows[:, LOSS].sum() / pooled_sst)
        with np.errstate(divide="ignore", invalid="ignore"):
            per_client = 1 - rows[:, LOSS] / sst
        out["acc_mean"] = float(np.mean(per_client[np.isfinite(per_client)]))
    else:
        out["acc_pooled"] = float(rows[:, CORRECT].sum() / total)
        out["acc_mean"] = float(np.mean(rows[:, CORRECT] / np.maximum(n, 1)))
    return out
