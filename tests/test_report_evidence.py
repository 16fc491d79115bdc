"""The evidence tools on a real tiny sweep (2 configs × 2 seeds, and one lone run without validation rows):
``report DIR`` shows test accuracy at the best-validation and at the final evaluation, mean ± 2·SE over seeds,
checked against the results files with numpy; ``plot DIR`` draws one mean curve and one ±2·SE band per group,
model kind and client group, and ``--metric`` FedALS's per-layer consensus distances."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import yaml
from matplotlib.collections import PolyCollection

from mpifl.cli import main
from mpifl.report import aggregate, plot
from mpifl.results import read_results
from tests.conftest import run_config, sweep_runs_in_this_process

TINY = {
    "rounds": 4,
    "clients_per_round": 6,
    "eval_every": 1,
    "data": {"dataset": "digits", "num_clients": 8, "partition": "shards", "shards_per_client": 2,
             "unseen_fraction": 0.25, "val_fraction": 0.2},
    "model": {"name": "mlp", "hidden": [16]},
    "client": {"lr": 0.3, "batch_size": 16, "steps": 4},  # pFedMe's validation accuracy peaks before the end
    "fedals": {"alpha": 2},
    "pfedme": {"inner_steps": 2},
}


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory):
    """FedALS and pFedMe (personal and global models) × seeds 0 and 1 through ``mpifl sweep``, plus one FedALS
    run (α = 1) without validation rows, whose best-validation cells must read n/a."""
    root = tmp_path_factory.mktemp("evidence")
    base = root / "base.yaml"
    base.write_text(yaml.safe_dump({"algorithm": "fedavg", **TINY}))
    sweep = root / "sweep.yaml"
    sweep.write_text(yaml.safe_dump({"base": str(base), "output_dir": str(root / "out"), "seeds": [0, 1],
                                     "grid": {"algorithm": ["fedals", "pfedme"]}}))
    with sweep_runs_in_this_process():
        assert main(["sweep", str(sweep)]) == 0
    lone = root / "lone.yaml"
    lone.write_text(yaml.safe_dump({**TINY, "algorithm": "fedals", "fedals": {"alpha": 1},
                                    "data": {**TINY["data"], "val_fraction": 0.0}}))
    run_config(lone, root / "out" / "lone.h5")
    return root / "out"


def runs_of(directory, algorithm, val=True):
    """The results of ``algorithm``'s runs in ``directory`` with (or without) validation rows, by file name."""
    runs = [read_results(p) for p in sorted(directory.glob("*.h5"))]
    return [r for r in runs if r.attrs["algorithm"] == algorithm
            and any(k.endswith(".val_acc_pooled") for k in r.table("eval")) == val]


def expected(values):
    return np.mean(values), 2 * np.std(values, ddof=1) / np.sqrt(len(values))


