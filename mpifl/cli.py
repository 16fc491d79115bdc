"""Command line: ``mpifl run|validate|report|plot|export|sweep``.

``run`` is the only command that uses MPI; launch it with ``mpirun -n P`` (or ``srun``), or alone
for a single process. Bad input exits with code 2 and one ``mpifl: error:`` line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from mpifl.schema import ConfigError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mpifl", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    _job_commands(sub)
    _results_commands(sub)
    return p


def _overrides(parser: argparse.ArgumentParser, help: str | None = None) -> None:  # noqa: A002 - argparse's name
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help=help)


def _job_commands(sub: argparse._SubParsersAction) -> None:
    """Commands that run or check jobs: run, prepare, validate, sweep."""
    run = sub.add_parser("run", help="run a federated-learning job (under mpirun/srun, or alone)")
    run.add_argument("config", nargs="?",
                     help="YAML config file (with --resume: optional, the results file holds the run's config)")
    _overrides(run, "override a config value, e.g. --set client.lr=0.1 (repeatable)")
    run.add_argument("--out", help="results file (default: the config's output)")
    run.add_argument("--quiet", action="store_true", help="no progress lines")
    run.add_argument("--heartbeat", type=float, default=30.0, metavar="SECONDS",
                     help="between evaluations, a progress line (round, rounds/s, elapsed, ETA) at most this often "
                          "(default 30; --quiet: none)")
    run.add_argument("--resume", metavar="RESULTS.h5",
                     help="continue the run whose checkpoint is in this results file (its own config unless one "
                          "is given, which must agree; any rank count)")
    run.add_argument("--overwrite", action="store_true",
                     help="replace the results file at --out even if it holds a run (completed or not)")
    run.add_argument("--profile", action="store_true",
                     help="also record every rank's time breakdown per round (results table /profile)")
    run.add_argument("--force-start", action="store_true",
                     help="start even where the estimate of the results file and checkpoints does not fit in the "
                          "free space (each write is still checked)")
    prep = sub.add_parser("prepare", help="write the config's federated dataset into one HDF5 file that runs read "
                                          "client by client (data.prepared: FILE)")
    prep.add_argument("config")
    _overrides(prep)
    prep.add_argument("--out", required=True, help="the HDF5 file to write")
    prep.add_argument("--overwrite", action="store_true", help="replace the file at --out if it exists")
    val = sub.add_parser("validate", help="check a config (and its data) without running or MPI")
    val.add_argument("config")
    _overrides(val)
    val.add_argument("--no-data", action="store_true", help="check the config only, not the data files")
    sweep = sub.add_parser("sweep", help="run a grid of configs × seeds (locally, or as a SLURM array)")
    sweep.add_argument("sweep_file")
    sweep.add_argument("--slurm", action="store_true", help="write a SLURM job array instead of running")
    sweep.add_argument("--dry-run", action="store_true", help="print the commands only")
    _overrides(sweep, "override a config value in every run, after the sweep's own (repeatable; e.g. --set "
                      "rounds=2 for a smoke test)")
    sweep.add_argument("--seeds", type=int, nargs="+", metavar="SEED", help="run these seeds instead of the file's")
    sweep.add_argument("--output-dir", help="write the results here instead of the file's output_dir")
    sweep.add_argument("--overwrite", action="store_true",
                       help="start every run again, replacing its results file (without it: a run completed with "
                            "the same config is skipped, an interrupted one resumed)")
    sweep.add_argument("--force-start", action="store_true",
                       help="start each run even where its estimate does not fit in the free space (run --force-start)")


def _results_commands(sub: argparse._SubParsersAction) -> None:
    """Commands that read results files: report, plot, export."""
    rep = sub.add_parser("report", help="summarize a results file, or aggregate a directory of runs over seeds")
    rep.add_argument("results", help="results file, or a directory of them (writes summary.md and summary.csv)")
    rep.add_argument("--json", action="store_true", help="machine-readable output")
    rep.add_argument("--select", choices=("final", "best-val"), default="final",
                     help="report the final evaluation, or the one with the best validation accuracy of the seen "
                          "clients (the papers' model selection; needs data.val_fraction > 0); for a directory, "
                          "whose table shows both, the one listed first and used for diagnostics and train_MB")
    plot = sub.add_parser("plot", help="accuracy vs rounds and vs cumulative logical bytes, each group's curve "
                                         "its mean ± 2·SE over seeds, or with one seed, no average")
    plot.add_argument("results", nargs="+", help="results files, or a sweep directory (runs that differ only in seed: "
                                                 "one curve, their mean, with a ±2·SE band)")
    plot.add_argument("-o", "--output", required=True, help="image file (.png, .pdf, .svg)")
    plot.add_argument("--metric", metavar="NAME|PATTERN",
                      help="plot this rounds or eval column (a glob, quoted: 'consensus_layer*') over rounds instead, "
                           "one panel per run group, one line per matching column")
    plot.add_argument("--log", action="store_true", help="logarithmic y axis")
    plot.add_argument("--overwrite", action="store_true", help="replace the image file if it exists")
    exp = sub.add_parser("export", help="write a results file's (or a sweep directory's) metrics as CSV, "
                                        "TensorBoard events and/or MLflow runs")
    exp.add_argument("results", help="results file, or a directory of them (one run per file)")
    exp.add_argument("--csv", metavar="DIR", help="write rounds.csv, eval.csv, clients.csv here")
    exp.add_argument("--tensorboard", metavar="DIR",
                     help="write a TensorBoard event file here (needs pip install 'mpifl[tensorboard]')")
    exp.add_argument("--mlflow", metavar="DIR|URI", help="log MLflow runs into this local file store (or tracking "
                                                         "URI; needs pip install 'mpifl[mlflow]')")
    exp.add_argument("--experiment", help="MLflow experiment name (default: the results' directory name)")
    exp.add_argument("--overwrite", action="store_true",
                     help="replace what an earlier export of these files wrote there (CSV files, TensorBoard events, "
                          "MLflow runs)")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _dispatch(args)
    except BrokenPipeError:  # e.g. `mpifl report F.h5 | head`: the reader has gone; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _dispatch(args: argparse.Namespace) -> int:
    commands = {"run": _run, "validate": _validate, "prepare": _prepare, "report": _report, "export": _export,
                "sweep": _sweep, "plot": _plot}
    try:
        return commands[args.command](args)
    except ConfigError as exc:
        sys.stderr.write(f"mpifl: error: {exc}\n")
        return 2
    except OSError as exc:  # a plot, export, summary or prepared file the file system could not take: one line
        from mpifl.results.space import (
            NAMED_TARGET_ERRNOS,
            STORAGE_EXIT,
            StorageFull,
            storage_errno,
            storage_exit,
            storage_full,
        )

        if not isinstance(exc, StorageFull) and storage_errno(exc) not in NAMED_TARGET_ERRNOS:
            raise  # (a StorageFull is a fault met mid-write, read-only ones too: one line whatever its errno)
        what = f"the write of {exc.filename}" if exc.filename else "a write"
        full = exc if isinstance(exc, StorageFull) else storage_full(exc, exc.filename or ".", what)
        sys.stderr.write(f"mpifl: error: {full.strerror}\n")
        return storage_exit(STORAGE_EXIT)  # (a prepared data file's HDF5 write: no crash at exit)


def _run(args: argparse.Namespace) -> int:
    from mpifl.runtime.launch import JobOptions, run_job

    return run_job(args.config, args.overrides, args.out, JobOptions(
        quiet=args.quiet, resume=args.resume, overwrite=args.overwrite, profile=args.profile,
        heartbeat_s=args.heartbeat, force_start=args.force_start))


def _report(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mpifl.report import aggregate, report

    reader = aggregate if Path(args.results).is_dir() else report
    summary = reader(args.results, args.select)
    print(json.dumps(summary, indent=2) if args.json else summary["text"])
    return 0


def _export(args: argparse.Namespace) -> int:
    from mpifl.export import export

    if not (args.csv or args.tensorboard or args.mlflow):
        raise ConfigError("export: give --csv DIR, --tensorboard DIR and/or --mlflow DIR")
    for path in export(args.results, args.csv, args.tensorboard, args.mlflow, args.experiment, args.overwrite):
        print(f"wrote {path}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from mpifl.sweep import run_sweep

    return run_sweep(args.sweep_file, args.slurm, args.dry_run, args.overrides, args.seeds, args.output_dir,
                     args.overwrite, args.force_start)


def _plot(args: argparse.Namespace) -> int:
    from mpifl.report import plot

    unfinished: list[str] = []
    plot(args.results, args.output, args.metric, args.log, args.overwrite, unfinished)
    for note in unfinished:
        print(f"not completed: {note}")
    print(f"wrote {args.output}")
    return 0


def _prepare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mpifl.data import build_federated_dataset
    from mpifl.data.prepared import is_prepared, prepare, temporary_name
    from mpifl.registry import load_config
    from mpifl.results import check_writable
    from mpifl.results.guard import refuse_existing

    cfg = load_config(args.config, args.overrides, required=("data.dataset",))  # preparing data needs no algorithm
    if cfg.data.prepared is not None:
        raise ConfigError("data.prepared: leave it unset when preparing (it names the file to read, not to write)")
    check_writable(args.out, (("temporary file", temporary_name(Path(args.out)).name),))
    refuse_existing(args.out, args.overwrite, ours=is_prepared)  # before the data is read, not after
    dataset = build_federated_dataset(cfg.data, cfg.seed)
    prepare(dataset, cfg.data, cfg.seed, args.out)
    layout = dataset.layout
    print(f"wrote {args.out}: {layout.num_clients} clients, {int(layout.train_sizes.sum())} training samples; "
          f"run with --set data.prepared={args.out}")
    return 0


def _validate(args: argparse.Namespace) -> int:
    from mpifl.registry import load_config

    cfg = load_config(args.config, args.overrides)
    detail = ""
    if not args.no_data:
        from mpifl.data import build_federated_dataset
        from mpifl.runtime.assembly import check_run

        layout = build_federated_dataset(cfg.data, cfg.seed).layout
        check_run(cfg, layout)
        seen = int((~layout.unseen).sum())
        detail = f": {layout.num_clients} clients ({seen} seen), {int(layout.train_sizes.sum())} training samples"
    print(f"{args.config}: valid{detail}")
    return 0
