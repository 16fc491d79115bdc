"""The round loop every rank runs: walk the algorithm's plan, move its messages, account, evaluate, record."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import platform
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mpifl import __version__
from mpifl.algorithms.base import ClientAlgorithm, RunContext, ServerAlgorithm
from mpifl.algorithms.state import ClientState
from mpifl.checkpoint import client_state_blob, load_client_states, load_state_blob, read_checkpoint, state_blob
from mpifl.comm import LocalCompute, Message, Placement, Step, Transport
from mpifl.comm.network import NetworkModel
from mpifl.config import RunConfig, config_to_dict
from mpifl.data import FederatedLayout, build_federated_dataset
from mpifl.models.norm import normalized_with
from mpifl.registry import get_algorithm
from mpifl.results import Table, write_atomically
from mpifl.runtime.faults import FaultModel, selection_size
from mpifl.runtime.metrics import summarize
from mpifl.runtime.sampling import sample_clients
from mpifl.runtime.store import ClientStore
from mpifl.schema import ConfigError
from mpifl.training.device import rank_device
from mpifl.training.sgd import EVAL_FIELDS, evaluate

TELEMETRY_FIELDS = ("compute_s", "train_loss")



@dataclass
class RankClock:
    """Where this rank's time went (seconds), in parts that do not overlap; waiting for MPI and packing
    its buffers are the transport's. The round loop's wall time minus all parts is bookkeeping."""

    compute: float = 0.0  # clients' local work: training, descriptors, gradients, packing their rows
    data: float = 0.0  # materializing clients' data (visitors under dynamic placement, generated clients)
    server: float = 0.0  # the server algorithm's steps
    evaluation: float = 0.0  # models evaluated on clients' test data
    serialization: float = 0.0  # checkpoint state to flat bytes
    io: float = 0.0  # writing the results file
    setup: float = 0.0  # building the layout, loading this rank's clients, restoring a checkpoint
    loop_wall: float = 0.0
    loop_cpu: float = 0.0


# The per-rank time breakdown (results: /ranks totals, /profile per round with --profile), as <part>_seconds.
TIME_PARTS = ("compute", "data", "server", "eval", "mpi", "serialization", "io")


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far."""
    import resource

    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux reports KiB
    return int(kib) * 1024


def check_run(cfg: RunConfig, layout: FederatedLayout) -> RunContext:
    """What can only be checked once the data layout is known (shared by ``run`` and ``validate``):
    enough seen clients, and an algorithm whose protocol (message sizes, model) fits the data."""
    seen = int((~layout.unseen).sum())
    if cfg.clients_per_round > seen:
        raise ConfigError(f"clients_per_round: {cfg.clients_per_round} exceeds the {seen} seen clients of the data")
    selected = selection_size(cfg.clients_per_round, cfg.faults)
    if selected > seen:
        raise ConfigError(f"faults.over_selection: selecting {selected} clients per round exceeds the {seen} seen "
                          "clients of the data")
    if cfg.client.augment != "none" and len(layout.input_shape) != 3:
        raise ConfigError(f"client.augment: {cfg.client.augment!r} crops and flips images; the data's samples have "
                          f"shape {layout.input_shape}")
    entry = get_algorithm(cfg.algorithm)
    if cfg.placement == "dynamic" and not entry.client.stateless:
        raise ConfigError(f"placement: 'dynamic' moves clients between workers every round, but {cfg.algorithm} "
                          "keeps per-client state on its worker; use 'static' or 'auto'")
    ctx = RunContext(cfg, layout)
    entry.server.protocol_type(ctx)
    return ctx


