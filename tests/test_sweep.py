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


def test_variants_times_grid_times_seeds_with_cli_overrides(write_config, tmp_path, capsys):
    """Each variant carries its own settings into every grid point and seed; run names stay unique and readable;
    ``--set``, ``--seeds`` and ``--output-dir`` shrink or move a sweep for a smoke test."""
    path = tmp_path / "sweep.yaml"
    variants = [{"name": "fedavg", "set": {"algorithm": "fedavg"}},
                {"set": {"algorithm": "local", "local.mode": "all"}}]
    path.write_text(yaml.safe_dump({"base": str(write_config()), "output_dir": str(tmp_path / "out"),
                                    "seeds": [0, 1], "variants": variants, "grid": {"client.lr": [0.1, 0.2]}}))
    _, _, runs = load_sweep(path)
    assert [r.name for r in runs[:2]] == ["fedavg,client.lr=0.1,seed=0", "fedavg,client.lr=0.1,seed=1"]
    assert runs[-1].name == "algorithm=local,local.mode=all,client.lr=0.2,seed=1" and len(runs) == 8
    assert runs[-1].overrides == ("algorithm=local", "local.mode=all", "client.lr=0.2", "seed=1")
    _, spec, smoke = load_sweep(path, ["rounds=2"], [3], str(tmp_path / "smoke"))
    assert len(smoke) == 4 and spec.output_dir == str(tmp_path / "smoke")
    assert smoke[0].overrides == ("algorithm=fedavg", "client.lr=0.1", "rounds=2", "seed=3")
    assert smoke[0].output == tmp_path / "smoke" / "fedavg,client.lr=0.1,seed=3.h5"
    assert main(["sweep", str(path), "--dry-run", "--set", "rounds=2", "--seeds", "5"]) == 0
    out = capsys.readouterr().out
    assert "[4/4] algorithm=local,local.mode=all,client.lr=0.2,seed=5" in out
    assert "--set local.mode=all --set client.lr=0.2 --set rounds=2 --set seed=5" in out


@pytest.mark.parametrize("variants, message", [
    ([{"name": "a", "set": {"algorithm": "fedavg"}}, {"name": "a", "set": {"algorithm": "local"}}],
     r"sweep.variants\[1\]: the name 'a' is used twice"),
    ([{"set": {}}], r"sweep.variants\[0\]: give it a name or a non-empty set"),
    ([{"name": "x", "sets": {}}], r"sweep.variants\[0\]: unknown key 'sets' \(did you mean 'set'\?\)"),
    ([{"name": "bad", "set": {"client.lr": -1}}], "sweep run client.lr=-1 seed=0: client.lr: must be > 0"),
])
def test_bad_variants_are_one_error_line(write_config, tmp_path, capsys, variants, message):
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump({"base": str(write_config()), "output_dir": str(tmp_path / "out"),
                                    "variants": variants}))
    with pytest.raises(ConfigError, match=message):
        load_sweep(path)
    assert main(["sweep", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mpifl: error: sweep") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
