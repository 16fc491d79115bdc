"""Reading results files back: a summary (text or JSON) and plots."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from mpifl.results import Results, flatten, read_results

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError


def _ledger_names(results: Results) -> tuple[list[str], list[str], list[str]]:
    attrs = results.table_attrs.get("ledger_totals") or results.table_attrs.get("ledger", {})
    return attrs.get("message_names", []), attrs.get("directions", []), attrs.get("stages", [])


def logical_totals(results: Results) -> dict[str, dict[str, dict[str, int]]]:
    """Logical bytes by stage → direction → message type (from the per-round totals, not per-client rows)."""
    totals = results.table("ledger_totals")
    names, directions, stages = _ledger_names(results)
    out: dict[str, dict[str, dict[str, int]]] = {}
    if not totals:
        return out
    for m, name in enumerate(names):
        for s, stage in enumerate(stages):
            mask = (totals["message"] == m) & (totals["stage"] == s)
            if mask.any():
                out.setdefault(stage, {}).setdefault(directions[m], {})[name] = int(totals["bytes"][mask].sum())
    return out


def per_client_round(results: Results) -> dict[str, dict[str, dict[str, float]]]:
    """Logical bytes one client received (down) or sent (up) in one round, by stage → direction: min, max,
    mean over the (round, client) pairs that had traffic, and their count. Min = max is the protocol's exact
    per-client cost; a spread shows what varies (rounds that send more, dropped uploads). From the per-round
    spreads (``ledger_clients``), not per-client rows."""
    spread = results.table("ledger_clients")
    stages = _ledger_names(results)[2]
    out: dict[str, dict[str, dict[str, float]]] = {}
    if not spread:
        return out
    for s, stage in enumerate(stages):
        for d, direction in enumerate(("down", "up")):
            mask = (spread["stage"] == s) & (spread["direction"] == d)
            if not mask.any():
                continue
            count = int(spread["clients"][mask].sum())
            out.setdefault(stage, {})[direction] = {
                "min": int(spread["bytes_min"][mask].min()), "max": int(spread["bytes_max"][mask].max()),
                "mean": float(spread["bytes_sum"][mask].sum() / count), "count": count}
    return out


def _per_client_round_line(stage: str, by_dir: dict[str, dict[str, float]]) -> str:
    """One line: the exact bytes where every client-round had the same, else the range and mean."""
    cells = [f"{d} {s['min']:,} B" if s["min"] == s["max"]
             else f"{d} {s['min']:,}–{s['max']:,} B (mean {s['mean']:,.0f})" for d, s in by_dir.items()]
    counts = ", ".join(f"{s['count']} {d}" for d, s in by_dir.items())
    return f"logical {stage} per client-round: {', '.join(cells)} (client-rounds: {counts})"


SELECTIONS = ("final", "best-val")


def best_val_row(res: Results) -> int | None:
    """The evaluation row with the best validation accuracy of the seen clients under the first model kind (the
    papers' model selection; the earliest on ties), or None when the run recorded no validation accuracy."""
    ev = res.table("eval")
    kinds = list(res.attrs.get("eval_kinds", []))
    key = f"{kinds[0]}.seen.val_acc_pooled" if kinds else ""
    if key not in ev or not np.isfinite(ev[key]).any():
        return None
    return int(np.nanargmax(ev[key]))


def selected_row(res: Results, select: str, path: str | Path) -> int:
    """Which evaluation row a selection reports: the last (``final``), or :func:`best_val_row` (``best-val``)."""
    ev = res.table("eval")
    if not ev:
        return -1
    if select == "final":
        return len(ev["round"]) - 1
    row = best_val_row(res)
    if row is None:
        from mpifl.schema import ConfigError

        raise ConfigError(f"--select best-val: {path} has no validation accuracy (run with data.val_fraction > 0)")
    return row


def diagnostics(res: Results, row: int) -> dict[str, dict[str, dict[str, float | None]]]:
    """The algorithm's own diagnostics (e.g. Karula's projection δ, FedALS's consensus distances, PeFLL's
    descriptor correlation), by table: per-round ones at the last round that recorded them, evaluation ones at
    the reported evaluation (``row``); each with its round, and min and max over the rows that recorded it."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for table in ("rounds", "eval"):
        columns = res.table(table)
        for name in res.diagnostics(table):
            values = columns[name]
            finite = np.isfinite(values)
            if not finite.any():
                continue
            at = row if table == "eval" else int(np.flatnonzero(finite)[-1])
            out.setdefault(table, {})[name] = {
                "round": int(columns["round"][at]), "value": float(values[at]) if finite[at] else None,
                "min": float(values[finite].min()), "max": float(values[finite].max()), "rows": int(finite.sum())}
    return out


def _diagnostic_lines(diags: dict[str, dict[str, dict[str, float | None]]]) -> list[str]:
    lines = []
    for table, what, rows in (("rounds", "per round (the last value", "rounds"),
                              ("eval", "per evaluation (at the reported one", "evaluations")):
        if table in diags:
            lines.append(f"algorithm diagnostics {what}; min and max over the {rows} that recorded it):")
            for name, d in diags[table].items():
                value = "–" if d["value"] is None else f"{d['value']:.4g}"
                lines.append(f"  {name:<32} {value:>10} (round {d['round']})  min {d['min']:.4g}  max {d['max']:.4g}"
                             f"  ({d['rows']} {rows})")
    return lines


def report(path: str, select: str = "final") -> dict[str, Any]:
    res = read_results(path, ledger=False)
    ev, rounds = res.table("eval"), res.table("rounds")
    row = selected_row(res, select, path)
    final: dict[str, float] = {}
    if ev:
        final = {k: float(v[row]) for k, v in ev.items() if k not in ("round",) and np.isfinite(v[row])}
    totals, per_client = logical_totals(res), per_client_round(res)
    ranks = res.table("ranks")
    summary: dict[str, Any] = {
        "file": str(path),
        "algorithm": res.attrs.get("algorithm"),
        "status": res.attrs.get("status"),
        "world_size": res.attrs.get("world_size"),
        "rounds_completed": res.attrs.get("rounds_completed"),
        "selection": select,
        "selected_round": int(ev["round"][row]) if ev else None,
        "last_eval_round": int(ev["round"][-1]) if ev else None,
        "final": final,
        "diagnostics": diagnostics(res, row),
        "logical_bytes": totals,
        "logical_bytes_per_client_round": per_client,
        "physical_mpi_bytes": int(ranks["mpi_bytes"].sum() if ranks else np.sum(res.table("physical").get("bytes", 0))),
        "mpi_seconds_by_rank": [float(s) for s in ranks["mpi_seconds"]] if ranks else None,
        "wall_time_s": res.attrs.get("wall_time_s"),
        "simulated_time_s": float(np.sum(rounds["sim_time_s"])) if rounds else 0.0,
    }
    lines = [
        f"{path}: {summary['algorithm']}, {summary['status']}, {summary['rounds_completed']} rounds on "
        f"{summary['world_size']} rank(s), wall {summary['wall_time_s']:.1f} s, "
        f"simulated {summary['simulated_time_s']:.1f} s",
    ]
    if final:
        how = "final evaluation" if select == "final" else "evaluation with the best validation accuracy"
        lines.append(f"{how} (round {summary['selected_round']}):")
        for key in sorted(final):
            if key != "cum_logical_bytes" and key not in summary["diagnostics"].get("eval", {}):
                lines.append(f"  {key:<32} {final[key]:.4f}")
    lines += _diagnostic_lines(summary["diagnostics"])
    if ev and "epsilon" in rounds:
        summary["epsilon"] = epsilon_at(res, row)
        lines.append(f"differential privacy: ε = {summary['epsilon']:.4g} at δ = {res.config['privacy']['delta']:g} "
                     f"after round {summary['selected_round']}")
    for stage, by_dir in totals.items():
        for direction, by_msg in by_dir.items():
            detail = ", ".join(f"{name} {_bytes(b)}" for name, b in by_msg.items())
            lines.append(f"logical {stage} {direction:<4} {_bytes(sum(by_msg.values())):>10}  ({detail})")
        lines.append(_per_client_round_line(stage, per_client[stage]))
    lines.append(f"physical MPI traffic       {_bytes(summary['physical_mpi_bytes']):>10}")
    if ranks:
        summary["time_by_rank"] = time_breakdown(ranks)
        lines += _breakdown_lines(summary["time_by_rank"], res.table("profile"))
    summary["text"] = "\n".join(lines)
    return summary


def time_breakdown(ranks: dict[str, np.ndarray]) -> list[dict[str, float]]:
    """Each rank's round-loop seconds by part (they do not overlap; "other" is the loop's remainder)."""
    parts = [k for k in ranks if k.endswith("_seconds") and not k.startswith(("loop_", "setup_"))]
    out = []
    for i in range(len(ranks["rank"])):
        row: dict[str, float] = {"rank": int(ranks["rank"][i]), "clients": int(ranks["clients"][i])}
        row.update({k.removesuffix("_seconds"): float(ranks[k][i]) for k in parts})
        row["other"] = float(ranks["loop_wall_seconds"][i]) - sum(row[k.removesuffix("_seconds")] for k in parts)
        row["wall"] = float(ranks["loop_wall_seconds"][i])
        row["cpu"] = float(ranks["loop_cpu_seconds"][i])
        out.append(row)
    return out


def _breakdown_lines(rows: list[dict[str, float]], profile: dict[str, np.ndarray]) -> list[str]:
    """The per-rank time table (seconds, and the share of the loop's wall time), plus, from a
    ``--profile`` run, the median round of each rank."""
    header = list(rows[0])
    lines = ["time by rank (s; setup excluded):", _row(header, header)]
    for row in rows:
        lines.append(_row([row["rank"], row["clients"], *(f"{row[c]:.2f}" for c in header[2:])], header))
    if profile:
        parts = [k for k in profile if k.endswith("_seconds")]
        header = ["rank", *(p.removesuffix("_seconds") for p in parts)]
        lines += ["median round by rank (s; --profile):", _row(header, header)]
        for rank in np.unique(profile["rank"]):
            mine = profile["rank"] == rank
            lines.append(_row([rank, *(f"{np.median(profile[p][mine]):.4f}" for p in parts)], header))
    return lines


def _row(cells: list, header: list[str]) -> str:
    """Right-aligned cells, each as wide as its column's header (at least 8 characters)."""
    return "  " + " ".join(f"{c!s:>{max(8, len(h))}}" for c, h in zip(cells, header))


def plot(paths: Sequence[str | Path], output: str, metric: str | None = None, log_y: bool = False) -> Figure:
    """Test accuracy against rounds, cumulative logical training bytes and simulated time: for each group of runs
    that differ only in seed (:func:`group_runs`; a directory gives every run in it), the mean over seeds with a
    ±2·SE band, one colour per group and model kind, seen clients solid, unseen dashed. With ``metric`` (a rounds
    or eval column, or a glob such as ``consensus_layer*``): that column against rounds instead, one panel per
    group and one line per matching column (FedALS's per-layer consensus distances, the paper's Fig. 1). Writes
    ``output`` and returns the figure, whose lines and bands are what was drawn."""
    groups, _ = group_runs(paths)
    fig = _metric_figure(groups, metric) if metric else _accuracy_figure(groups)
    if log_y:
        for ax in fig.axes:
            ax.set_yscale("log")
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    return fig


def _over_seeds(series: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every round that some run recorded, and there the mean and 2·SE over the runs with a finite value (see
    :func:`mean_2se`); ``series`` holds each run's rounds and values."""
    rounds = np.unique(np.concatenate([r for r, _ in series]))
    values = np.full((len(series), len(rounds)), np.nan)
    for i, (r, v) in enumerate(series):
        values[i, np.searchsorted(rounds, r)] = v
    mean, two_se = np.array([mean_2se(column) for column in values.T]).reshape(-1, 2).T
    return rounds, mean, two_se


def _curve(ax: Axes, x: np.ndarray, mean: np.ndarray, two_se: np.ndarray, label: str, color: str,
           style: str) -> None:
    """The mean line and, where two or more seeds give a spread, its ±2·SE band in the line's colour."""
    keep = np.isfinite(x) & np.isfinite(mean)
    ax.plot(x[keep], mean[keep], style, color=color, markersize=3, label=label)
    band = keep & np.isfinite(two_se)
    if band.any():
        ax.fill_between(x[band], (mean - two_se)[band], (mean + two_se)[band], color=color, alpha=0.2, linewidth=0)


def _seeds(n: int) -> str:
    return f"{n} seed" if n == 1 else f"{n} seeds"


def _accuracy_figure(groups: list[RunGroup]) -> Figure:
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(15, 4.6), layout="constrained")
    axes = fig.subplots(1, 3)
    colors = 0
    for group in groups:
        evals = [(res.table("eval"), res.table("rounds")) for _, res in group.runs if res.table("eval")]
        if not evals:
            continue
        sim_time = [(ev["round"], np.cumsum(rounds["sim_time_s"])[ev["round"].astype(int) - 1]) for ev, rounds in evals]
        xs = (_over_seeds([(ev["round"], ev["round"]) for ev, _ in evals])[0],
              _over_seeds([(ev["round"], ev["cum_logical_bytes"] / 1e6) for ev, _ in evals])[1],
              _over_seeds(sim_time)[1])
        keys = sorted({k for ev, _ in evals for k in ev if k.endswith(".acc_pooled") and np.isfinite(ev[k]).any()})
        kinds = list(dict.fromkeys(key.split(".")[0] for key in keys))  # seen and unseen of one model alike
        color = {kind: f"C{(colors + i) % 10}" for i, kind in enumerate(kinds)}
        colors += len(kinds)
        for key in keys:
            kind, clients = key.split(".")[:2]
            _, mean, two_se = _over_seeds([(ev["round"], ev.get(key, np.full(len(ev["round"]), np.nan)))
                                           for ev, _ in evals])
            label = f"{group.label} ({_seeds(len(evals))}): {kind} {clients}"
            for ax, x in zip(axes, xs):
                _curve(ax, x, mean, two_se, label, color[kind], "o-" if clients == "seen" else "s--")
    score = "R²" if groups[0].runs[0][1].attrs.get("task") == "regression" else "accuracy"
    labels = (("round", "rounds"), ("cumulative logical bytes as sent (encoded), training (MB)", "communication"),
              ("simulated time (s)", "simulated time"))
    for ax, (xlabel, what) in zip(axes, labels):
        ax.set(xlabel=xlabel, ylabel=f"test {score} (pooled)", title=f"{score} vs {what} (mean ± 2·SE over seeds)")
        ax.grid(alpha=0.3)
    axes[0].xaxis.set_major_locator(MaxNLocator(integer=True))
    handles, names = axes[0].get_legend_handles_labels()
    if names:  # below the panels: long group names hide no data
        fig.legend(handles, names, loc="outside lower center", ncols=2, fontsize=8)
        fig.set_size_inches(15, 4.4 + 0.2 * -(-len(names) // 2))
    return fig


def _metric_figure(groups: list[RunGroup], pattern: str) -> Figure:
    """One panel per group that recorded a column matching ``pattern``, one line (mean ± 2·SE) per column."""
    from fnmatch import fnmatchcase
    from textwrap import fill

    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    from mpifl.schema import ConfigError

    panels = []
    for group in groups:
        series: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        for _, res in group.runs:
            for table in ("rounds", "eval"):
                columns = res.table(table)
                for name in sorted(n for n in columns if n != "round" and fnmatchcase(n, pattern)):
                    series.setdefault(name, []).append((columns["round"], columns[name]))
        if series:
            panels.append((group, series))
    if not panels:
        recorded = sorted({n for g in groups for _, res in g.runs for t in ("rounds", "eval")
                           for n in res.diagnostics(t)})
        raise ConfigError(f"--metric {pattern}: no rounds or eval column matches it; the algorithms' diagnostics here: "
                          f"{', '.join(recorded) or 'none'} (or any column, e.g. train_loss, global.seen.acc_pooled)")
    ncols = min(len(panels), 3)
    nrows = -(-len(panels) // ncols)
    fig = Figure(figsize=(5.2 * ncols, 4 * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False, sharey=True).ravel()
    names = sorted({name for _, series in panels for name in series})
    for ax, (group, series) in zip(axes, panels):
        for name, runs in series.items():
            rounds, mean, two_se = _over_seeds(runs)
            _curve(ax, rounds.astype(np.float64), mean, two_se, name, f"C{names.index(name) % 10}", ".-")
        ax.set_title(fill(f"{group.label} ({_seeds(len(group.runs))})", 60), fontsize=9)
        ax.set(xlabel="round", ylabel=pattern)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    return fig


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
    its plot. ``name``: the config keys that tell it from the other groups, with its values."""

    config: dict[str, Any]
    name: dict[str, Any]
    runs: list[tuple[Path, Results]]

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
    groups = [RunGroup(config, {k: config.get(k, "–") for k in varying if applies(k, config)}, runs)
              for config, runs in by_config.values()]
    return groups, varying


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


def epsilon_at(res: Results, eval_row: int | None) -> float:
    """The privacy accountant's ε after the round of evaluation ``eval_row`` (DP runs: ``privacy:``)."""
    rounds = res.table("rounds")
    if eval_row is None:
        return float("nan")
    done = rounds["round"] <= res.table("eval")["round"][eval_row]
    return float(rounds["epsilon"][done][-1]) if done.any() else 0.0


def aggregate(directory: str, select: str = "final") -> dict[str, Any]:
    """Mean ± 2·SE over seeds of every group of runs in ``directory`` (:func:`group_runs`): one row per group,
    named by the config keys that differ between groups; test accuracies at each run's best-validation and at
    its final evaluation side by side (the ``select`` one first; ``n/a`` where no run recorded validation
    accuracy), the algorithm's diagnostics and the logical training MB at the ``select`` one. Writes the table as
    ``summary.md``, and every number (:func:`_run_metrics`: plain names at ``select``) as ``summary.csv``."""
    import csv

    groups, varying = group_runs([directory])
    per_group = [[_run_metrics(res, select) for _, res in group.runs] for group in groups]
    names = set().union(*(m for runs in per_group for m in runs))
    plain = sorted(n for n in names if "@" not in n and n not in ("round", "train_MB")) + ["round", "train_MB"]
    accuracy = sorted((n for n in plain if n.endswith((".acc_pooled", ".acc_mean"))),
                      key=lambda n: (n.split(".")[:2], not n.endswith("pooled")))  # pooled, then client mean
    diagnostic_names = [n for n in plain if n not in accuracy and n not in ("round", "train_MB")]
    order = (select, *(s for s in SELECTIONS if s != select))
    both = [f"{n}@{s}" for n in (*accuracy, "round") for s in order]
    rows = []
    for group, runs in zip(groups, per_group):
        row: dict[str, Any] = {k: group.name.get(k, "–") for k in varying}
        row["seeds"] = len(runs)
        row["files"] = [str(path) for path, _ in group.runs]
        values = {name: np.array([m.get(name, np.nan) for m in runs]) for name in (*plain, *both)}
        row.update({name: mean_2se(v) for name, v in values.items()})
        row["n"] = {name: int(np.isfinite(v).sum()) for name, v in values.items()}
        rows.append(row)
    accuracy_cells = [f"{n}@{s}" for n in accuracy for s in order]
    shown = [*accuracy_cells, "round@best-val", *diagnostic_names, "train_MB"]
    how = "final evaluation" if select == "final" else "evaluation with the best validation accuracy"
    md = [f"Test metrics at each run's evaluation with the best validation accuracy of the seen clients (`@best-val`)"
          f" and at its final one (`@final`); diagnostics and train_MB at its {how}. Mean ± 2·SE over seeds (sample "
          "standard deviation); (n=k): only k seeds had a value; n/a: none had (best-val needs data.val_fraction > 0).",
          "", "| " + " | ".join([*varying, "seeds", *shown]) + " |", "|" + "---|" * (len(varying) + 1 + len(shown))]
    for row in rows:
        cells = [str(row[k]) for k in (*varying, "seeds")]
        cells += [_mean_2se_cell(row[m], ".4f" if m in accuracy_cells else ".4g", row["n"][m], row["seeds"])
                  for m in shown]
        md.append("| " + " | ".join(cells) + " |")
    text = "\n".join(md)
    (Path(directory) / "summary.md").write_text(text + "\n")
    with open(Path(directory) / "summary.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*varying, "seeds", *(f"{m}_{s}" for m in (*plain, *both) for s in ("mean", "2se"))])
        for row in rows:
            writer.writerow([row[k] for k in (*varying, "seeds")] + [v for m in (*plain, *both) for v in row[m]])
    return {"rows": rows, "text": text, "varying": varying, "selection": select}


def _mean_2se_cell(stats: tuple[float, float], form: str, n: int, seeds: int) -> str:
    mean, two_se = stats
    if not np.isfinite(mean):
        return "n/a"
    cell = f"{mean:{form}} ± {two_se:{form}}" if np.isfinite(two_se) else f"{mean:{form}}"
    return cell if n == seeds else f"{cell} (n={n})"
