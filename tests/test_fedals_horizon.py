"""scripts/fedals_horizon.py, which makes the FedALS 20,000-step table and plot (docs/papers/fedals_feddeper.md),
on a two-seed miniature of its sweep (12 evaluations a run): the paper's metric is the mean of each run's last 10
evaluations, with mean ± 2·SE over seeds, and FedAvg's accuracy at FedALS's whole-run bytes."""

from __future__ import annotations

import subprocess
import sys

import numpy as np

from mpifl.cli import main
from mpifl.results import read_results
from tests.conftest import HANG_S, REPO, sweep_runs_in_this_process


def test_the_horizon_table_is_the_runs_own_numbers(tmp_path):
    out = tmp_path / "sweep"
    with sweep_runs_in_this_process():
        assert main(["sweep", str(REPO / "configs" / "evidence" / "fedals_20k.yaml"), "--seeds", "0", "1",
                     "--output-dir", str(out), "--set", "rounds=24", "--set", "eval_every=2",
                     "--set", "data.dataset=digits"]) == 0
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "fedals_horizon.py"), str(out), "-o",
                           str(tmp_path / "plot.png")], capture_output=True, text=True, timeout=HANG_S, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("| fed")}
    for name in ("fedavg", "fedals_a10"):
        last = [read_results(next(out.glob(f"{name},*seed={s}.h5"))).table("eval")["global.seen.acc_pooled"][-10:]
                .mean() for s in (0, 1)]
        expected = f"{np.mean(last):.4f} ± {2 * np.std(last, ddof=1) / np.sqrt(2):.4f}"
        assert f"| {name} | 2 | {expected} |" in rows[name]
    assert "FedAvg at FedALS α = 10's whole-run bytes" in proc.stdout and (tmp_path / "plot.png").stat().st_size
