"""Which clients take part in a round: a function of (seed, round) only, so every rank agrees."""

from __future__ import annotations

import numpy as np

_SAMPLING_TAG = 0x73616D70


def sample_clients(seed: int, round_: int, seen: np.ndarray, count: int) -> np.ndarray:
    """``count`` distinct seen clients, uniformly without replacement, sorted by id."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, _SAMPLING_TAG, round_]))
    return np.sort(rng.choice(seen, size=count, replace=False))
