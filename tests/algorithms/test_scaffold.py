"""SCAFFOLD: twice FedAvg's bytes, and it trains under momentum (its client and server steps:
test_references.py)."""

from mpi4py import MPI

from mpifl.report import logical_totals
from mpifl.results import read_results
from tests.conftest import run_engine


def test_control_variates_double_the_bytes(run_algo):
    fedavg, scaffold = run_algo("fedavg"), run_algo("scaffold")
    base, mine = logical_totals(fedavg)["train"], logical_totals(scaffold)["train"]
    assert mine["down"] == {"model": base["down"]["model"], "control": base["down"]["model"]}
    assert mine["up"] == {"delta": base["up"]["delta"], "control_delta": base["up"]["delta"]}


def test_scaffold_with_momentum_trains_as_well_as_fedavg_on_the_quickstart(tmp_path):
    """The quickstart data at client momentum 0.9 (the FedALS paper's optimizer): SCAFFOLD must not diverge
    (with the printed option II its control variates grew tenfold per round: accuracy 0.10 from round 10,
    non-finite deltas by round 40) and must score like FedAvg over the run's last evaluations."""
    from mpifl.registry import load_config
    from tests.conftest import REPO

    scores = {}
    for algorithm in ("fedavg", "scaffold"):
        cfg = load_config(REPO / "configs/quickstart.yaml", [f"algorithm={algorithm}", "client.momentum=0.9",
                                                              "rounds=40"])
        res = read_results(run_engine(cfg, MPI.COMM_SELF, tmp_path / f"{algorithm}.h5"))
        assert res.table("rounds")["rejected_updates"].sum() == 0
        scores[algorithm] = res.table("eval")["global.seen.acc_pooled"][-3:].mean()
    assert scores["fedavg"] > 0.8 and scores["scaffold"] >= scores["fedavg"] - 0.02, scores
