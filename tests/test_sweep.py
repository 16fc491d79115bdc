"""Sweeps expand grid × seeds into runs; ``report DIR`` aggregates them over seeds."""

import csv

import pytest
import yaml

from mpifl.cli import main
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
    assert 0 <= float(by_algo["fedavg"]["global.seen.acc_pooled_mean"]) <= 1


def test_slurm_array_script(write_config, tmp_path):
    sweep = write_sweep(tmp_path, write_config(), {"algorithm": ["fedavg", "local"]})
    assert main(["sweep", str(sweep), "--slurm"]) == 0
    script = (tmp_path / "out" / "sweep.sbatch").read_text()
    assert "#SBATCH --array=0-3" in script and "srun" in script
    assert len((tmp_path / "out" / "runs.txt").read_text().splitlines()) == 4