class Engine:
    def __init__(self, cfg: RunConfig, comm, output: str | Path, resume: bool = False,  # noqa: ANN001 - a Comm
                 profile: bool = False):
        self.cfg = cfg
        self.profile = profile
        self.profile_rows: list[np.ndarray] = []  # per round: round, wall seconds, then TIME_PARTS
        self.comm = comm
        self.output = Path(output)
        self.resume = resume
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.clock = RankClock()
        self.start_round = 1
        self.checkpoint_blobs: dict[str, np.ndarray] = {}
        self.checkpoint_round = 0
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpifl-results")
        self.pending_write: Future | None = None

    # ----------------------------------------------------------------- set-up
    def setup(self) -> None:
        """Everything that can fail on bad input happens here, before the first collective of training."""
        torch.set_num_threads(1)  # a client's arithmetic must not depend on its rank's thread count
        setup_start = time.perf_counter()
        cfg = self.cfg
        self.device = rank_device(cfg.device, self.comm)  # first: a collective (unless cpu), then may raise
        dataset = build_federated_dataset(cfg.data, cfg.seed)
        self.layout = layout = dataset.layout
        ctx = dataclasses.replace(check_run(cfg, layout), device=self.device)  # where this rank's clients compute
        self.seen = np.flatnonzero(~layout.unseen)
        self.placement = Placement.balanced(layout.train_sizes, self.size)
        self.transport = Transport(self.comm, self.placement)
        entry = get_algorithm(cfg.algorithm)
        wanted = cfg.placement == "dynamic" or cfg.placement == "auto" and dataset.cheap_clients
        self.dynamic = self.size > 2 and entry.client.stateless and wanted
        self.server: ServerAlgorithm | None = entry.server(ctx) if self.rank == 0 else None
        self.client: ClientAlgorithm | None = None
        if self.size == 1 or self.rank > 0:
            self.store = ClientStore(dataset, self.placement.clients_of(self.rank), self.device)
            self.client = entry.client(ctx, self.store, ClientState())
        self.protocol = (self.server or self.client).protocol
        self.network = NetworkModel.from_config(cfg.network, layout.num_clients, cfg.seed)
        self.faults = FaultModel(cfg.faults, self.network, cfg.seed)
        self.samples_per_round = self.protocol.samples_per_round()
        kinds = len(self.protocol.eval_kinds)
        self.telemetry_msg = Message("telemetry", "up", len(TELEMETRY_FIELDS), "float64", logical=False)
        # every model kind on the test split, and on the validation split where the data has one (model selection)
        self.eval_splits = ("test", "val") if cfg.data.val_fraction > 0 else ("test",)
        fields = kinds * len(self.eval_splits) * len(EVAL_FIELDS)
        self.eval_msg = Message("eval_metrics", "up", fields, "float64", logical=False)
        self.rounds_table, self.eval_table = Table(), Table()
        self.final_rows: np.ndarray | None = None
        self.started = time.time()
        if self.resume:
            self._restore()
        self.clock.setup = time.perf_counter() - setup_start

    def _fault_injection(self, round_: int) -> None:
        """Resilience drills: ``MPIFL_INJECT_FAULT=RANK:ROUND`` makes that rank raise at that round."""
        spec = os.environ.get("MPIFL_INJECT_FAULT")
        if spec and spec == f"{self.rank}:{round_}":
            raise RuntimeError(f"fault injected by MPIFL_INJECT_FAULT={spec}")

    # ----------------------------------------------------------------- rounds
    def run(self, progress: bool = True) -> None:
        if self.start_round == 1:
            self.run_setup()
        wall, cpu, self.parts_at_start = time.perf_counter(), time.process_time(), self._time_parts()
        every = self.cfg.checkpoint_every
        for round_ in range(self.start_round, self.cfg.rounds + 1):
            if self.profile:
                round_start, parts_before = time.perf_counter(), self._time_parts()
            self._fault_injection(round_)
            self.train_round(round_)
            evaluation = round_ % self.cfg.eval_every == 0 or round_ == self.cfg.rounds
            checkpoint = bool(every) and round_ % every == 0
            if evaluation:
                self.evaluate(round_)
            if checkpoint:
                self._take_checkpoint(round_)
            if self.server is not None and (evaluation or checkpoint):
                if evaluation and progress:
                    self._print_progress(round_)
                self.write_results(status="running")
            if self.profile:
                spent = self._time_parts() - parts_before
                self.profile_rows.append(np.concatenate(([round_, time.perf_counter() - round_start], spent)))
        self.clock.loop_wall = time.perf_counter() - wall
        self.clock.loop_cpu = time.process_time() - cpu
        self._finish()

    def _time_parts(self) -> np.ndarray:
        """This rank's cumulative seconds in each of :data:`TIME_PARTS`."""
        c, t = self.clock, self.transport
        return np.array([c.compute, c.data, c.server, c.evaluation, t.physical.total_seconds,
                         c.serialization + t.pack_seconds, c.io])

    def run_setup(self) -> None:
        """The protocol's one-time set-up plan, as round 0 with every seen client (ledger stage "setup")."""
        plan = self.protocol.setup_plan()
        if plan:
            everyone = np.arange(self.layout.num_clients) if self.protocol.setup_includes_unseen else self.seen
            self.run_plan(0, "setup", plan, everyone)

    def train_round(self, round_: int) -> None:
        start = time.perf_counter()
        server_before = self.clock.server
        plan = self.protocol.train_plan(round_)
        logical = [m for m in plan if isinstance(m, Message) and m.logical]
        down = [m for m in logical if m.direction == "down"]
        up = [m for m in logical if m.direction == "up"]
        wanted = self.cfg.clients_per_round
        sampled = sample_clients(self.cfg.seed, round_, self.seen, self.faults.selection_size(wanted))
        clients = self.faults.participants(round_, sampled, wanted, sum(m.nbytes for m in down),
                                           sum(m.nbytes for m in up), len(logical), self.samples_per_round)
        self.rejected = 0
        placement = self.placement
        if self.dynamic:
            placement = placement.for_round(clients, self.samples_per_round[clients])
        with self.transport.placed(placement):
            if self.client is not None:
                self.store.visit(self.transport.local_clients(clients))
            if self.protocol.turns:  # one client after another, each seeing the server state the last one left
                walks = [self.run_plan(round_, "train", plan, clients[i : i + 1]) for i in range(len(clients))]
                compute_s, local, clients = (np.concatenate(parts) for parts in zip(*walks)) if walks else \
                    (np.zeros(0), clients, clients)
            else:
                everyone = any(step.everyone for step in plan)  # every seen client that is up this round
                audience = np.setdiff1d(self.seen, np.setdiff1d(sampled, clients)) if everyone else None
                compute_s, local, clients = self.run_plan(round_, "train", plan, clients, audience)
            if self.client is not None:
                self.client.end_round()
                self.store.end_visits()
            rows = np.empty((len(local), len(TELEMETRY_FIELDS)))
            rows[:, 0] = compute_s
            rows[:, 1] = [self.client.round_losses.pop(int(c), np.nan) for c in local]
            telemetry = self.transport.up(round_, "train", self.telemetry_msg, rows, clients)
        if self.server is None:
            return
        server_s = self.clock.server - server_before
        per_client_s = self.network.client_seconds(
            clients,
            np.full(len(clients), sum(m.nbytes for m in down)),
            len(down),
            np.full(len(clients), sum(m.nbytes for m in up)),
            len(up),
            telemetry[:, 0],
        )
        totals = self.transport.ledger.round_totals(round_)
        clients_s = per_client_s.sum() if self.protocol.turns else per_client_s.max(initial=0.0)
        self.rounds_table.append({
            "round": round_,
            "sim_time_s": server_s + float(clients_s),
            "wall_time_s": time.perf_counter() - start,
            "server_time_s": server_s,
            "client_compute_time_s": float(telemetry[:, 0].sum()),  # ÷ workers: the round's ideal time
            "train_loss": float(np.nanmean(telemetry[:, 1])) if np.isfinite(telemetry[:, 1]).any() else np.nan,
            "logical_up_bytes": totals["up"],
            "logical_down_bytes": totals["down"],
            "participants": len(clients),
            "load_imbalance": self._load_imbalance(placement, clients),
            "rejected_updates": self.rejected,
            **self.server.round_metrics(),
        })

    def _load_imbalance(self, placement: Placement, clients: np.ndarray) -> float:
        """The busiest worker's planned samples over the mean worker's (1 = perfectly balanced round)."""
        work = np.bincount(placement.owner[clients], self.samples_per_round[clients], minlength=self.size)
        work = work[1:] if self.size > 1 else work
        return float(work.max() / work.mean()) if work.sum() else 1.0

    def run_plan(self, round_: int, stage: str, plan: tuple[Step, ...], clients: np.ndarray,
                 audience: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Move every step of ``plan`` among ``clients`` (its ``everyone`` steps among ``audience``, a superset).
        Returns this rank's local clients with their compute seconds, and the clients still taking part at
        the end: training drops a client whose update is not finite, and the plan ends where no client is
        left (an algorithm never steps on nothing). The state edits of the clients still in are then
        committed (of the whole audience), those of dropped clients discarded."""
        audience = clients if audience is None else audience
        local = self.transport.local_clients(clients) if self.client else clients[:0]
        reached = self.transport.local_clients(audience) if self.client else clients[:0]
        started = reached
        seconds = np.zeros(len(local))
        if len(reached):
            start = time.perf_counter()
            self.store.stage(reached)
            self.clock.data += time.perf_counter() - start
        corrupt = self.faults.corrupted(round_, local) if stage == "train" else np.zeros(len(local), dtype=bool)
        for step in plan:
            if len(clients) == 0:
                break
            targets, hosted = (audience, reached) if step.everyone else (clients, local)
            mine = np.searchsorted(hosted, local)  # where each local participant sits among ``hosted``
            if isinstance(step, LocalCompute):
                if len(hosted):
                    start = time.perf_counter()
                    seconds += self.client.compute_clients(round_, hosted)[mine]
                    self._charge_compute(start)
            elif step.direction == "down":
                payload = self._timed_server(self.server.payload, step, round_, targets) if self.server else None
                rows = self.transport.down(round_, stage, step, payload, targets)
                spent = np.array([self._timed_client(self.client.receive, step, round_, int(c), rows[i])
                                  for i, c in enumerate(hosted)])
                seconds += spent[mine] if len(spent) else 0.0
            else:
                rows = np.empty((len(local), step.numel), dtype=step.dtype)
                for i, client in enumerate(local):
                    start = time.perf_counter()
                    rows[i] = self.client.send(step, round_, int(client))
                    seconds[i] += self._charge_compute(start)
                if rows.dtype.kind == "f":
                    rows[corrupt] = np.nan  # faults.corrupt: these clients' uploads arrive broken
                gathered = self.transport.up(round_, stage, step, rows, clients)
                accepted = self._screen(round_, stage, step, clients, gathered) if self.server else None
                if accepted is not None and accepted.any():
                    self._timed_server(self.server.consume, step, round_, clients[accepted], gathered[accepted])
                if stage == "train":  # every rank learns the verdict: it decides whose state edits survive
                    accepted = self._share_acceptance(round_, accepted, len(clients))
                    keep = np.isin(local, clients[accepted])
                    audience = np.setdiff1d(audience, clients[~accepted])
                    reached = reached[np.isin(reached, audience)]
                    clients, local, seconds, corrupt = clients[accepted], local[keep], seconds[keep], corrupt[keep]
        if self.client is not None:
            self.client.state.commit(reached)
            self.client.state.discard(np.setdiff1d(started, reached))
        return seconds, local, clients

    def _screen(self, round_: int, stage: str, step: Message, clients: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Which clients' rows the server accepts: a training update with NaN/Inf never reaches the
        algorithm (``faults.nonfinite: skip``) or stops the job (``abort``)."""
        accepted = np.ones(len(clients), dtype=bool)
        if stage == "train" and rows.dtype.kind == "f":
            accepted = np.isfinite(rows).all(axis=1)
            bad = clients[~accepted]
            if len(bad) and self.cfg.faults.nonfinite == "abort":
                raise FloatingPointError(f"round {round_}: {step.name} of client(s) {bad.tolist()} is not finite")
            if len(bad):
                self.rejected += len(bad)
                print(f"mpifl: warning: round {round_}: rejected non-finite {step.name} of client(s) "
                      f"{bad.tolist()}", file=sys.stderr, flush=True)
        return accepted

    def _share_acceptance(self, round_: int, accepted: np.ndarray | None, count: int) -> np.ndarray:
        """Tell every rank which clients go on to the plan's next steps (simulator bookkeeping)."""
        msg = Message("accepted", "down", count, "uint8", broadcast=True, logical=False)
        payload = accepted.astype(np.uint8) if self.server else None
        return self.transport.broadcast(round_, msg, payload).astype(bool)

    def _charge_compute(self, start: float) -> float:
        elapsed = time.perf_counter() - start
        self.clock.compute += elapsed
        return elapsed

    def _timed_client(self, fn, *args) -> float:  # noqa: ANN001
        start = time.perf_counter()
        fn(*args)
        return self._charge_compute(start)

    def _timed_server(self, fn, *args):  # noqa: ANN001, ANN202
        start = time.perf_counter()
        result = fn(*args)
        self.clock.server += time.perf_counter() - start
        return result

    # ------------------------------------------------------------- evaluation
    def evaluate(self, round_: int) -> None:
        """Evaluate every client, ``eval_chunk`` clients at a time (0: all at once), so the server's
        per-client evaluation state (e.g. one personal model per client) stays bounded."""
        unseen = np.flatnonzero(self.layout.unseen)
        for chunk in self._chunks(unseen):
            self.run_plan(round_, "eval", self.protocol.newcomer_plan(), chunk)
        prelude = self.protocol.eval_prelude()
        for chunk in self._chunks(self.seen) if prelude else ():
            self.run_plan(round_, "eval", prelude, chunk)
        blocks = [self._evaluate_clients(round_, chunk) for chunk in self._chunks(np.arange(self.layout.num_clients))]
        if self.client is not None:
            self.client.end_round()
        if self.server is None:
            return
        self.final_rows = gathered = np.concatenate(blocks)
        row: dict[str, float] = {"round": round_, "cum_logical_bytes": float(self.transport.ledger.train_bytes)}
        regression = self.layout.task == "regression"
        for (kind, split), block in self._eval_blocks(gathered):
            prefix = "" if split == "test" else f"{split}_"
            for group, mask in (("seen", ~self.layout.unseen), ("unseen", self.layout.unseen)):
                for name, value in summarize(block[mask], regression).items():
                    row[f"{kind}.{group}.{prefix}{name}"] = value
        row.update(self.server.eval_metrics())
        self.server.end_evaluation()
        self.eval_table.append(row)

    def _eval_blocks(self, rows: np.ndarray) -> list[tuple[tuple[str, str], np.ndarray]]:
        """The :data:`EVAL_FIELDS` columns of each (model kind, data split) in evaluation rows."""
        pairs = [(kind, split) for kind in self.protocol.eval_kinds for split in self.eval_splits]
        width = len(EVAL_FIELDS)
        return [(pair, rows[:, k * width : (k + 1) * width]) for k, pair in enumerate(pairs)]

    def _chunks(self, clients: np.ndarray) -> list[np.ndarray]:
        size = self.cfg.eval_chunk or max(len(clients), 1)
        return [clients[i : i + size] for i in range(0, len(clients), size)]

    def _evaluate_clients(self, round_: int, clients: np.ndarray) -> np.ndarray | None:
        """Walk the eval plan among ``clients``, evaluate the local ones, gather their metric rows."""
        self.run_plan(round_, "eval", self.protocol.eval_plan(), clients)
        local = self.transport.local_clients(clients) if self.client else clients[:0]
        kinds = self.protocol.eval_kinds
        rows = np.zeros((len(local), self.eval_msg.numel))
        start = time.perf_counter()
        width = len(EVAL_FIELDS)
        for i, client in enumerate(local):
            data = self.client.data[int(client)]
            for j, kind in enumerate(kinds):
                model = self.client.eval_model(int(client), kind)
                stats = self.client.eval_norm_statistics(int(client), kind, model)
                with normalized_with(model, stats) if stats is not None else contextlib.nullcontext():
                    for s, split in enumerate(self.eval_splits):
                        at = (j * len(self.eval_splits) + s) * width
                        x, y = getattr(data, f"x_{split}"), getattr(data, f"y_{split}")
                        rows[i, at : at + width] = evaluate(model, x, y, self.client.loss_fn)
        self.clock.evaluation += time.perf_counter() - start
        return self.transport.up(round_, "eval", self.eval_msg, rows, clients)

    def _print_progress(self, round_: int) -> None:
        last = self.eval_table.arrays()
        kind = self.protocol.eval_kinds[0]
        rounds = self.rounds_table.arrays()
        parts = [f"round {round_:>{len(str(self.cfg.rounds))}}/{self.cfg.rounds}"]
        for group in ("seen", "unseen"):
            key = f"{kind}.{group}.acc_pooled"
            if key in last:
                parts.append(f"{group} acc {last[key][-1]:.4f} (mean {last[f'{kind}.{group}.acc_mean'][-1]:.4f})")
        parts.append(f"loss {rounds['train_loss'][-1]:.4f}")
        parts.append(f"logical {last['cum_logical_bytes'][-1] / 1e6:.2f} MB")
        parts.append(f"{np.median(rounds['wall_time_s']):.3f} s/round")
        print(" | ".join(parts), flush=True)

    # ---------------------------------------------------------------- results
    # ------------------------------------------------------------ checkpoints
    def _take_checkpoint(self, round_: int) -> None:
        """Every rank serializes its state (server, or its clients) and rank 0 keeps the blobs, which go
        into every results file written from now on. A collective on every rank, at a round boundary."""
        start = time.perf_counter()
        mine = client_state_blob(self.client.state) if self.client is not None else np.zeros(0, dtype=np.uint8)
        self.clock.serialization += time.perf_counter() - start
        gathered = self.transport.gather_bytes(round_, "checkpoint", mine)
        blobs = {f"worker_{r}": blob for r, blob in enumerate(gathered) if self.size == 1 or r > 0}
        if self.server is not None:
            start = time.perf_counter()
            self.checkpoint_blobs = {"server": state_blob(self.server), **blobs}
            self.checkpoint_round = round_
            self.clock.serialization += time.perf_counter() - start

    def _restore(self) -> None:
        """Continue from the checkpoint in the results file: server state on rank 0, each worker's clients
        (wherever they lived before, so the rank count may change), tables up to the checkpoint round."""
        import yaml

        saved = read_checkpoint(self.output)
        mine, given = yaml.safe_load(saved.attrs["config"]), config_to_dict(self.cfg)
        for volatile in ("output", "rounds"):
            mine.pop(volatile, None)
            given.pop(volatile, None)
        if mine != given:
            changed = sorted(k for k in set(mine) | set(given) if mine.get(k) != given.get(k))
            raise ConfigError(f"--resume: the config differs from the one in {self.output} (in: {', '.join(changed)})")
        round_ = int(saved.table_attrs["checkpoint"]["round"])
        if round_ >= self.cfg.rounds:
            raise ConfigError(f"--resume: {self.output} is already at round {round_} of {self.cfg.rounds}")
        blobs = saved.tables["checkpoint"]
        if self.server is not None:
            load_state_blob(blobs["server"], self.server)
            self.checkpoint_blobs, self.checkpoint_round = dict(blobs), round_
        if self.client is not None:
            workers = sorted((k for k in blobs if k.startswith("worker_")), key=lambda k: int(k.split("_")[1]))
            load_client_states([blobs[k] for k in workers], self.client.state, self.placement.clients_of(self.rank))
        self.start_round = round_ + 1
        if self.server is None:  # the tables and the ledger are the server's alone
            return
        for table, target in (("rounds", self.rounds_table), ("eval", self.eval_table)):
            columns = saved.table(table)
            keep = columns["round"] <= round_ if columns else []
            target.extend({k: v[keep] for k, v in columns.items()})
        ledger = saved.table("ledger")
        keep = ledger["round"] <= round_
        attrs = saved.table_attrs["ledger"]
        self.transport.ledger.load({k: v[keep] for k, v in ledger.items()}, attrs["message_names"], attrs["directions"])

    def _finish(self) -> None:
        """Collect every rank's time breakdown and MPI totals, and with ``--profile`` its per-round rows
        (once, at the end: small pickled objects are fine)."""
        c = self.clock
        mine = {"rank": self.rank, "clients": len(self.placement.clients_of(self.rank)),
                **(self.client.rank_stats() if self.client is not None else {}),
                "mpi_bytes": self.transport.physical.total_bytes,
                **{f"{part}_seconds": t for part, t in zip(TIME_PARTS, self._time_parts() - self.parts_at_start)},
                "loop_wall_seconds": c.loop_wall, "loop_cpu_seconds": c.loop_cpu, "setup_wall_seconds": c.setup,
                "peak_rss_bytes": peak_rss_bytes()}
        rows = np.array(self.profile_rows).reshape(-1, 2 + len(TIME_PARTS))
        rows = np.hstack((rows, np.full((len(rows), 1), self.rank)))
        per_rank = self.comm.gather((mine, rows), root=0) if self.size > 1 else [(mine, rows)]
        if self.server is not None:
            names = dict.fromkeys(name for r in per_rank for name in r[0])  # the server has no client counters
            ranks = {name: np.array([r[0].get(name, 0) for r in per_rank]) for name in names}
            profile = None
            if self.profile:
                rows = np.concatenate([r[1] for r in per_rank])
                names = ("round", "wall_seconds", *(f"{part}_seconds" for part in TIME_PARTS), "rank")
                profile = {name: rows[:, j] for j, name in enumerate(names)}
                for name in ("round", "rank"):
                    profile[name] = profile[name].astype(np.int64)
            self.write_results(status="completed", ranks=ranks, profile=profile, wait=True)

    def write_results(self, status: str, ranks: dict[str, np.ndarray] | None = None,
                      profile: dict[str, np.ndarray] | None = None, wait: bool = False) -> None:
        """Snapshot the results and write them from a background thread (one write at a time, in order),
        so the next round's messages go out while rank 0 writes; ``wait``: return once it is on disk."""
        start = time.perf_counter()
        ledger = self.transport.ledger
        physical = self.transport.physical.rows
        tables = {
            "rounds": self.rounds_table.arrays(),
            "eval": self.eval_table.arrays(),
            "ledger": ledger.columns(),
            "physical": {
                "round": np.array([r[0] for r in physical], dtype=np.int64),
                "message": np.array([r[1] for r in physical], dtype="S"),
                "op": np.array([r[2] for r in physical], dtype="S"),
                "bytes": np.array([r[3] for r in physical], dtype=np.int64),
                "seconds": np.array([r[4] for r in physical], dtype=np.float64),
            },
            "clients": self._client_table(),
        }
        table_attrs = {"ledger": {"message_names": ledger.message_names, "directions": ledger.directions,
                                  "stages": ["train", "eval", "setup"]}}
        if self.checkpoint_blobs:
            tables["checkpoint"] = self.checkpoint_blobs
            table_attrs["checkpoint"] = {"round": self.checkpoint_round}
        if ranks is not None:
            tables["ranks"] = ranks
            tables["model"] = self.server.final_state()
        if profile is not None:
            tables["profile"] = profile
        attrs = {**self._run_attrs, "status": status, "rounds_completed": int(self.rounds_table.length),
                 "wall_time_s": time.time() - self.started}
        self._await_write()
        self.pending_write = self.writer.submit(write_atomically, self.output, attrs, tables, table_attrs)
        if wait:
            self._await_write()
            self.writer.shutdown()
        self.clock.io += time.perf_counter() - start

    @functools.cached_property
    def _run_attrs(self) -> dict[str, object]:
        """The results file's attributes that do not change during a run (worked out once)."""
        import mpi4py
        import yaml
        from mpi4py import MPI

        return {
            "config": yaml.safe_dump(config_to_dict(self.cfg), sort_keys=False),
            "algorithm": self.cfg.algorithm,
            "world_size": self.size,
            "eval_kinds": list(self.protocol.eval_kinds),
            "task": self.layout.task,
            "mpifl_version": __version__,
            "python_version": sys.version.split()[0],
            "torch_version": str(torch.__version__),
            "numpy_version": np.__version__,
            "mpi4py_version": mpi4py.__version__,
            "mpi_library": MPI.Get_library_version().replace("\x00", "").splitlines()[0].strip(),
            "hostname": platform.node(),
        }

    def settle(self) -> None:
        """After a failure on this rank: let the results write in flight finish (best effort), so the
        file keeps every completed evaluation."""
        with contextlib.suppress(Exception):
            self._await_write()
        self.writer.shutdown()

    def _await_write(self) -> None:
        """Finish the write in flight, raising its error here if it failed."""
        if self.pending_write is not None:
            self.pending_write.result()
            self.pending_write = None

    def _client_table(self) -> dict[str, np.ndarray]:
        layout = self.layout
        table = {
            "client": np.arange(layout.num_clients),
            "unseen": layout.unseen.astype(np.int8),
            "train_size": layout.train_sizes,
            "owner": self.placement.owner,
        }
        if self.final_rows is not None:
            for (kind, split), block in self._eval_blocks(self.final_rows):
                if split != "test":
                    continue
                n = np.maximum(block[:, 0], 1)
                table[f"{kind}.n_test"] = block[:, 0]
                table[f"{kind}.loss"] = block[:, 2] / n
                if layout.task != "regression":
                    table[f"{kind}.acc"] = block[:, 1] / n
        return table