def test_report_shows_both_selections_over_seeds(sweep_dir, capsys):
    summary = aggregate(str(sweep_dir))
    rows = {", ".join(f"{k}={r[k]}" for k in summary["varying"]): r for r in summary["rows"]}
    assert set(rows) == {"algorithm=fedals, data.val_fraction=0.2, fedals.alpha=2",
                         "algorithm=pfedme, data.val_fraction=0.2, fedals.alpha=–",  # not pFedMe's option
                         "algorithm=fedals, data.val_fraction=0.0, fedals.alpha=1"}
    moved = 0
    for algorithm, keys in (("fedals", ["global"]), ("pfedme", ["personal", "global"])):
        runs = runs_of(sweep_dir, algorithm)
        row = rows[f"algorithm={algorithm}, data.val_fraction=0.2, fedals.alpha={2 if algorithm == 'fedals' else '–'}"]
        assert len(runs) == 2 and row["seeds"] == 2
        for res in runs:  # the best-val round is chosen by the first model kind's seen validation accuracy
            assert res.attrs["eval_kinds"][0] == keys[0]
        best = [int(np.argmax(r.table("eval")[f"{keys[0]}.seen.val_acc_pooled"])) for r in runs]
        moved += sum(b != len(r.table("eval")["round"]) - 1 for b, r in zip(best, runs))
        for kind in keys:
            for metric in (f"{kind}.seen.acc_pooled", f"{kind}.unseen.acc_pooled", f"{kind}.unseen.acc_mean"):
                final = [r.table("eval")[metric][-1] for r in runs]
                at_best = [r.table("eval")[metric][b] for r, b in zip(runs, best)]
                assert row[f"{metric}@final"] == pytest.approx(expected(final))
                assert row[f"{metric}@best-val"] == pytest.approx(expected(at_best))
                assert row[metric] == row[f"{metric}@final"]  # plain names: the --select one
                mean, two_se = expected(at_best)
                assert f"{mean:.4f} ± {two_se:.4f}" in summary["text"]
        assert row["round@best-val"] == pytest.approx(expected([b + 1.0 for b in best]))
    assert moved > 0, "every run's best-validation round was its last: the test could not tell the two apart"
    lone = rows["algorithm=fedals, data.val_fraction=0.0, fedals.alpha=1"]
    assert lone["seeds"] == 1 and np.isnan(lone["global.seen.acc_pooled@best-val"][0])
    final = runs_of(sweep_dir, "fedals", val=False)[0].table("eval")["global.unseen.acc_pooled"][-1]
    assert lone["global.unseen.acc_pooled@final"][0] == pytest.approx(final)
    line = next(x for x in summary["text"].splitlines() if x.startswith("| fedals | 0.0 | 1 | 1 |"))
    assert line.count("n/a") >= 4 and f"{final:.4f}" in line

    # the command: the table once, --json complete, and --select best-val lists best-val first, under plain names
    assert main(["report", str(sweep_dir), "--json"]) == 0
    parsed = json.loads(capsys.readouterr().out)
    assert len(parsed["rows"]) == 3 and all(len(r["files"]) == r["seeds"] for r in parsed["rows"])
    assert main(["report", str(sweep_dir), "--select", "best-val"]) == 0
    header = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("| algorithm"))
    assert header.index("global.seen.acc_pooled@best-val") < header.index("global.seen.acc_pooled@final")
    with open(sweep_dir / "summary.csv") as f:
        by_algo = {(r["algorithm"], r["data.val_fraction"]): r for r in csv.DictReader(f)}
    pfedme = by_algo[("pfedme", "0.2")]
    assert pfedme["personal.seen.acc_pooled_mean"] == pfedme["personal.seen.acc_pooled@best-val_mean"]
    assert by_algo[("fedals", "0.0")]["global.seen.acc_pooled_mean"] == "nan"


def bands(fig):
    return [c for ax in fig.axes for c in ax.collections if isinstance(c, PolyCollection)]


def test_plot_draws_mean_curves_with_bands(sweep_dir, tmp_path):
    png = tmp_path / "sweep.png"
    fig = plot([str(sweep_dir)], str(png))
    assert png.stat().st_size > 20_000
    # per axis (rounds, bytes, simulated time): FedALS 2 lines (global seen/unseen), pFedMe 4 (personal and
    # global), the lone run 2; bands only where two seeds give a spread
    assert [len(ax.lines) for ax in fig.axes] == [8, 8, 8]
    assert len(bands(fig)) == 3 * (2 + 4)
    runs = runs_of(sweep_dir, "pfedme")
    rounds_ax, bytes_ax, _ = fig.axes
    line = next(x for x in rounds_ax.lines if x.get_label().startswith("algorithm=pfedme")
                and x.get_label().endswith("personal unseen"))
    assert line.get_linestyle() == "--" and "(2 seeds)" in line.get_label()
    values = np.array([r.table("eval")["personal.unseen.acc_pooled"] for r in runs])
    assert np.allclose(line.get_ydata(), values.mean(axis=0))
    assert np.array_equal(line.get_xdata(), runs[0].table("eval")["round"])
    same = next(x for x in bytes_ax.lines if x.get_label() == line.get_label())
    assert np.allclose(same.get_xdata(), runs[0].table("eval")["cum_logical_bytes"] / 1e6)
    mean, two_se = values.mean(axis=0), 2 * values.std(axis=0, ddof=1) / np.sqrt(2)
    extent = [(v[:, 1].min(), v[:, 1].max()) for b in bands(fig) if b.axes is rounds_ax
              for v in [b.get_paths()[0].vertices]]
    assert any(np.allclose(e, ((mean - two_se).min(), (mean + two_se).max())) for e in extent)
    assert all(ax.get_title().endswith("(mean ± 2·SE over seeds)") for ax in fig.axes)


