"""Evaluating every client: the plans that bring the models to evaluate (new clients' first, then the prelude
among the seen clients, then the evaluation plan), each ``eval_chunk`` clients at a time so the server's
per-client evaluation state (e.g. one personal model per client) stays bounded; each client's row of sums,
gathered on rank 0 and pooled into the evaluation row."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from mpifl.algorithms.base import EvalLayout, Protocol, Stage, StepContext
from mpifl.comm import Message, Step
from mpifl.comm.messages import require
from mpifl.data import FederatedLayout
from mpifl.runtime.rank import RankContext
from mpifl.runtime.recorder import Recorder
from mpifl.runtime.walker import PlanWalker


class Evaluation:
    def __init__(self, rank: RankContext, layout: FederatedLayout, eval_layout: EvalLayout, chunk: int,
                 protocol: Protocol, walker: PlanWalker, recorder: Recorder):
        self.layout, self.eval_layout, self.chunk, self.protocol = layout, eval_layout, chunk, protocol
        self.rank, self.walker, self.recorder = rank, walker, recorder
        self.server, self.client = rank.server, rank.client
        self.msg = Message("eval_metrics", "up", eval_layout.width, "float64", logical=False)

    def run(self, round_: int) -> None:
        """Every client evaluated after ``round_``; rank 0 records the row. A collective."""
        seen = np.flatnonzero(~self.layout.unseen)
        self._walk_chunks(round_, "newcomer", self.protocol.newcomer_plan(), np.flatnonzero(self.layout.unseen))
        self._walk_chunks(round_, "eval_prelude", self.protocol.eval_prelude(), seen)
        blocks = [self._evaluate(round_, chunk) for chunk in self._chunks(np.arange(self.layout.num_clients))]
        if self.client is not None:
            self.client.end_round()
        self.rank.release_data()
        if self.server is None:
            return
        rows = np.concatenate([require(block, "the gathered evaluation") for block in blocks])
        self.recorder.record_evaluation(round_, rows, self.rank.ledger.train_bytes, self.server.eval_metrics())
        self.server.end_evaluation()

    def _walk_chunks(self, round_: int, stage: Stage, plan: Sequence[Step], clients: np.ndarray) -> None:
        for chunk in self._chunks(clients) if plan else ():
            self.walker.walk(round_, stage, plan, chunk)
            self.rank.release_data()

    def _chunks(self, clients: np.ndarray) -> list[np.ndarray]:
        size = self.chunk or max(len(clients), 1)
        return [clients[i : i + size] for i in range(0, len(clients), size)]

    def _evaluate(self, round_: int, clients: np.ndarray) -> np.ndarray | None:
        """Walk the eval plan among ``clients``, evaluate the local ones, gather their rows (nobody drops out)."""
        local = self.walker.walk(round_, "eval", self.protocol.eval_plan(), clients).local
        start = time.perf_counter()
        rows = np.zeros((len(local), self.msg.numel))
        if self.client is not None:
            step = StepContext(round_, "eval", clients)
            for i, client in enumerate(local):
                rows[i] = self.client.evaluate(step, int(client), self.eval_layout)
        self.rank.times.evaluation += time.perf_counter() - start
        self.rank.release_data()
        return self.rank.transport.up(round_, self.msg, rows, clients)
