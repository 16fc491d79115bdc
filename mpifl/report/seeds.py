"""Runs that differ only in seed, grouped, and their mean ± 2·SE (``mpifl report DIRECTORY``: a sweep's table,
written as ``summary.md`` and ``summary.csv``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from mpifl.report.text import SELECTIONS, best_val_row, diagnostics, epsilon_at
from mpifl.results import Results, flatten, read_results
from mpifl.results.guard import inspect_output, refuse_unless_ours, writable_directory
from mpifl.results.space import written_whole


def mean_2se(values: np.ndarray) -> tuple[float, float]:
    """Mean and 2·SE (sample standard deviation over √n; NaN for one value) of finite ``values``: the
    spread the seed papers' tables print."""
    values = np.asarray(values, dtype=np.float64)
    values = values[np.isfinite(values)]
    if len(values) == 0:
        return float("nan"), float("nan")
    se = values.std(ddof=1) / np.sqrt(len(values)) if len(values) > 1 else float("nan")
    return float(values.mean()), float(2 * se)


@dataclass(frozen=True)
class RunGroup:
    """Runs whose configs differ only in ``seed`` (and output path): one row of a sweep's table, one curve of
    its plot. ``name``: the config keys that tell it from the other groups, with its values. ``runs`` holds one
    run per seed: files that repeat a seed (copies, or a run made twice) hold the same run, so they are counted
    once and listed in ``repeats``."""

    config: dict[str, Any]
    name: dict[str, Any]
    runs: list[tuple[Path, Results]]
    repeats: list[Path] = field(default_factory=list)

    @property
    def label(self) -> str:
        """The sweep variant its runs came from (``mpifl sweep`` names them ``VARIANT,...,seed=S.h5``), else the
        overrides that distinguish the group (``algorithm=fedals, fedals.alpha=5``), else its algorithm."""
        swept = all(",seed=" in path.stem for path, _ in self.runs)
        variants = {path.stem.split(",")[0] for path, _ in self.runs}
        if swept and len(variants) == 1 and "=" not in (variant := variants.pop()):
            return variant
        return ", ".join(f"{k}={v}" for k, v in self.name.items()) or str(self.config.get("algorithm"))


def group_runs(paths: Sequence[str | Path]) -> tuple[list[RunGroup], list[str]]:
    """Read results files (a directory: every ``*.h5`` in it) and group the runs that differ only in seed; also
    the keys that differ between groups. An algorithm's own options count only among that algorithm's runs
    (every config carries every algorithm's defaults), and name only its groups."""
    import yaml

    from mpifl.registry import known_algorithms
    from mpifl.schema import ConfigError

    files = [f for p in map(Path, paths) for f in (sorted(p.glob("*.h5")) if p.is_dir() else [p])]
    if not files:
        raise ConfigError(f"{', '.join(map(str, paths))}: no .h5 results files")
    by_config: dict[str, tuple[dict[str, Any], list[tuple[Path, Results]]]] = {}
    for path in files:
        res = read_results(path, ledger=False)
        config = {k: v for k, v in flatten(res.config).items() if k not in ("seed", "output")}
        by_config.setdefault(yaml.safe_dump(config, sort_keys=True), (config, []))[1].append((path, res))
    configs = [config for config, _ in by_config.values()]
    algorithms = set(known_algorithms()) | {str(c.get("algorithm")) for c in configs}  # plug-ins' sections too

    def applies(key: str, config: dict[str, Any]) -> bool:
        section = key.split(".", 1)[0]
        return section not in algorithms or config.get("algorithm") == section

    varying = sorted(k for k in set().union(*configs)
                     if len({repr(c.get(k)) for c in configs if applies(k, c)}) > 1)
    groups = [RunGroup(config, {k: config.get(k, "–") for k in varying if applies(k, config)}, *_one_per_seed(runs))
              for config, runs in by_config.values()]
    return groups, varying


def _one_per_seed(runs: list[tuple[Path, Results]]) -> tuple[list[tuple[Path, Results]], list[Path]]:
    """One run per seed (of files with the same config and seed, the one that got furthest: completed first,
    then most rounds, then the first by name), and the files left out."""
    by_seed: dict[Any, list[tuple[Path, Results]]] = {}
    for path, res in runs:
        by_seed.setdefault(res.config.get("seed"), []).append((path, res))
    kept = [max(same, key=lambda run: (run[1].attrs.get("status") == "completed",
                                        int(run[1].attrs.get("rounds_completed", 0)))) for same in by_seed.values()]
    return kept, [path for path, _ in runs if all(path != chosen for chosen, _ in kept)]


