"""Exporting results files to what people already track runs with: CSV files, TensorBoard and MLflow.

A results file becomes one run; a directory of them (a sweep) one run per file. Every metric carries the
round as its step and the real time its round ended as its wall time (the rounds table's ``unix_time_s``),
and the run's config, flattened, becomes its hyper-parameters (TensorBoard) or params (MLflow), so runs
of a sweep can be compared by what they varied. TensorBoard and MLflow are optional extras
(``pip install 'mpifl[tensorboard]'``, ``'mpifl[mlflow]'``); CSV needs nothing.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mpifl.extras import optional_import
from mpifl.results import Results, flatten, read_results
from mpifl.results.guard import refuse_existing
from mpifl.results.space import NAMED_TARGET_ERRNOS, storage_errno, written_whole
from mpifl.results.writing import check_names
from mpifl.schema import ConfigError

# MLflow's limits on one log_batch call (params; metrics)
_MLFLOW_PARAMS_PER_BATCH, _MLFLOW_METRICS_PER_BATCH = 100, 1000


@dataclass(frozen=True)
class Series:
    """One scalar column of the rounds or eval table, row by row: round, value, Unix time of the round's end."""

    tag: str
    steps: np.ndarray
    values: np.ndarray
    times: np.ndarray

    def finite(self) -> Iterator[tuple[int, float, float]]:
        for step, value, when in zip(self.steps, self.values, self.times):
            if np.isfinite(value):
                yield int(step), float(value), float(when)


@dataclass(frozen=True)
class Run:
    """A results file read back for export."""

    path: Path
    results: Results

    @property
    def name(self) -> str:
        return self.path.stem

    def round_times(self) -> np.ndarray:
        """The Unix time each round ended. Files written before mpifl recorded it get an estimate: back from
        the file's last write by each later round's wall time."""
        rounds = self.results.table("rounds")
        wall = rounds.get("wall_time_s", np.zeros(0))
        estimate = self.path.stat().st_mtime - (wall.sum() - np.cumsum(wall))
        recorded = rounds.get("unix_time_s", np.full(len(wall), np.nan))
        return np.where(np.isfinite(recorded), recorded, estimate)

    def span(self) -> tuple[float, float]:
        """When the run's first round started and its last round ended (Unix seconds)."""
        times = self.round_times()
        if not len(times):
            return (self.path.stat().st_mtime,) * 2
        return float(times[0] - self.results.table("rounds")["wall_time_s"][0]), float(times[-1])

    def series(self) -> list[Series]:
        """Every numeric column of the rounds and eval tables; an evaluation's time is that of the round it
        evaluated (the round's end)."""
        when = dict(zip(self.results.table("rounds").get("round", np.zeros(0)).astype(int).tolist(),
                        self.round_times()))
        start = self.span()[0]
        out = []
        for table in ("rounds", "eval"):
            columns = self.results.table(table)
            if not columns:
                continue
            steps = columns["round"].astype(np.int64)
            times = np.array([when.get(int(s), start) for s in steps])
            out += [Series(f"{table}/{name}", steps, values, times) for name, values in columns.items()
                    if name not in ("round", "unix_time_s") and values.dtype.kind in "fiu"]
        return out

    def hyperparameters(self) -> dict[str, bool | int | float | str]:
        """The flattened config; values other than numbers, booleans and strings as JSON (``[4, 8]``, ``null``)."""
        return {key: value if isinstance(value, (bool, int, float, str)) else json.dumps(value)
                for key, value in flatten(self.results.config).items()}


def results_files(source: str) -> list[Path]:
    """A results file, or every ``*.h5`` in a directory (a sweep), in name order."""
    path = Path(source)
    if not path.is_dir():
        return [path]
    files = sorted(path.glob("*.h5"))
    if not files:
        raise ConfigError(f"{source}: no .h5 results files to export")
    return files


CSV_TABLES = ("rounds", "eval", "clients")
TENSORBOARD_EVENTS = "events.out.tfevents.*"  # TensorBoard's event files: a new one each time a writer opens


def csv_files(run: Run, directory: Path) -> dict[str, Path]:
    """The CSV file each of the run's tables is written to (the tables it has)."""
    return {table: directory / f"{table}.csv" for table in CSV_TABLES if run.results.table(table)}


def is_exported_csv(path: Path) -> bool:
    """Whether ``path`` looks like a table an export wrote: its header names the table's key column, ``round`` or
    ``client`` (the only CSV ``export --overwrite`` replaces)."""
    with open(path, "rb") as f:
        header = {cell.strip() for cell in f.readline(1 << 16).split(b",")}
    return bool(header & {b"round", b"client"})