def test_a_single_seed_plot_says_it_averages_nothing(sweep_dir, tmp_path):
    """The quickstart's case (issue 45 row 13): one run per curve, so no title may promise a mean over seeds."""
    lone = sorted(sweep_dir.glob("*.h5"))[0]
    fig = plot([str(lone)], str(tmp_path / "one.png"))
    assert [ax.get_title() for ax in fig.axes] == [f"accuracy vs {what} (one seed, no average)"
                                                    for what in ("rounds", "communication", "simulated time")]


def test_plot_metric_consensus_per_layer(sweep_dir, tmp_path, capsys):
    png = tmp_path / "consensus.png"
    fig = plot([str(sweep_dir)], str(png), "consensus_layer*", log_y=True)
    panels = [ax for ax in fig.axes if ax.get_visible()]
    titles = [ax.get_title().replace("\n", " ") for ax in panels]  # wrapped to the panel's width
    assert titles == ["algorithm=fedals, data.val_fraction=0.2, fedals.alpha=2 (2 seeds)",
                      "algorithm=fedals, data.val_fraction=0.0, fedals.alpha=1 (1 seed)"]
    assert [[x.get_label() for x in ax.lines] for ax in panels] == [["consensus_layer01", "consensus_layer02"]] * 2
    assert len(bands(fig)) == 2 and panels[0].get_yscale() == "log"
    runs = runs_of(sweep_dir, "fedals")
    extractor = np.array([r.table("rounds")["consensus_layer01"] for r in runs])  # averaged every α = 2 rounds
    drawn = panels[0].lines[0]
    assert np.array_equal(drawn.get_xdata(), [2, 4]) and np.allclose(drawn.get_ydata(), extractor[:, 1::2].mean(0))
    assert main(["plot", str(sweep_dir), "-o", str(tmp_path / "x.png"), "--metric", "descriptor_*"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpifl: error: --metric descriptor_*: no rounds or eval column matches") and \
        "consensus_layer01" in err


def test_a_plot_of_an_unfinished_run_says_where_it_stands(write_config, tmp_path, capsys):
    """A run stopped after round 1 of 5 (as by SIGTERM): the figure's title and the terminal say so, as report
    does; a completed run beside it adds nothing."""
    import signal

    from mpi4py import MPI

    from mpifl.registry import load_config
    from mpifl.runtime.engine import Engine
    from mpifl.runtime.stopping import StopRequest

    config = write_config({"rounds": 5, "eval_every": 1})
    out = tmp_path / "stopped.h5"
    engine = Engine(load_config(config), MPI.COMM_SELF, out)
    engine.prepare()
    stop = StopRequest(announce=False)
    stop.signum = signal.SIGTERM  # asked before round 1 ends: the run stops after it
    assert engine.run(progress=False, stop=stop) == 1
    done = tmp_path / "done.h5"
    assert main(["run", str(config), "--out", str(done), "--quiet", "--set", "seed=8"]) == 0
    unfinished: list[str] = []
    fig = plot([str(out), str(done)], str(tmp_path / "both.png"), unfinished=unfinished)
    assert unfinished == ["stopped.h5: interrupted at round 1 of 5"]
    assert fig._suptitle is not None and "interrupted at round 1 of 5" in fig._suptitle.get_text()
    capsys.readouterr()
    assert main(["plot", str(out), "-o", str(tmp_path / "one.png")]) == 0
    assert capsys.readouterr().out.splitlines() == ["not completed: stopped.h5: interrupted at round 1 of 5",
                                                    f"wrote {tmp_path / 'one.png'}"]