def _run_metrics(res: Results, select: str) -> dict[str, float]:
    """One run's numbers for a sweep's table: its test accuracies (pooled and client mean, of every model kind and
    client group) and their round at both selections, as ``NAME@final`` and ``NAME@best-val`` (NaN where the run
    recorded no validation accuracy); and under plain names everything at ``select``: those accuracies and
    round, the algorithm's diagnostics (see :func:`diagnostics`) and the logical training MB so far."""
    ev = res.table("eval")
    accuracy = [k for k in ev if k.endswith((".acc_pooled", ".acc_mean")) and ".val_" not in k]
    at = {"final": len(ev["round"]) - 1 if ev else None, "best-val": best_val_row(res)}
    out: dict[str, float] = {}
    for selection, row in at.items():
        for key in (*accuracy, "round"):
            out[f"{key}@{selection}"] = float("nan") if row is None else float(ev[key][row])
    row = at[select]
    out.update({key: out[f"{key}@{select}"] for key in (*accuracy, "round")})
    for table, by_name in diagnostics(res, -1 if row is None else row).items():
        for name, d in by_name.items():
            value = d["value"]
            out[name] = float("nan") if value is None or (row is None and table == "eval") else float(value)
    out["train_MB"] = float("nan") if row is None else float(ev["cum_logical_bytes"][row]) / 1e6
    if "epsilon" in res.table("rounds"):
        out["epsilon"] = epsilon_at(res, row)
    return out


SUMMARY_MARK = "<!-- written by mpifl report: replaced by the next report of this directory -->"
SUMMARY_CSV_MARK = "seeds"  # summary.csv's first column: how a report knows the file is its own
"""What starts the summary files a report writes: a user's file of the same name (without it) is never replaced."""


def aggregate(directory: str, select: str = "final") -> dict[str, Any]:
    """Mean ± 2·SE over seeds of every group of runs in ``directory`` (:func:`group_runs`): one row per group,
    named by the config keys that differ between groups; test accuracies at each run's best-validation and at
    its final evaluation side by side (the ``select`` one first; ``n/a`` where no run recorded validation
    accuracy), the algorithm's diagnostics and the logical training MB at the ``select`` one; completed runs only
    (the others are listed under the table). Writes the table as ``summary.md``, and every number
    (:func:`_run_metrics`: plain names at ``select``) as ``summary.csv``."""
    writable_directory(directory, "report")
    md_path, csv_path = Path(directory) / "summary.md", Path(directory) / "summary.csv"
    refuse_unless_ours(md_path, SUMMARY_MARK)
    refuse_unless_ours(csv_path, SUMMARY_CSV_MARK)
    groups, varying = group_runs([directory])
    unfinished = [path for group in groups for path, res in group.runs if not _completed(res)]
    groups = [replace(group, runs=[run for run in group.runs if _completed(run[1])]) for group in groups]
    groups = [group for group in groups if group.runs]  # a variant none of whose runs has finished: no row yet
    per_group = [[_run_metrics(res, select) for _, res in group.runs] for group in groups]
    columns = _Columns.of(per_group, select)
    rows = [_group_row(group, runs, varying, columns) for group, runs in zip(groups, per_group)]
    text = _summary_text(rows, varying, columns, select, unfinished)
    _write_summary(md_path, csv_path, text, rows, varying, columns)
    return {"rows": rows, "text": text, "varying": varying, "selection": select}


@dataclass(frozen=True)
class _Columns:
    """A sweep table's metrics, by name: ``plain`` ones, at the selection (``round`` and ``train_MB`` last), the
    test ``accuracy`` ones among them (by model kind and client group: pooled, then the client mean) and the
    ``diagnostics`` (the rest but ``round`` and ``train_MB``); ``order``: the selections, the chosen one first."""

    plain: list[str]
    accuracy: list[str]
    diagnostics: list[str]
    order: tuple[str, ...]

    @classmethod
    def of(cls, per_group: list[list[dict[str, float]]], select: str) -> _Columns:
        """The columns of every run's :func:`_run_metrics` (``per_group``: each group's runs)."""
        names = set().union(*(m for runs in per_group for m in runs))
        plain = sorted(n for n in names if "@" not in n and n not in ("round", "train_MB")) + ["round", "train_MB"]
        accuracy = sorted((n for n in plain if n.endswith((".acc_pooled", ".acc_mean"))),
                          key=lambda n: (n.split(".")[:2], not n.endswith("pooled")))  # pooled, then client mean
        diagnostics = [n for n in plain if n not in accuracy and n not in ("round", "train_MB")]
        return cls(plain, accuracy, diagnostics, (select, *(s for s in SELECTIONS if s != select)))

    @property
    def both(self) -> list[str]:
        """The accuracies and their round at every selection, as ``NAME@SELECTION``."""
        return [f"{n}@{s}" for n in (*self.accuracy, "round") for s in self.order]

    @property
    def every(self) -> list[str]:
        """Every metric a row holds (and summary.csv lists), in order."""
        return [*self.plain, *self.both]

    @property
    def accuracy_cells(self) -> list[str]:
        """The accuracies at every selection, as ``NAME@SELECTION``."""
        return [f"{n}@{s}" for n in self.accuracy for s in self.order]

    @property
    def shown(self) -> list[str]:
        """The metrics summary.md shows, in order."""
        return [*self.accuracy_cells, "round@best-val", *self.diagnostics, "train_MB"]


