"""Sweeps expand grid × seeds into runs; ``report DIR`` aggregates them over seeds."""

import csv

import numpy as np
import pytest
import yaml

from mpifl.cli import main
from mpifl.report import report
from mpifl.results import read_results
from mpifl.schema import ConfigError
from mpifl.sweep import load_sweep


def write_sweep(tmp_path, config, grid, seeds=(0, 1)):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": str(config), "output_dir": str(tmp_path / "out"), "seeds": list(seeds),
                                    "grid": grid}))
    return path


def test_grid_times_seeds_expands_and_is_validated(write_config, tmp_path):
    grid = {"algorithm": ["fedavg", "local"], "client.lr": [0.1, 0.2]}
    sweep = write_sweep(tmp_path, write_config(), grid, (0, 1, 2))
    _, spec, runs = load_sweep(sweep)
    assert len(runs) == 12 and len({r.output for r in runs}) == 12
    assert runs[0].overrides == ("algorithm=fedavg", "client.lr=0.1", "seed=0")
    bad = write_sweep(tmp_path, write_config(), {"client.lr": [-1]})
    with pytest.raises(ConfigError, match="client.lr: must be > 0"):
        load_sweep(bad)


def test_sweep_runs_and_report_aggregates_over_seeds(write_config, tmp_path, capsys):
    sweep = write_sweep(tmp_path, write_config({"rounds": 2}), {"algorithm": ["fedavg", "local"]})
    assert main(["sweep", str(sweep)]) == 0
    assert main(["report", str(tmp_path / "out")]) == 0
    table = capsys.readouterr().out
    assert "| algorithm | seeds |" in table and "| fedavg | 2 |" in table and "| local | 2 |" in table
    with open(tmp_path / "out" / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    by_algo = {r["algorithm"]: r for r in rows}
    assert float(by_algo["local"]["train_MB_mean"]) == 0 and float(by_algo["fedavg"]["train_MB_mean"]) > 0
    finals = [read_results(f).table("eval")["global.seen.acc_pooled"][-1]
              for f in sorted((tmp_path / "out").glob("algorithm=fedavg*.h5"))]
    assert len(finals) == 2 and finals[0] != finals[1]
    # mean ± 2·SE with the sample standard deviation (ddof = 1), as the seed papers' tables
    assert float(by_algo["fedavg"]["global.seen.acc_pooled_mean"]) == pytest.approx(np.mean(finals))
    assert float(by_algo["fedavg"]["global.seen.acc_pooled_2se"]) == pytest.approx(
        2 * np.std(finals, ddof=1) / np.sqrt(2))


def test_report_selects_the_best_validation_round(write_config, tmp_path, capsys):
    """``--select best-val`` reports every run at its evaluation with the best validation accuracy of the seen
    clients (the PeFLL and pFedHN papers' model selection), for one file and over seeds."""
    config = write_config({"rounds": 6, "eval_every": 1, "data": {"val_fraction": 0.2}, "client": {"lr": 0.3}})
    sweep = write_sweep(tmp_path, config, {"client.lr": [0.3]})
    assert main(["sweep", str(sweep)]) == 0
    files = sorted((tmp_path / "out").glob("*.h5"))
    chosen = []
    for path in files:
        ev = read_results(path).table("eval")
        best = int(np.argmax(ev["global.seen.val_acc_pooled"]))
        chosen.append(ev["global.seen.acc_pooled"][best])
        summary = report(str(path), "best-val")
        assert summary["selected_round"] == ev["round"][best]
        assert summary["final"]["global.seen.acc_pooled"] == ev["global.seen.acc_pooled"][best]
    assert len(set(chosen)) > 1 or len(files) == 1
    assert main(["report", str(tmp_path / "out"), "--select", "best-val"]) == 0
    assert "best validation accuracy" in capsys.readouterr().out
    with open(tmp_path / "out" / "summary.csv") as f:
        row, = csv.DictReader(f)
    assert float(row["global.seen.acc_pooled_mean"]) == pytest.approx(np.mean(chosen))
    plain = tmp_path / "plain.h5"
    assert main(["run", str(write_config({"rounds": 2})), "--out", str(plain), "--quiet"]) == 0
    assert main(["report", str(plain), "--select", "best-val"]) == 2
    assert "has no validation accuracy (run with data.val_fraction > 0)" in capsys.readouterr().err


def test_slurm_array_script(write_config, tmp_path):
    sweep = write_sweep(tmp_path, write_config(), {"algorithm": ["fedavg", "local"]})
    assert main(["sweep", str(sweep), "--slurm"]) == 0
    script = (tmp_path / "out" / "sweep.sbatch").read_text()
    assert "#SBATCH --array=0-3" in script and "srun" in script
    assert '--set "threads_per_rank=${SLURM_CPUS_PER_TASK:-1}" "$@")' in script  # a run's own --set wins
    assert len((tmp_path / "out" / "runs.txt").read_text().splitlines()) == 4
