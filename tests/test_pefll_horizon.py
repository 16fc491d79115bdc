"""scripts/pefll_horizon.py, which makes the PeFLL 500-round margin table (docs/papers/pefll.md), on a two-seed
miniature of its sweep (digits, 4 rounds; PeFLL, FedAvg's global model and kNN-Per's personal ones): each cell is
the runs' own unseen accuracies, PeFLL's margin the per-seed difference, mean ± 2·SE over seeds."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import yaml

from mpifl.cli import main
from mpifl.results import read_results
from tests.conftest import HANG_S, REPO, sweep_runs_in_this_process

MINIATURE = ["rounds=4", "eval_every=2", "checkpoint_every=0", "data.dataset=digits", "data.num_clients=20",
             "data.pad_to=16", "client.steps=2"]
VARIANTS = ("pefll", "fedavg", "knnper")


def test_the_margin_table_is_the_runs_own_numbers(tmp_path):
    out = tmp_path / "sweep"
    spec = yaml.safe_load((REPO / "configs" / "evidence" / "pefll_500.yaml").read_text())
    spec["base"] = str(REPO / "configs" / "evidence" / spec["base"])
    spec["variants"] = [v for v in spec["variants"] if v["name"] in VARIANTS]
    sweep = tmp_path / "pefll_500.yaml"
    sweep.write_text(yaml.safe_dump(spec))
    sets = [a for s in MINIATURE for a in ("--set", s)]
    with sweep_runs_in_this_process():
        assert main(["sweep", str(sweep), "--seeds", "0", "1", "--output-dir", str(out), *sets]) == 0
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "pefll_horizon.py"), str(out), "--rounds", "2", "4"],
                          capture_output=True, text=True, timeout=HANG_S, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    rows = {line.split("|")[1].strip(): line.split("|")[2:4] for line in proc.stdout.splitlines()[2:]}

    def unseen(variant, seed, round_):
        ev = read_results(next(out.glob(f"{variant},*seed={seed}.h5"))).table("eval")
        kind = "personal" if "personal.unseen.acc_pooled" in ev else "global"
        return float(ev[f"{kind}.unseen.acc_pooled"][list(ev["round"]).index(round_)])

    def spread(values, digits, sign=""):
        return f" {np.mean(values):{sign}.{digits}f} ± {2 * np.std(values, ddof=1) / np.sqrt(2):.{digits}f} "

    assert rows["PeFLL (2 seeds)"] == [spread([unseen("pefll", s, r) for s in (0, 1)], 4) for r in (2, 4)]
    assert len(rows) == len(VARIANTS)
    for variant in VARIANTS[1:]:
        margins = [[100 * (unseen("pefll", s, r) - unseen(variant, s, r)) for s in (0, 1)] for r in (2, 4)]
        assert rows[f"PeFLL − {variant} (2 seeds)"] == [spread(m, 1, "+") for m in margins]
