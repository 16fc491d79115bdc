"""Space before round 1: what a run will write, estimated from its config and the parts set-up built, and
whether the file system holds it.

The results file is mostly whole HDF5 chunks: every column of a table that grows with the run takes space a
chunk at a time (the ledger's 16,384 rows, every other table's 1,024: :mod:`mpifl.results.writing`), so the
estimate counts each table's rows and rounds them up to chunks: one row per round (``rounds``), per evaluation
(``eval``), per client and message moved (``ledger``, from the protocol's plans, the cohort and the
evaluations), per message and direction of a round and an evaluation (``ledger_totals``, ``ledger_clients``),
and, on more than one rank, per collective of rank 0 (``physical``); then the tables written whole (the
clients, the ranks, the final model), and HDF5's own metadata per column. A checkpoint is the server's state
(counted as its file would hold it, :func:`~mpifl.state_io.state_size`), the rounds' own state, and one file per
worker with the committed state of every client that has trained (:meth:`Protocol.client_state`, and an
error-feedback residual per compressed upload). The folder holds ``checkpoint_keep`` checkpoints at the end, and
one more while a new one is written: room for that many is asked for, counting one beyond those
``checkpoint_every`` writes (a stop, or ``checkpoint_minutes``). What the estimate cannot see before the run (the
algorithm's own diagnostics, checkpoints of ``checkpoint_minutes`` beyond one) is left out. Its measured agreement
with real files: docs/reference/results.md#space-before-round-1 (``benchmarks/space_estimate.py``)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from mpifl.algorithms.base import AsynchronousProtocol, ServerAlgorithm
from mpifl.algorithms.base import Protocol as AlgorithmProtocol
from mpifl.comm import Message, Step
from mpifl.results.layout import shard_dir
from mpifl.results.space import StorageFull, arrays_bytes, ensure_room, readable_bytes
from mpifl.results.writing import CHUNK, LEDGER_CHUNK
from mpifl.runtime.faults import selection_size
from mpifl.schema import ConfigError
from mpifl.state_io import state_size


class SetUp(Protocol):
    """What the estimate reads of a run once set up (an :class:`~mpifl.runtime.engine.Engine` after ``prepare``;
    named here, not imported, as the engine calls the estimate)."""

    cfg: Any  # RunConfig
    layout: Any  # FederatedLayout
    protocol: AlgorithmProtocol
    size: int
    server: ServerAlgorithm | None
    visits: Any  # Visits: whether clients move between ranks
    parts: Any  # RankContext: the wire format
    recorder: Any  # Recorder: the evaluation layout
    rounds: Any  # the rounds' own checkpointed state
    profile: Any
    output: Path
    start_round: int
    resume: bool
    overwrite: bool

COLUMN_BYTES = {"rounds": 8, "eval": 8, "ledger": 8 + 8 + 4 + 1 + 8, "ledger_totals": 8 + 1 + 4 + 8,
                "ledger_clients": 8 + 1 + 1 + 4 * 8, "physical": 8 + 64 + 64 + 8 + 8}
"""A row's bytes in each appended table (``rounds`` and ``eval``: per column; the others: the whole row)."""
COLUMNS = {"ledger": 5, "ledger_totals": 4, "ledger_clients": 7, "physical": 5}
ROUND_COLUMNS = 12
"""The rounds table's columns every run has (:meth:`~mpifl.runtime.roundlog.RoundLog.record`)."""
RANK_COLUMNS = 22
"""The ranks table's columns (:func:`~mpifl.runtime.timing.rank_summary`)."""
FILE_OVERHEAD, COLUMN_OVERHEAD, EMPTY_COLUMN_OVERHEAD, WRITE_OVERHEAD = 36_000, 2_700, 500, 450
"""HDF5's own bytes in a results file (measured, benchmarks/space_estimate.py): the file's (superblock, groups,
the attributes with the config), each chunked column's (object header, chunk index; less while it has no rows)
and each write's (the metadata a write rewrites elsewhere)."""
STATE_FILE, EMPTY_FILE, STATE_OBJECT, SHARD_FILE, CLIENT_GROUP = 5_800, 800, 570, 6_144, 1_100
"""HDF5's own bytes in a checkpoint file (measured): a state file's (an empty one's), each dataset's or group's in
it, a worker's file of client states, and each client's group there."""


