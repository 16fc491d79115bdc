"""`mpifl report` shows each algorithm's own diagnostics, from tiny real runs: Karula's projection certificate,
FedALS's consensus distances, PeFLL's descriptor correlation; per file (text and JSON) and per sweep."""

from __future__ import annotations

import csv
import json

import numpy as np

from mpifl.cli import main
from mpifl.report import aggregate, report
from mpifl.results import read_results
from tests.algorithms.test_karula import KARULA
from tests.algorithms.test_karula import run as run_karula
from tests.algorithms.test_pefll import PEFLL


def test_karula_projection_certificate_per_round(tmp_path):
    path = run_karula(tmp_path, KARULA)
    rounds = read_results(path).table("rounds")
    summary = report(str(path))
    diags = summary["diagnostics"]
    assert set(diags) == {"rounds"}  # nothing at evaluations; the engine's own columns are not the algorithm's
    assert set(diags["rounds"]) == {"proj_delta", "proj_iterations", "proj_max_violation", "proj_seconds",
                                    "estimation_error"}
    for name in ("proj_delta", "proj_iterations", "proj_max_violation"):
        d = diags["rounds"][name]
        assert d["value"] == rounds[name][-1] and d["round"] == 4 and d["rows"] == 4
        assert d["min"] == rounds[name].min() and d["max"] == rounds[name].max()
    line = next(x for x in summary["text"].splitlines() if x.startswith("  proj_iterations "))
    assert f"{rounds['proj_iterations'][-1]:.4g} (round 4)" in line and "(4 rounds)" in line


def test_fedals_consensus_distances_each_at_its_own_frequency(run_algo, tmp_path, capsys):
    res = run_algo("fedals", {"fedals": {"alpha": 2}})  # the extractor is averaged every second round
    rounds = res.table("rounds")
    assert main(["report", "--json", str(tmp_path / "fedals_p0.h5")]) == 0
    diags = json.loads(capsys.readouterr().out)["diagnostics"]["rounds"]
    assert set(diags) == {"consensus_layer01", "consensus_layer02"}  # the MLP's hidden and output layers
    assert diags["consensus_layer01"]["rows"] == 2 and diags["consensus_layer02"]["rows"] == 4
    extractor = rounds["consensus_layer01"]
    assert np.isnan(extractor[2]) and diags["consensus_layer01"]["value"] == extractor[3]
    assert diags["consensus_layer01"]["min"] == np.nanmin(extractor)


def test_pefll_descriptor_correlation_at_the_reported_evaluation(run_algo, tmp_path):
    res = run_algo("pefll", PEFLL)
    ev = res.table("eval")
    summary = report(str(tmp_path / "pefll_p0.h5"))
    diags = summary["diagnostics"]
    assert set(diags["eval"]) == {"descriptor_spearman_seen", "descriptor_spearman_unseen"}
    seen = diags["eval"]["descriptor_spearman_seen"]
    assert seen["value"] == ev["descriptor_spearman_seen"][-1] and seen["round"] == PEFLL["rounds"]
    assert set(diags["rounds"]) == {"update_norm"}
    text = summary["text"].splitlines()
    section = text.index(next(x for x in text if x.startswith("algorithm diagnostics per evaluation")))
    assert text[section + 1].startswith("  descriptor_spearman_seen ")
    assert sum(x.startswith("  descriptor_spearman_seen ") for x in text) == 1  # not again among the accuracies


def test_sweep_summary_averages_the_diagnostics_over_seeds(tmp_path):
    paths = [run_karula(tmp_path, {**KARULA, "seed": seed}, tag=f"seed{seed}") for seed in (2, 3)]
    last = [read_results(p).table("rounds")["proj_iterations"][-1] for p in paths]
    aggregate(str(tmp_path))
    with open(tmp_path / "summary.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert row["seeds"] == "2" and float(row["proj_iterations_mean"]) == np.mean(last)
    assert "proj_delta" in (tmp_path / "summary.md").read_text()
