"""Emulated client faults: drop-out, deadlines with over-selection, and broken (non-finite) updates.

Which clients survive a round is decided before it starts, from (seed, round, client) and the
simulated clock's *expected* finish times (transfers plus ``seconds_per_sample`` × samples, :mod:`.simtime`),
never from measured wall time, so the outcome is the same for every rank count and every rerun.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mpifl.config import FaultsConfig

_DROPOUT_TAG = 0x64726F70
_CORRUPT_TAG = 0x636F7272


def selection_size(clients_per_round: int, cfg: FaultsConfig) -> int:
    """How many clients a round samples: with over-selection, (1 + o)·m rounded up, to keep the m fastest."""
    return math.ceil(clients_per_round * (1 + cfg.over_selection))


@dataclass(frozen=True)
class FaultModel:
    cfg: FaultsConfig
    seed: int

    def selection_size(self, clients_per_round: int) -> int:
        return selection_size(clients_per_round, self.cfg)

    def participants(self, round_: int, sampled: np.ndarray, wanted: int,
                     expected_finish: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """The sampled clients that take part: those that did not drop out, finish before the deadline,
        and (with over-selection) are among the ``wanted`` first to finish. Sorted by id. ``expected_finish``
        gives the finish times of the clients left after drop-out running the round together (so a shared
        server link's contention counts); it is asked only with a deadline or over-selection."""
        clients = self.survivors_of_dropout(round_, sampled)
        if self.cfg.deadline_s is None and not self.cfg.over_selection:
            return clients
        expected = expected_finish(clients)
        if self.cfg.deadline_s is not None:
            clients, expected = clients[expected <= self.cfg.deadline_s], expected[expected <= self.cfg.deadline_s]
        first = np.lexsort((clients, expected))[:wanted]
        return np.sort(clients[first])

    def survivors_of_dropout(self, round_: int, clients: np.ndarray) -> np.ndarray:
        """The ``clients`` that do not fail before they send (``faults.dropout``)."""
        if not self.cfg.dropout:
            return clients
        draws = np.array([np.random.default_rng([self.seed, _DROPOUT_TAG, round_, int(c)]).random()
                          for c in clients])
        return clients[draws >= self.cfg.dropout]

    def corrupted(self, round_: int, clients: np.ndarray) -> np.ndarray:
        """Which of ``clients`` send NaN in place of this round's training uploads (``faults.corrupt``: a
        diverged or faulty client, to exercise ``faults.nonfinite``)."""
        if not self.cfg.corrupt:
            return np.zeros(len(clients), dtype=bool)
        draws = np.array([np.random.default_rng([self.seed, _CORRUPT_TAG, round_, int(c)]).random()
                          for c in clients])
        return draws < self.cfg.corrupt


def inject_fault(rank: int, round_: int) -> None:
    """Resilience drills: ``MPIFL_INJECT_FAULT=RANK:ROUND`` makes that rank raise at that round."""
    spec = os.environ.get("MPIFL_INJECT_FAULT")
    if spec and spec == f"{rank}:{round_}":
        raise RuntimeError(f"fault injected by MPIFL_INJECT_FAULT={spec}")
