"""Plots of runs (``mpifl plot``): accuracy against rounds, bytes and simulated time, or any recorded column, as
the mean over seeds with a ±2·SE band."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from textwrap import fill
from typing import TYPE_CHECKING

import numpy as np

from mpifl.report.seeds import RunGroup, group_runs, mean_2se
from mpifl.results import check_writable
from mpifl.results.guard import inspect_output, refuse_existing
from mpifl.results.space import written_whole
from mpifl.schema import ConfigError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

def plot(paths: Sequence[str | Path], output: str, metric: str | None = None, log_y: bool = False,
         overwrite: bool = False, unfinished: list[str] | None = None) -> Figure:
    """Test accuracy against rounds, cumulative logical training bytes and simulated time: for each group of runs
    that differ only in seed (:func:`group_runs`; a directory gives every run in it), the mean over seeds with a
    ±2·SE band, one colour per group and model kind, seen clients solid, unseen dashed. With ``metric`` (a rounds
    or eval column, or a glob such as ``consensus_layer*``): that column against rounds instead, one panel per
    group and one line per matching column (FedALS's per-layer consensus distances, the paper's Fig. 1). Writes
    ``output`` (an existing file only if ``overwrite``) and returns the figure, whose lines and bands are what was
    drawn. A run that did not complete is named in the figure's title with where it stands ("stopped at round 100
    of 300", as ``report`` says), and in ``unfinished`` where given (the command line prints it)."""
    check_image_output(output, overwrite)
    groups, _ = group_runs(paths)
    fig = _metric_figure(groups, metric) if metric else _accuracy_figure(groups)
    notes = [f"{path.name}: {state.where()}" for group in groups for path, _ in group.runs
             for state in [inspect_output(path)] if state.unfinished]
    if notes:
        fig.suptitle(fill("not completed: " + "; ".join(notes), 140), fontsize=9, color="firebrick")
        if unfinished is not None:
            unfinished.extend(notes)
    if log_y:
        for ax in fig.axes:
            ax.set_yscale("log")
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    key = MARKED.get(Path(output).suffix.lower())
    with written_whole(output, "the plot") as tmp:
        fig.savefig(tmp, dpi=110, metadata={key: PLOT_MARK} if key else None, format=Path(output).suffix[1:].lower())
    return fig


PLOT_MARK = "mpifl plot"
"""Written into an image's metadata: ``plot --overwrite`` replaces a .png, .pdf or .svg only if it carries it."""
MARKED = {".png": "Software", ".pdf": "Creator", ".svg": "Creator"}  # the formats with metadata, and their key


def is_plot(path: Path) -> bool:
    """Whether ``path`` is an image ``mpifl plot`` wrote (its metadata holds :data:`PLOT_MARK`)."""
    with open(path, "rb") as f:
        return PLOT_MARK.encode() in f.read(64 << 20)


def check_image_output(output: str, overwrite: bool) -> None:
    """Refuse, before any results are read, an image path that saving would fail on or that holds a file: an
    extension matplotlib cannot write (it names the format), a place that cannot be written, an existing file
    unless ``overwrite``."""
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    suffix = Path(output).suffix.lower().removeprefix(".")
    if suffix not in formats:
        what = f"'.{suffix}' is not an image format matplotlib writes" if suffix else "no file extension"
        raise ConfigError(f"-o {output}: {what}; give one of {', '.join('.' + f for f in sorted(formats))}")
    check_writable(output)
    refuse_existing(output, overwrite, ours=is_plot if Path(output).suffix.lower() in MARKED else None)


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


def averaging(most_seeds: int) -> str:
    """What a panel's curves show: one seed's values, or (with several seeds in some group) a mean and its band."""
    return "one seed, no average" if most_seeds == 1 else "mean ± 2·SE over seeds"


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
    averaged = averaging(max((len(g.runs) for g in groups), default=1))
    for ax, (xlabel, what) in zip(axes, labels):
        ax.set(xlabel=xlabel, ylabel=f"test {score} (pooled)", title=f"{score} vs {what} ({averaged})")
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

    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

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