@dataclass(frozen=True)
class Footprint:
    """The bytes a run writes: its results file, one checkpoint, how many checkpoints the folder holds at the end
    (``kept``) and at most (``at_once``), and the results file by table."""

    results: int
    checkpoint: int
    kept: int
    at_once: int
    tables: dict[str, int] = field(default_factory=dict)
    shrink: tuple[str, ...] = ()  # the settings that shrink what the run writes most of

    @property
    def at_end(self) -> int:
        """The results file and the checkpoints left beside it once the run has ended."""
        return self.results + self.kept * self.checkpoint

    @property
    def peak(self) -> int:
        """The most the run holds on disk at once (a checkpoint written beside the kept ones)."""
        return self.results + self.at_once * self.checkpoint


class _Traffic:
    """Rows one walk of a plan adds to the ledger and its summaries, and rank 0's collectives."""

    def __init__(self, ledger: float = 0.0, totals: float = 0.0, directions: float = 0.0, collectives: float = 0.0):
        self.ledger, self.totals, self.directions, self.collectives = ledger, totals, directions, collectives

    def add(self, plan: tuple[Step, ...] | list[Step], clients: float, everyone: float, times: float = 1.0) -> None:
        messages = [m for m in plan if isinstance(m, Message)]
        logical = [m for m in messages if m.logical]
        self.ledger += times * sum(everyone if m.everyone else clients for m in logical)
        self.totals += times * len(logical)
        self.directions += times * len({m.direction for m in logical})
        # a broadcast: one collective; per-client rows down or up: sizes and the rows; a sum: its window, sizes
        # and parts (two of the three where the workers round it)
        self.collectives += times * sum(1 if m.broadcast else 3 if m.summed else 2 for m in messages)

    def scaled(self, times: float) -> _Traffic:
        return _Traffic(self.ledger * times, self.totals * times, self.directions * times, self.collectives * times)


def _chunked(rows: float, row_bytes: int, columns: int, chunk: int) -> int:
    """The bytes ``rows`` rows of a chunked table take: whole chunks of every column, and each column's metadata."""
    return math.ceil(rows / chunk) * chunk * row_bytes + columns * (COLUMN_OVERHEAD if rows else EMPTY_COLUMN_OVERHEAD)


def _state_file(obj: object) -> int:
    """The bytes of the checkpoint file of ``obj``'s state (a state no checkpoint can hold, which only a checkpoint
    refuses: counted as none)."""
    try:
        data, objects = state_size(obj)
    except TypeError:
        return EMPTY_FILE
    return STATE_FILE + data + objects * STATE_OBJECT if objects else EMPTY_FILE


def estimate(engine: SetUp) -> Footprint:
    """What the run set up in ``engine`` (rank 0, after set-up) writes from round 1 to its last: see the module."""
    cfg, layout = engine.cfg, engine.layout
    evaluations = cfg.rounds // cfg.eval_every + (cfg.rounds % cfg.eval_every != 0)
    seen = layout.num_clients - int(layout.unseen.sum())
    if isinstance(engine.protocol, AsynchronousProtocol):
        cohort = float(min(seen, engine.protocol.arrivals_per_step))
    else:
        cohort = float(min(seen, selection_size(cfg.clients_per_round, cfg.faults)))
    appended = _appended(engine, cohort, seen, evaluations)
    tables, by_rounds, by_evaluations, grown = _tables(engine, appended, evaluations)
    checkpoint, kept, at_once, written = _checkpoints(engine, cohort, seen)
    results = FILE_OVERHEAD + WRITE_OVERHEAD * (evaluations + written + 1) + sum(tables.values())
    peak = results + at_once * checkpoint
    shrink = []
    if by_rounds > peak / 4 and grown:  # fewer rows than a chunk take no less room
        shrink.append("fewer rounds" + (", a smaller clients_per_round" if tables["ledger"] > peak / 4 else ""))
    if by_evaluations > peak / 4 and evaluations > 1 and grown:
        shrink.append("a larger eval_every")
    if at_once > 1 and at_once * checkpoint > peak / 4:
        shrink.append("checkpoint_keep: 1" + (" or checkpoint_every: 0" if cfg.checkpoint_every else ""))
    return Footprint(results, checkpoint, kept, at_once, tables, tuple(shrink))


