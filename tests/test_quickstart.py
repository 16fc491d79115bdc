"""The README's main job (scripts/quickstart.sh) kept from rotting: its config and algorithms, run as the script
runs them (3 ranks) but for 2 rounds, then its report and plot."""

import re

import h5py

from mpifl.cli import main
from mpifl.report import report
from tests.conftest import REPO, run_mpifl_batch


def script_jobs() -> tuple[str, list[str]]:
    """The config and the algorithms scripts/quickstart.sh runs."""
    text = (REPO / "scripts/quickstart.sh").read_text()
    config = re.search(r"jobs/run_local\.sh (configs/\S+\.yaml)", text)
    algorithms = re.search(r"for algorithm in ([\w ]+); do", text)
    assert config and algorithms, "scripts/quickstart.sh no longer runs 'for algorithm in ...' over one config"
    return config.group(1), algorithms.group(1).split()


def test_quickstart_compares_pefll_and_fedavg_with_exact_bytes_per_client(tmp_path):
    config, algorithms = script_jobs()
    assert algorithms == ["pefll", "fedavg"]
    outs, summaries = [str(tmp_path / f"quickstart_{algorithm}.h5") for algorithm in algorithms], {}
    jobs = [["run", config, "--set", f"algorithm={algorithm}", "--set", "rounds=2", "--set", "eval_every=1",
             "--out", out] for algorithm, out in zip(algorithms, outs)]
    for algorithm, out, proc in zip(algorithms, outs, run_mpifl_batch(jobs, 3, tmp_path / "launch")):  # one launch
        assert proc.returncode == 0, proc.stderr
        assert f"mpifl: {algorithm} on digits, 50 clients, 3 rank(s), 2 rounds" in proc.stdout
        summaries[algorithm] = report(out)
        text = summaries[algorithm]["text"]
        assert re.search(r"^logical train per client-round: down [\d,]+ B, up [\d,]+ B", text, re.M), text
    with h5py.File(outs[1]) as f:
        d = f["model/global_model"].size
    fedavg = summaries["fedavg"]["logical_bytes_per_client_round"]["train"]
    assert fedavg["down"] == fedavg["up"] == {"min": 4 * d, "max": 4 * d, "mean": 4 * d, "count": 2 * 5}
    for summary in summaries.values():
        train = summary["logical_bytes_per_client_round"]["train"]
        for direction, per_client in train.items():  # the per-client view adds up to the totals
            assert per_client["min"] == per_client["max"]
            assert per_client["min"] * per_client["count"] == sum(summary["logical_bytes"]["train"][direction].values())
        assert summary["simulated_time_s"] > 0
        assert {"seen", "unseen"} <= {key.split(".")[1] for key in summary["final"] if key.endswith(".acc_pooled")}
    pefll = summaries["pefll"]["logical_bytes_per_client_round"]["train"]
    assert pefll["down"]["min"] > 4 * d  # the model and the embedding net
    png = tmp_path / "quickstart.png"
    assert main(["plot", *outs, "-o", str(png)]) == 0
    assert png.stat().st_size > 10_000
