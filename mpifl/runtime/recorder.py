"""Rank 0's record of a run: one row per round, one per evaluation, the final per-client metrics, and the
results file, appended to from a background thread so the next round's messages go out while it writes.
Each write appends only what is new since the last one (rows, ledger rows, collectives)."""

from __future__ import annotations

import contextlib
import functools
import platform
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mpifl import __version__
from mpifl.algorithms.base import EvalLayout
from mpifl.comm import Ledger, PhysicalLog
from mpifl.comm.ledger import STAGES
from mpifl.config import RunConfig, config_to_dict
from mpifl.data import FederatedLayout
from mpifl.results import APPENDED, AppendOnlyFile, Results, Table, ledger_summaries, rows_up_to
from mpifl.runtime.launcher import launcher_prefix
from mpifl.runtime.metrics import summarize
from mpifl.training.device import cpu_kernels

SEGMENT_COLUMNS = (("first_round", np.int64), ("last_round", np.int64), ("world_size", np.int64),
                   ("wall_time_s", np.float64))
"""The segments table: one row per start or resume of the run."""


class Recorder:
    """The tables of a run (kept on rank 0) and the file they are written to."""

    def __init__(self, cfg: RunConfig, layout: FederatedLayout, eval_layout: EvalLayout, output: Path,
                 world_size: int, owner: np.ndarray):
        self.cfg, self.layout, self.output, self.world_size = cfg, layout, output, world_size
        self.eval_layout = eval_layout
        self.owner = owner  # each client's home rank (the clients table)
        self.rounds, self.evaluations = Table(), Table()
        self.diagnostics: dict[str, set[str]] = {"rounds": set(), "eval": set()}  # the algorithm's own columns
        self.final_rows: np.ndarray | None = None  # the last evaluation's per-client rows
        self.started = time.time()
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpifl-results")
        self.pending_write: Future | None = None
        self.file: AppendOnlyFile | None = None  # opened by the first write (in the writer thread)
        self.committed: tuple[int, int | None] | None = None  # the file's (rounds, checkpoint round), once closed
        self.opening = True  # the next write is the first: it opens the file and writes the run's attributes
        self.resumed = False  # continue the file a checkpoint was read from, rather than create it
        self.written = dict.fromkeys(APPENDED, 0)  # rows of each appended table in the file
        self.checkpoint_round: int | None = None  # the round of the checkpoint in the file
        self.clients_changed = True  # the clients table is out of date in the file
        self.first_round = 1  # this segment's (a resumed run's segments: the ones before, then this one)
        self.earlier_segments: dict[str, np.ndarray] = {name: np.zeros(0, dtype) for name, dtype in SEGMENT_COLUMNS}

    # ---------------------------------------------------------------------------------- rows
    def record_round(self, row: dict[str, float], diagnostics: dict[str, float] | None = None) -> None:
        """A round's row: the engine's columns, the algorithm's ``diagnostics`` and when the round ended (Unix
        time, so exported metrics carry real wall times)."""
        diagnostics = diagnostics or {}
        self.diagnostics["rounds"].update(diagnostics)
        self.rounds.append({**row, **diagnostics, "unix_time_s": time.time()})

    def record_evaluation(self, round_: int, rows: np.ndarray, train_bytes: int, extra: dict[str, float]) -> None:
        """One evaluation row from every client's :data:`EVAL_FIELDS` sums (per model kind and data split):
        pooled and mean-of-clients scores for the seen and the unseen clients."""
        self.final_rows, self.clients_changed = rows, True
        row: dict[str, float] = {"round": round_, "cum_logical_bytes": float(train_bytes)}
        regression = self.layout.task == "regression"
        for (kind, split), block in self.eval_layout.blocks(rows):
            prefix = "" if split == "test" else f"{split}_"
            for group, mask in (("seen", ~self.layout.unseen), ("unseen", self.layout.unseen)):
                for name, value in summarize(block[mask], regression).items():
                    row[f"{kind}.{group}.{prefix}{name}"] = value
        row.update(extra)
        self.diagnostics["eval"].update(extra)
        self.evaluations.append(row)

    def progress_line(self, round_: int) -> str:
        """The line printed at an evaluation: the newest scores, and the median wall time of the last 100 rounds
        (recent rows only, so printing costs the same at round 10,000 as at round 10)."""
        last = self.evaluations.since(self.evaluations.length - 1)
        rounds = self.rounds.since(max(self.rounds.length - 100, 0))
        kind = self.eval_layout.kinds[0]
        parts = [f"round {round_:>{len(str(self.cfg.rounds))}}/{self.cfg.rounds}"]
        for group in ("seen", "unseen"):
            key = f"{kind}.{group}.acc_pooled"
            if key in last:
                parts.append(f"{group} acc {last[key][-1]:.4f} (mean {last[f'{kind}.{group}.acc_mean'][-1]:.4f})")
        parts.append(f"loss {rounds['train_loss'][-1]:.4f}")
        parts.append(f"logical {last['cum_logical_bytes'][-1] / 1e6:.2f} MB")
        parts.append(f"{np.median(rounds['wall_time_s']):.3f} s/round")
        return " | ".join(parts)

    def continue_from(self, saved: Results, round_: int) -> None:
        """Start from a results file's rows up to ``round_`` (resuming a run): rank 0's tables here, and the
        file's appended tables continue after their rows up to that round (later ones are overwritten)."""
        for table, target in (("rounds", self.rounds), ("eval", self.evaluations)):
            columns = saved.table(table)
            if columns:
                keep = columns["round"] <= round_
                target.extend({k: v[keep] for k, v in columns.items()})
            self.diagnostics[table].update(saved.diagnostics(table))
        self.written = {table: rows_up_to(self.output, table, round_) for table in APPENDED}
        self.resumed, self.checkpoint_round = True, round_
        self.first_round = round_ + 1
        earlier: dict[str, Any] = dict(saved.table("segments")) or {  # from before segments were recorded: one
            "first_round": [1], "last_round": [saved.attrs.get("rounds_completed", round_)],
            "world_size": [saved.attrs.get("world_size", 0)], "wall_time_s": [saved.attrs.get("wall_time_s", 0.0)]}
        self.earlier_segments = {name: np.asarray(earlier[name], dtype) for name, dtype in SEGMENT_COLUMNS}

    def segments(self) -> dict[str, np.ndarray]:
        """The run's segments so far (each start or resume to its last write): rounds, ranks and wall time each."""
        now = (self.first_round, self.rounds.length, self.world_size, time.time() - self.started)
        return {name: np.append(self.earlier_segments[name], np.asarray(value, dtype))
                for (name, dtype), value in zip(SEGMENT_COLUMNS, now)}

    # ---------------------------------------------------------------------------------- file
    def write(self, status: str, ledger: Ledger, physical: PhysicalLog, checkpoint: dict[str, Any] | None = None,
              final: dict[str, dict[str, np.ndarray]] | None = None, wait: bool = False) -> None:
        """Hand what is new since the last write to the background thread, which appends it to the file and
        commits it (one write at a time, in order); ``checkpoint``: {"round": r, "blobs": {...}}, written when
        it is a new one; ``final``: the tables only the end has (model, ranks, profile); ``wait``: return once
        it is on disk and the file is closed."""
        rows = physical.drain()
        ledger_rows = ledger.drain()
        totals, spread = ledger_summaries(ledger_rows, ledger.directions)
        new: dict[str, dict[str, np.ndarray]] = {
            "rounds": self.rounds.since(self.written["rounds"]),
            "eval": self.evaluations.since(self.written["eval"]),
            "ledger": ledger_rows,
            "ledger_totals": totals,
            "ledger_clients": spread,
            "physical": {
                "round": np.array([r[0] for r in rows], dtype=np.int64),
                "message": np.array([r[1] for r in rows], dtype="S64"),
                "op": np.array([r[2] for r in rows], dtype="S64"),
                "bytes": np.array([r[3] for r in rows], dtype=np.int64),
                "seconds": np.array([r[4] for r in rows], dtype=np.float64),
            },
        }
        appended = {table: (self.written[table], columns) for table, columns in new.items()}
        for table, columns in new.items():
            self.written[table] += len(columns["round"]) if columns else 0
        segments = self.segments()
        replaced = {"segments": segments, **(final or {})}
        if self.clients_changed:
            replaced["clients"], self.clients_changed = self.client_table(), False
        names = {"message_names": list(ledger.message_names), "directions": list(ledger.directions),
                 "stages": list(STAGES)}
        table_attrs: dict[str, dict[str, Any]] = {
            "ledger": names, "ledger_totals": names,
            **{table: {"diagnostics": sorted(names)} for table, names in self.diagnostics.items() if names}}
        blobs = None
        if checkpoint and checkpoint["round"] != self.checkpoint_round:
            blobs = (int(checkpoint["round"]), checkpoint["blobs"])
            self.checkpoint_round = blobs[0]
        attrs = {**(self.run_attrs if self.opening else {}), "status": status,
                 "rounds_completed": int(self.rounds.length), "wall_time_s": float(segments["wall_time_s"].sum())}
        self.await_write()
        contents = (attrs, appended, replaced, table_attrs, blobs)
        self.pending_write = self.writer.submit(self._append, self.opening, contents, wait)
        self.opening = False
        if wait:
            self.await_write()
            self.writer.shutdown()

    def _append(self, opening: bool, contents: tuple, last: bool) -> None:
        """In the writer thread: open the file (the first time), write, and close it after the last write."""
        if opening:
            self.file = AppendOnlyFile(self.output, self.resumed)
        assert self.file is not None, "the first write opens the file"
        self.file.write(*contents)
        if last:
            self.close()

    def close(self) -> None:
        if self.file is not None:
            self.committed = self.file.kept  # what its last completed write left on disk (None: not yet created)
            self.file.close()
            self.file = None

    @functools.cached_property
    def run_attrs(self) -> dict[str, object]:
        """The results file's attributes that do not change during a run (worked out once)."""
        import mpi4py
        import yaml
        from mpi4py import MPI

        return {
            "config": yaml.safe_dump(config_to_dict(self.cfg), sort_keys=False),
            "algorithm": self.cfg.algorithm,
            "world_size": self.world_size,
            "eval_kinds": list(self.eval_layout.kinds),
            "task": self.layout.task,
            "mpifl_version": __version__,
            "python_version": sys.version.split()[0],
            "torch_version": str(torch.__version__),
            "numpy_version": np.__version__,
            "mpi4py_version": mpi4py.__version__,
            "mpi_library": MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip(),
            "hostname": platform.node(),
            "cpu_kernels": cpu_kernels(),  # the same on every rank (check_cpu_kernels)
            "launcher": launcher_prefix(self.world_size),  # what the command that continues the run starts with
        }

    def settle(self) -> None:
        """After a failure: let the write in flight finish (best effort), so the file keeps every completed
        evaluation."""
        with contextlib.suppress(Exception):
            self.await_write()
        self.writer.shutdown()
        with contextlib.suppress(Exception):
            self.close()

    def await_write(self) -> None:
        """Finish the write in flight, raising its error here if it failed."""
        if self.pending_write is not None:
            self.pending_write.result()
            self.pending_write = None

    def client_table(self) -> dict[str, np.ndarray]:
        """The final per-client metrics (test split) of every model kind."""
        layout = self.layout
        table: dict[str, np.ndarray] = {
            "client": np.arange(layout.num_clients),
            "unseen": layout.unseen.astype(np.int8),
            "train_size": layout.train_sizes,
            "owner": self.owner,
        }
        if self.final_rows is not None:
            for (kind, split), block in self.eval_layout.blocks(self.final_rows):
                if split != "test":
                    continue
                n = np.maximum(block[:, 0], 1)
                table[f"{kind}.n_test"] = block[:, 0]
                table[f"{kind}.loss"] = block[:, 2] / n
                if layout.task != "regression":
                    table[f"{kind}.acc"] = block[:, 1] / n
        return table