def _appended(engine: SetUp, cohort: float, seen: int, evaluations: int) -> dict[str, tuple[float, float, float]]:
    """The rows each appended table gets from the training rounds, from the evaluations and once at set-up."""
    cfg, protocol, clients = engine.cfg, engine.protocol, engine.layout.num_clients
    unseen = clients - seen
    sampled = [list(protocol.train_plan(r)) for r in range(1, min(cfg.rounds, 8) + 1)]
    train = _Traffic()
    for plan in sampled:
        train.add(plan, cohort, seen, 1 / len(sampled))
    train.collectives += 3  # the uploads' screening, the verdict, the clients' telemetry
    if engine.visits.dynamic:
        train.collectives += 1  # visitors' state sizes and state, there and back (4), in some rounds
    wire = engine.parts.wire
    if wire.masks:
        numel = max((m.numel for plan in sampled for m in plan if isinstance(m, Message) and m.update), default=0)
        train.add([m for m, _ in wire.secagg_round(int(cohort), int(cohort), numel)], cohort, seen)
    train = train.scaled(cfg.rounds)
    evaluation = _Traffic()
    evaluation.add(list(protocol.eval_prelude()), seen, seen)
    evaluation.add(list(protocol.newcomer_plan()), unseen, unseen)
    evaluation.add(list(protocol.eval_plan()), clients, clients)
    evaluation.collectives += 1  # the clients' metrics
    if cfg.eval_chunk:
        evaluation.collectives *= math.ceil(clients / cfg.eval_chunk)
    traffic = evaluation.scaled(evaluations)
    setup = _Traffic()
    at_setup = clients if protocol.setup_includes_unseen else seen
    setup.add(list(protocol.setup_plan()), at_setup, at_setup)
    return {"ledger": (train.ledger, traffic.ledger, setup.ledger),
            "ledger_totals": (train.totals, traffic.totals, setup.totals),
            "ledger_clients": (train.directions, traffic.directions, setup.directions),
            "physical": (train.collectives, traffic.collectives, setup.collectives) if engine.size > 1 else (0, 0, 0)}


def _tables(engine: SetUp, appended: dict[str, tuple[float, float, float]], evaluations: int
            ) -> tuple[dict[str, int], float, float, bool]:
    """Each table's bytes, how many of them grow with the rounds and with the evaluations, and whether any table
    grows past its first chunk."""
    cfg, layout, protocol, size = engine.cfg, engine.layout, engine.protocol, engine.size
    rounds, clients = cfg.rounds, layout.num_clients
    kinds, splits = len(engine.recorder.eval_layout.kinds), len(engine.recorder.eval_layout.splits)
    groups = (clients > int(layout.unseen.sum())) + bool(layout.unseen.any())
    round_columns = ROUND_COLUMNS + (cfg.privacy.mode != "off") + (
        1 if isinstance(protocol, AsynchronousProtocol) else 0 if cfg.network.availability.mode == "always" else 2)
    eval_columns = 2 + kinds * splits * groups * 3
    tables = {"rounds": _chunked(rounds, 8 * round_columns, round_columns, CHUNK),
              "eval": _chunked(evaluations, 8 * eval_columns, eval_columns, CHUNK)}
    by_rounds, by_evaluations = float(tables["rounds"]), float(tables["eval"])  # what each cadence makes grow
    grown = rounds > CHUNK  # a table past its first chunk
    for name, (of_rounds, of_evaluations, once) in appended.items():
        chunk = LEDGER_CHUNK if name == "ledger" else CHUNK
        total = of_rounds + of_evaluations + once
        tables[name] = _chunked(total, COLUMN_BYTES[name], COLUMNS[name], chunk)
        grown |= total > chunk
        if total:
            by_rounds += tables[name] * of_rounds / total
            by_evaluations += tables[name] * of_evaluations / total
    final: dict[str, np.ndarray] = {}
    with contextlib.suppress(Exception):  # an algorithm whose final state needs a round first: counted as none
        final = engine.server.final_state() if engine.server is not None else {}
    tables["clients"] = clients * (8 * (4 + kinds * (2 + (layout.task != "regression"))) - 7)
    tables["ranks"] = size * 8 * RANK_COLUMNS
    tables["model"] = arrays_bytes(final.values())
    if engine.profile is not None:
        tables["profile"] = rounds * size * 8 * 10
    return tables, by_rounds, by_evaluations, grown


