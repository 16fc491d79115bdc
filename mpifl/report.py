"""Reading results files back: a summary (text or JSON) and plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from mpifl.results import Results, flatten, read_results


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError


def logical_totals(results: Results) -> dict[str, dict[str, dict[str, int]]]:
    """Logical bytes by stage → direction → message type."""
    ledger = results.table("ledger")
    attrs = results.table_attrs.get("ledger", {})
    names, directions, stages = attrs.get("message_names", []), attrs.get("directions", []), attrs.get("stages", [])
    out: dict[str, dict[str, dict[str, int]]] = {}
    if not ledger:
        return out
    for m, name in enumerate(names):
        for s, stage in enumerate(stages):
            mask = (ledger["message"] == m) & (ledger["stage"] == s)
            if mask.any():
                out.setdefault(stage, {}).setdefault(directions[m], {})[name] = int(ledger["bytes"][mask].sum())
    return out


def per_client_round(results: Results) -> dict[str, dict[str, dict[str, float]]]:
    """Logical bytes one client received (down) or sent (up) in one round, by stage → direction: min, max,
    mean over the (round, client) pairs that had traffic, and their count. Min = max is the protocol's exact
    per-client cost; a spread shows what varies (rounds that send more, dropped uploads)."""
    ledger = results.table("ledger")
    directions = np.array(results.table_attrs.get("ledger", {}).get("directions", []))
    stages = results.table_attrs.get("ledger", {}).get("stages", [])
    out: dict[str, dict[str, dict[str, float]]] = {}
    if not ledger:
        return out
    for s, stage in enumerate(stages):
        for direction in ("down", "up"):
            mask = (ledger["stage"] == s) & (directions[ledger["message"]] == direction)
            if not mask.any():
                continue
            pairs = np.stack([ledger["round"][mask], ledger["client"][mask]], axis=1)
            _, which = np.unique(pairs, axis=0, return_inverse=True)
            sums = np.bincount(which.ravel(), weights=ledger["bytes"][mask]).astype(np.int64)
            out.setdefault(stage, {})[direction] = {"min": int(sums.min()), "max": int(sums.max()),
                                                    "mean": float(sums.mean()), "count": len(sums)}
    return out


def _per_client_round_line(stage: str, by_dir: dict[str, dict[str, float]]) -> str:
    """One line: the exact bytes where every client-round had the same, else the range and mean."""
    cells = [f"{d} {s['min']:,} B" if s["min"] == s["max"]
             else f"{d} {s['min']:,}–{s['max']:,} B (mean {s['mean']:,.0f})" for d, s in by_dir.items()]
    counts = ", ".join(f"{s['count']} {d}" for d, s in by_dir.items())
    return f"logical {stage} per client-round: {', '.join(cells)} (client-rounds: {counts})"


def selected_row(res: Results, select: str, path: str | Path) -> int:
    """Which evaluation row a selection reports: the last (``final``), or the one with the best validation
    accuracy of the seen clients under the first model kind (``best-val``, the papers' model selection;
    the earliest such row on ties)."""
    ev = res.table("eval")
    if not ev:
        return -1
    if select == "final":
        return len(ev["round"]) - 1
    kinds = list(res.attrs.get("eval_kinds", []))
    key = f"{kinds[0]}.seen.val_acc_pooled" if kinds else ""
    if key not in ev or not np.isfinite(ev[key]).any():
        from mpifl.schema import ConfigError

        raise ConfigError(f"--select best-val: {path} has no validation accuracy (run with data.val_fraction > 0)")
    return int(np.nanargmax(ev[key]))


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
    res = read_results(path)
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


def plot(paths: list[str], output: str) -> None:
    """Accuracy vs rounds, vs cumulative logical bytes and vs simulated time; one line per run,
    model kind and client group (solid: seen clients, dashed: unseen)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    runs = [(path, read_results(path)) for path in paths]
    colors: dict[tuple[str, str], str] = {}
    for path, res in runs:
        ev, rounds = res.table("eval"), res.table("rounds")
        if not ev:
            continue
        sim_time = np.cumsum(rounds["sim_time_s"])[ev["round"].astype(int) - 1]
        xs = (ev["round"], ev["cum_logical_bytes"] / 1e6, sim_time)
        label = f"{Path(path).stem} ({res.attrs.get('algorithm')})"
        for key in sorted(k for k in ev if k.endswith(".acc_pooled") and np.isfinite(ev[k]).any()):
            kind, group = key.split(".")[:2]
            color = colors.setdefault((path, kind), f"C{len(colors)}")  # seen and unseen of one model alike
            for ax, x in zip(axes, xs):
                ax.plot(x, ev[key], "o-" if group == "seen" else "s--", color=color, markersize=3,
                        label=f"{label} {kind} {group}")
    score = "R²" if runs[0][1].attrs.get("task") == "regression" else "accuracy"
    labels = (("round", "rounds"), ("cumulative logical bytes, training (MB)", "communication"),
              ("simulated time (s)", "simulated time"))
    for ax, (xlabel, what) in zip(axes, labels):
        ax.set(xlabel=xlabel, ylabel=f"test {score} (pooled)", title=f"{score} vs {what}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(output, dpi=110)
    plt.close(fig)


def mean_2se(values: np.ndarray) -> tuple[float, float]:
    """Mean and 2·SE (sample standard deviation over √n; NaN for one value) of finite ``values``: the
    spread the seed papers' tables print."""
    values = np.asarray(values, dtype=np.float64)
    values = values[np.isfinite(values)]
    if len(values) == 0:
        return float("nan"), float("nan")
    se = values.std(ddof=1) / np.sqrt(len(values)) if len(values) > 1 else float("nan")
    return float(values.mean()), float(2 * se)


def aggregate(directory: str, select: str = "final") -> dict[str, Any]:
    """Mean ± 2·SE over seeds of every run in ``directory``: runs whose configs differ only in ``seed``
    (and output path) form one row; the columns that name a row are the config keys that differ between
    rows (an algorithm's own options only among that algorithm's runs). Test metrics at each run's final
    evaluation or at its best-validation one (``select``), and the algorithm's diagnostics (see
    :func:`diagnostics`). Writes ``summary.md`` and ``summary.csv`` into
    the directory."""
    import csv

    import yaml

    from mpifl.registry import known_algorithms
    from mpifl.schema import ConfigError

    files = sorted(Path(directory).glob("*.h5"))
    if not files:
        raise ConfigError(f"{directory}: no .h5 results files to aggregate")
    groups: dict[str, list[tuple[dict[str, Any], dict[str, float]]]] = {}
    diagnostic_names: set[str] = set()  # printed with significant digits: they span many magnitudes
    for path in files:
        res = read_results(path)
        config = flatten(res.config)
        key_config = {k: v for k, v in config.items() if k not in ("seed", "output")}
        ev = res.table("eval")
        at = selected_row(res, select, path)
        metrics = {k: float(v[at]) for k, v in ev.items()
                   if k.endswith((".acc_pooled", ".acc_mean")) and ".val_" not in k}
        diags = {name: np.nan if d["value"] is None else d["value"]
                 for table in diagnostics(res, at).values() for name, d in table.items()}
        diagnostic_names.update(diags)
        metrics.update(diags)
        metrics["round"] = float(ev["round"][at]) if ev else float("nan")
        metrics["train_MB"] = float(ev["cum_logical_bytes"][at]) / 1e6 if ev else float("nan")
        groups.setdefault(yaml.safe_dump(key_config, sort_keys=True), []).append((key_config, metrics))
    configs = [runs[0][0] for runs in groups.values()]
    algorithms = set(known_algorithms()) | {str(c.get("algorithm")) for c in configs}  # plug-ins' sections too

    def varies(key: str) -> bool:
        section = key.split(".", 1)[0]
        among = [c for c in configs if section not in algorithms or c.get("algorithm") == section]
        return len({repr(c.get(key)) for c in among}) > 1

    varying = sorted(k for k in set().union(*configs) if varies(k))
    metric_names = sorted(set().union(*(m for runs in groups.values() for _, m in runs)) - {"round", "train_MB"})
    metric_names += ["round", "train_MB"]
    rows = []
    for runs in groups.values():
        row: dict[str, Any] = {k: runs[0][0].get(k, "–") for k in varying}
        row["seeds"] = len(runs)
        for name in metric_names:
            row[name] = mean_2se(np.array([m.get(name, np.nan) for _, m in runs]))
        rows.append(row)
    header = [*varying, "seeds", *metric_names]
    how = "final evaluation" if select == "final" else "evaluation with the best validation accuracy (seen clients)"
    md = [f"Test metrics at each run's {how}; mean ± 2·SE over seeds (sample standard deviation).", "",
          "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for row in rows:
        cells = [str(row[k]) for k in (*varying, "seeds")]
        cells += [_mean_2se_cell(row[m], ".4g" if m in diagnostic_names else ".4f") for m in metric_names]
        md.append("| " + " | ".join(cells) + " |")
    text = "\n".join(md)
    (Path(directory) / "summary.md").write_text(text + "\n")
    with open(Path(directory) / "summary.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*varying, "seeds", *(f"{m}_{s}" for m in metric_names for s in ("mean", "2se"))])
        for row in rows:
            writer.writerow([row[k] for k in (*varying, "seeds")] + [v for m in metric_names for v in row[m]])
    return {"rows": rows, "text": text, "varying": varying, "selection": select}


def _mean_2se_cell(stats: tuple[float, float], form: str) -> str:
    mean, two_se = stats
    if not np.isfinite(mean):
        return "–"
    return f"{mean:{form}} ± {two_se:{form}}" if np.isfinite(two_se) else f"{mean:{form}}"
