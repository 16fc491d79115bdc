"""One run's summary, as text and as data (``mpifl report FILE``): its scores at the selected evaluation, the
algorithm's diagnostics, the logical bytes by stage, direction and message, the physical MPI traffic and where
each rank's time went."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from mpifl.results import Results, read_results
from mpifl.results.guard import inspect_output


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


def epsilon_at(res: Results, eval_row: int | None) -> float:
    """The privacy accountant's ε after the round of evaluation ``eval_row`` (DP runs: ``privacy:``)."""
    rounds = res.table("rounds")
    if eval_row is None:
        return float("nan")
    done = rounds["round"] <= res.table("eval")["round"][eval_row]
    return float(rounds["epsilon"][done][-1]) if done.any() else 0.0


def report(path: str, select: str = "final") -> dict[str, Any]:
    """The summary of the run in results file ``path`` at its ``select`` evaluation (``final`` or ``best-val``), as
    data (what ``--json`` prints) with its text form under ``"text"``."""
    res = read_results(path, ledger=False)
    state = inspect_output(path)
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
        "status": state.condition,  # the file's, except that a dead "running" run is "stopped"
        "standing": state.standing(),
        "resumable_from": state.checkpoint_round if state.unfinished else None,
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
    segments = res.table("segments")
    if segments:
        columns = zip(*(segments[k] for k in ("first_round", "last_round", "world_size", "wall_time_s")))
        summary["segments"] = [{"first_round": int(a), "last_round": int(b), "world_size": int(w),
                                "wall_time_s": float(t)} for a, b, w, t in columns]
    if ev and "epsilon" in rounds:
        summary["epsilon"] = epsilon_at(res, row)
    if ranks:
        summary["time_by_rank"] = time_breakdown(ranks)
    summary["text"] = "\n".join(_summary_lines(summary, res))
    return summary


def _summary_lines(summary: dict[str, Any], res: Results) -> list[str]:
    """The text form of :func:`report`'s ``summary``."""
    final, select = summary["final"], summary["selection"]
    lines = [
        f"{summary['file']}: {summary['algorithm']}, {summary['status']}, {summary['rounds_completed']} rounds on "
        f"{summary['world_size']} rank(s), wall {summary['wall_time_s']:.1f} s, "
        f"simulated {summary['simulated_time_s']:.1f} s",
    ]
    if summary["standing"] is not None:
        lines.append(summary["standing"])
    if len(summary.get("segments", ())) > 1:
        lines.append(f"run in {len(summary['segments'])} segments (a start and its resumes; the wall time above is "
                     "their sum):")
        lines += [f"  rounds {seg['first_round']}-{seg['last_round']} on {seg['world_size']} rank(s), wall "
                  f"{seg['wall_time_s']:.1f} s" for seg in summary["segments"]]
    if final:
        how = "final evaluation" if select == "final" else "evaluation with the best validation accuracy"
        lines.append(f"{how} (round {summary['selected_round']}):")
        for key in sorted(final):
            if key != "cum_logical_bytes" and key not in summary["diagnostics"].get("eval", {}):
                lines.append(f"  {key:<32} {final[key]:.4f}")
    lines += _diagnostic_lines(summary["diagnostics"])
    if "epsilon" in summary:
        lines.append(f"differential privacy: ε = {summary['epsilon']:.4g} at δ = {res.config['privacy']['delta']:g} "
                     f"after round {summary['selected_round']}")
    for stage, by_dir in summary["logical_bytes"].items():
        for direction, by_msg in by_dir.items():
            detail = ", ".join(f"{name} {_bytes(b)}" for name, b in by_msg.items())
            lines.append(f"logical {stage} {direction:<4} {_bytes(sum(by_msg.values())):>10}  ({detail})")
        lines.append(_per_client_round_line(stage, summary["logical_bytes_per_client_round"][stage]))
    lines.append(f"physical MPI traffic       {_bytes(summary['physical_mpi_bytes']):>10}")
    if "time_by_rank" in summary:
        lines += _breakdown_lines(summary["time_by_rank"], res.table("profile"))
    return lines


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