def write_csv(run: Run, directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for table, path in csv_files(run, directory).items():
        columns = run.results.table(table)
        names = list(columns)
        with written_whole(path, "the CSV export") as tmp, open(tmp, "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(names)
            writer.writerows(zip(*(columns[n].tolist() for n in names)))
        written.append(path)
    return written


def write_tensorboard(run: Run, directory: Path) -> Path:
    """One event file in ``directory``: every series (step = round, real wall times) and the hyper-parameters
    (TensorBoard's HPARAMS tab, with the eval series as its metrics)."""
    tensorboard = optional_import("torch.utils.tensorboard", "tensorboard", "--tensorboard")
    from torch.utils.tensorboard.summary import hparams

    series = run.series()
    start, end = run.span()
    metrics = {s.tag: 0.0 for s in series if s.tag.startswith("eval/")}  # names only: TensorBoard reads the values
    experiment, session_start, session_end = hparams(run.hyperparameters(), metrics)
    for earlier in directory.glob(TENSORBOARD_EVENTS):  # replaced (export refused them without --overwrite)
        earlier.unlink()
    with tensorboard.SummaryWriter(log_dir=str(directory)) as writer:
        writer.file_writer.add_summary(experiment, walltime=start)
        writer.file_writer.add_summary(session_start, walltime=start)
        for s in series:
            for step, value, when in s.finite():
                writer.add_scalar(s.tag, value, step, walltime=when)
        writer.file_writer.add_summary(session_end, walltime=end)
    return directory


class MlflowTarget:
    """An MLflow experiment to log runs into: opened (and the runs exported into it before found) before anything
    is written, so that a refusal leaves every output as it was."""

    def __init__(self, target: str, experiment: str):
        self.mlflow = optional_import("mlflow", "mlflow", "--mlflow")
        self.target, self.experiment = target, experiment
        if "://" in target:
            self.uri = target
        else:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks file stores to opt in
            Path(target).mkdir(parents=True, exist_ok=True)
            self.uri = Path(target).resolve().as_uri()
        with self.errors():
            self.client = self.mlflow.MlflowClient(tracking_uri=self.uri)
            found = self.client.get_experiment_by_name(experiment)
            self.earlier = _runs_by_file(self.client, found.experiment_id) if found is not None else {}

    @contextlib.contextmanager
    def errors(self) -> Iterator[None]:
        try:
            yield
        except self.mlflow.exceptions.MlflowException as exc:  # an unusable store or URI: the user's input
            raise ConfigError(f"--mlflow {self.target}: {exc.message.strip()}") from None

    def refuse_earlier(self, runs: list[Run], overwrite: bool) -> None:
        """Refuse to replace the runs exported from these files before, unless ``overwrite``."""
        again = [run.path for run in runs if str(run.path.resolve()) in self.earlier]
        if again and not overwrite:
            more = f" (and {len(again) - 1} more)" if len(again) > 1 else ""
            raise ConfigError(f"--mlflow {self.target}: experiment {self.experiment!r} holds the run of {again[0]}"
                              f"{more} already; --overwrite replaces it, or give another --experiment")

    def write(self, runs: list[Run]) -> str:
        """One MLflow run per results file: params (the flattened config), metrics per round (step = round,
        timestamp = the round's end) and tags naming the file; the runs exported from a file before are
        deleted. Returns the tracking URI."""
        with self.errors():
            _log_runs(self.client, runs, self.experiment, self.earlier)
        return self.uri


def _log_runs(client: Any, runs: list[Run], experiment: str, earlier: dict[str, list[str]]) -> None:
    from mlflow.entities import Metric, Param

    found = client.get_experiment_by_name(experiment)
    if found is not None and found.lifecycle_stage == "deleted":
        client.restore_experiment(found.experiment_id)
    experiment_id = found.experiment_id if found is not None else client.create_experiment(experiment)
    for run in runs:
        source = str(run.path.resolve())
        for run_id in earlier.get(source, []):
            client.delete_run(run_id)
        start, end = run.span()
        attrs = run.results.attrs
        tags = {"mpifl.results_file": source, "mpifl.status": str(attrs.get("status")),
                "mpifl.algorithm": str(attrs.get("algorithm")), "mpifl.world_size": str(attrs.get("world_size")),
                "mpifl.version": str(attrs.get("mpifl_version"))}
        created = client.create_run(experiment_id, start_time=int(start * 1000), tags=tags, run_name=run.name)
        run_id = created.info.run_id
        params = [Param(key, str(value)) for key, value in run.hyperparameters().items()]
        for i in range(0, len(params), _MLFLOW_PARAMS_PER_BATCH):
            client.log_batch(run_id, params=params[i : i + _MLFLOW_PARAMS_PER_BATCH])
        metrics = [Metric(s.tag, value, int(when * 1000), step)
                   for s in run.series() for step, value, when in s.finite()]
        for i in range(0, len(metrics), _MLFLOW_METRICS_PER_BATCH):
            client.log_batch(run_id, metrics=metrics[i : i + _MLFLOW_METRICS_PER_BATCH])
        if attrs.get("status") == "completed":  # a file still "running" stays an open run
            client.set_terminated(run_id, "FINISHED", end_time=int(end * 1000))


def _runs_by_file(client: Any, experiment_id: str) -> dict[str, list[str]]:
    """The ids of the experiment's runs, by the results file they were exported from."""
    out: dict[str, list[str]] = {}
    token = None
    while True:
        page = client.search_runs([experiment_id], page_token=token)
        for found in page:
            out.setdefault(found.data.tags.get("mpifl.results_file", ""), []).append(found.info.run_id)
        token = page.token
        if not token:
            return out


@dataclass(frozen=True)
class Target:
    """Where one run's CSV files and TensorBoard events go (``None``: not asked for)."""

    run: Run
    csv_dir: Path | None
    tensorboard_dir: Path | None

    def refuse_earlier(self, overwrite: bool) -> None:
        """Refuse, unless ``overwrite``, CSV files that exist where the run's would go and a TensorBoard directory
        that holds events already (TensorBoard would show both exports as one run's)."""
        for folder in (self.csv_dir, self.tensorboard_dir):
            if folder is not None:
                check_names(folder)
        if self.csv_dir is not None:
            for path in csv_files(self.run, self.csv_dir).values():
                refuse_existing(path, overwrite, ours=is_exported_csv)
        if self.tensorboard_dir is not None and not overwrite and any(self.tensorboard_dir.glob(TENSORBOARD_EVENTS)):
            raise ConfigError(f"output {self.tensorboard_dir} holds TensorBoard events already; --overwrite replaces "
                              "them, or give another directory")


def export(source: str, csv_dir: str | None = None, tensorboard_dir: str | None = None,
           mlflow_target: str | None = None, experiment: str | None = None, overwrite: bool = False) -> list[str]:
    """Export a results file, or each in a directory (then into a subdirectory per file for CSV and
    TensorBoard); returns what was written. The MLflow experiment defaults to the source's directory name. What
    an earlier export wrote (CSV files, TensorBoard events, MLflow runs of the same files) is refused before
    anything is written, or replaced with ``overwrite``."""
    if tensorboard_dir:  # a missing extra is said before anything is written (MLflow's: by MlflowTarget)
        optional_import("torch.utils.tensorboard", "tensorboard", "--tensorboard")
    files = results_files(source)
    runs = [Run(path, read_results(path, ledger=False)) for path in files]
    sweep = Path(source).is_dir()
    experiment = experiment or (Path(source) if sweep else files[0].parent).resolve().name
    try:
        targets = [Target(run, *(None if d is None else Path(d) / run.name if sweep else Path(d)
                                 for d in (csv_dir, tensorboard_dir))) for run in runs]
        for target in targets:
            target.refuse_earlier(overwrite)
        mlflow = MlflowTarget(mlflow_target, experiment) if mlflow_target else None
        if mlflow is not None:
            mlflow.refuse_earlier(runs, overwrite)
        written: list[str] = []
        for target in targets:
            if target.csv_dir is not None:
                written += [str(p) for p in write_csv(target.run, target.csv_dir)]
            if target.tensorboard_dir is not None:
                written.append(str(write_tensorboard(target.run, target.tensorboard_dir)))
        if mlflow is not None:
            uri = mlflow.write(runs)
            written.append(f"{uri} (MLflow experiment {experiment!r}, {len(runs)} run{'s' * (len(runs) != 1)})")
        return written
    except OSError as exc:  # a target that cannot be created or written: the user's input; a full disk: the machine's
        if storage_errno(exc) in NAMED_TARGET_ERRNOS:
            raise
        raise ConfigError(f"export: cannot write: {exc}") from None