def _checkpoints(engine: SetUp, cohort: float, seen: int) -> tuple[int, int, int, int]:
    """One checkpoint's bytes (at the run's last), how many the folder keeps at the end and at most at once, and
    how many ``checkpoint_every`` writes."""
    cfg, protocol = engine.cfg, engine.protocol
    written = cfg.rounds // cfg.checkpoint_every if cfg.checkpoint_every else 0
    at_once = min(cfg.checkpoint_keep + 1, written + 1)  # one more: being written, or a stop's, or by the clock
    server = _state_file(engine.server)
    if engine.rounds.checkpointed is not None:
        server += _state_file(engine.rounds.checkpointed)
    per_client = dict(protocol.client_state())
    plan, setup = protocol.train_plan(1), protocol.setup_plan()
    for m in plan:  # error feedback keeps each client's residual of a compressed upload
        if isinstance(m, Message) and m.direction == "up" and engine.parts.wire.error_feedback(m):
            per_client[f"wire_residual:{m.name}"] = m.numel * np.dtype(m.dtype).itemsize
    if not per_client:
        trained = 0.0
    elif setup and protocol.setup_includes_unseen:
        trained = float(engine.layout.num_clients)
    elif setup or any(step.everyone for step in plan):
        trained = float(seen)
    else:  # a cohort sampled uniformly each round: the clients that have trained by the last round
        trained = seen * (1 - (1 - min(cohort / max(seen, 1), 1.0)) ** cfg.rounds)
    workers = max(engine.size - 1, 1)
    client_files = workers * SHARD_FILE + trained * (CLIENT_GROUP + sum(per_client.values())
                                                     + len(per_client) * STATE_OBJECT)
    return int(server + client_files), min(cfg.checkpoint_keep, written), at_once, written


def _on_disk(path: Path) -> int:
    """The bytes a results file and its checkpoint folder hold now (what a resumed run continues, or what a run
    with ``--overwrite`` replaces)."""
    total = path.stat().st_size if path.is_file() else 0
    folder = shard_dir(path)
    if folder.is_dir():
        total += sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
    return total


def check_room(engine: SetUp) -> None:
    """Rank 0, once set-up is done and before round 1: refuse the run (:class:`ConfigError`: one line, exit code
    2) when the file system of its results file lacks room for what it will write (its :class:`Footprint` at its
    peak, less what is there already: a resumed run's file and checkpoints, or the run ``--overwrite`` replaces),
    with the margin every write is checked with (:func:`~mpifl.results.space.ensure_room`; ``MPIFL_SPACE_CHECK=off``
    skips it). ``--force-start`` skips this check, not the one before each write."""
    footprint = estimate(engine)
    path, start = engine.output, engine.start_round
    need = footprint.peak
    there = _on_disk(path) if engine.resume or engine.overwrite else 0
    what = (f"the rest of the run (rounds {start} to {engine.cfg.rounds})" if engine.resume else
            "the run (its results file and checkpoints)")
    try:
        ensure_room(path, max(need - there, 0), what)
    except StorageFull as exc:
        many = footprint.at_once != 1
        parts = (f"a results file of {readable_bytes(footprint.results)} and {footprint.at_once} checkpoint"
                 f"{'s' * many} of {readable_bytes(footprint.checkpoint)} at once")
        if there:
            parts += f", less the {readable_bytes(there)} there already"
        shrink = f"{', '.join(footprint.shrink)} would shrink it, or " if footprint.shrink else ""
        raise ConfigError(f"{path}: {exc.strerror} (estimated: {parts}, with the margin every write is checked "
                          f"with); {shrink}give an --out on another file system; --force-start starts anyway (each "
                          "write is still checked)") from None