def _group_row(group: RunGroup, runs: list[dict[str, float]], varying: list[str], columns: _Columns) -> dict[str, Any]:
    """One group's row: its values of the ``varying`` keys, its seed count and files (kept, and repeats), and of
    each metric the mean ± 2·SE over ``runs`` (:func:`_run_metrics` of each) and, under ``n``, how many had one."""
    row: dict[str, Any] = {k: group.name.get(k, "–") for k in varying}
    row["seeds"] = len(runs)
    row["files"] = [str(path) for path, _ in group.runs]
    row["repeats"] = [str(path) for path in group.repeats]
    values = {name: np.array([m.get(name, np.nan) for m in runs]) for name in columns.every}
    row.update({name: mean_2se(v) for name, v in values.items()})
    row["n"] = {name: int(np.isfinite(v).sum()) for name, v in values.items()}
    return row


def _summary_text(rows: list[dict[str, Any]], varying: list[str], columns: _Columns, select: str,
                  unfinished: list[Path]) -> str:
    """summary.md's text: what the numbers are, the table, and the files left out (repeats, unfinished runs)."""
    how = "final evaluation" if select == "final" else "evaluation with the best validation accuracy"
    shown, accuracy_cells = columns.shown, columns.accuracy_cells
    md = [f"Test metrics at each run's evaluation with the best validation accuracy of the seen clients (`@best-val`)"
          f" and at its final one (`@final`); diagnostics and train_MB at its {how}. Mean ± 2·SE over seeds (sample "
          "standard deviation); (n=k): only k seeds had a value; n/a: none had (best-val needs data.val_fraction > 0).",
          "", "| " + " | ".join([*varying, "seeds", *shown]) + " |", "|" + "---|" * (len(varying) + 1 + len(shown))]
    for row in rows:
        cells = [str(row[k]) for k in (*varying, "seeds")]
        cells += [_mean_2se_cell(row[m], ".4f" if m in accuracy_cells else ".4g", row["n"][m], row["seeds"])
                  for m in shown]
        md.append("| " + " | ".join(cells) + " |")
    repeats = [path for row in rows for path in row["repeats"]]
    if repeats:
        md += ["", f"Left out, as repeats of a seed already counted (same config and seed): {', '.join(repeats)}."]
    if unfinished:
        md += ["", f"Left out, as not finished: {'; '.join(_unfinished(path) for path in unfinished)}."]
    return "\n".join(md)


def _write_summary(md_path: Path, csv_path: Path, text: str, rows: list[dict[str, Any]], varying: list[str],
                   columns: _Columns) -> None:
    """summary.md (``text``, after the mark that makes it a report's) and summary.csv (every number of ``rows``:
    each metric's mean and 2·SE), each written whole or not at all."""
    import csv

    with written_whole(md_path, "the summary") as tmp:
        tmp.write_text(f"{SUMMARY_MARK}\n{text}\n")
    with written_whole(csv_path, "the summary") as tmp, open(tmp, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([SUMMARY_CSV_MARK, *varying, *(f"{m}_{s}" for m in columns.every for s in ("mean", "2se"))])
        for row in rows:
            writer.writerow([row[k] for k in ("seeds", *varying)] + [v for m in columns.every for v in row[m]])


def _unfinished(path: Path) -> str:
    """Where an unfinished run stands (as ``report FILE`` and ``run`` say it) and what a rerun of the sweep does
    with it."""
    state = inspect_output(path)
    if state.condition == "running":
        return f"{path} ({state.where()})"
    if state.checkpoint_round is None:
        return f"{path} ({state.where()}, not resumable: a rerun of the sweep starts it again)"
    return f"{path} ({state.where()}, resumable from round {state.checkpoint_round}: a rerun of the sweep resumes it)"


def _completed(res: Results) -> bool:
    """Whether a run finished: a stopped, failed or still running one would mix an early round into the seeds'
    mean."""
    return res.attrs.get("status") == "completed"


def _mean_2se_cell(stats: tuple[float, float], form: str, n: int, seeds: int) -> str:
    mean, two_se = stats
    if not np.isfinite(mean):
        return "n/a"
    cell = f"{mean:{form}} ± {two_se:{form}}" if np.isfinite(two_se) else f"{mean:{form}}"
    return cell if n == seeds else f"{cell} (n={n})"
