"""SCAFFOLD: twice FedAvg's bytes, and it trains under momentum (its client and server steps:
test_references.py)."""

import numpy as np
from mpi4py import MPI

from mpifl.report import logical_totals
from mpifl.results import read_results
from tests.algorithms.conftest import both_sides, walk
from tests.algorithms.test_references import SAMPLED, TOL, config, data
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


def test_uniform_weighting_averages_the_model_over_the_cohort_and_c_over_the_population():
    """``server.weighting: uniform`` with unequal clients (6 to 12 samples): x ← x + (1/|S|)·Σ_S Δyᵢ and, as in
    the paper's Algorithm 1, c ← c + (1/N)·Σ_S Δcᵢ with N = 4 clients; so c stays the plain mean of every
    client's cᵢ (client 1 never trains: its cᵢ stays 0)."""
    cfg = config("scaffold", server={"weighting": "uniform"})
    _, server, client = both_sides(cfg)
    sizes = [len(xy[1]) for xy in data(cfg).values()]
    assert len(sizes) == 4 and len(set(sizes)) > 1  # sample weights would give other numbers
    for round_ in (1, 2):  # round 2 from nonzero c
        x, c = server.params.astype(np.float64), server.control.astype(np.float64)
        rows = walk(server, client, server.protocol.train_plan(round_), round_, SAMPLED)
        delta_y, delta_c = rows["delta"].astype(np.float64), rows["control_delta"].astype(np.float64)
        np.testing.assert_allclose(server.params, x + (delta_y[0] + delta_y[1] + delta_y[2]) / 3, **TOL)
        np.testing.assert_allclose(server.control, c + (delta_c[0] + delta_c[1] + delta_c[2]) / 4, **TOL)
    own = [client.own_control(i).numpy().astype(np.float64) for i in range(4)]
    assert not own[1].any()
    np.testing.assert_allclose(server.control, (own[0] + own[1] + own[2] + own[3]) / 4, **TOL)


def test_a_received_row_goes_to_the_device_once_a_step_and_afresh_in_the_next():
    """``ClientToolkit.on_device``: every client's view of one broadcast row shares one device copy; the next step's
    row is copied afresh even where it arrives in the same memory with new values (on one rank the server's own
    array arrives, and IFCA's server changes its models between a round's training and its evaluation)."""
    from mpifl.algorithms.context import StepContext

    _, _, client = both_sides(config("scaffold"))
    sent = np.arange(4, dtype=np.float32)
    train, evaluate = StepContext(1, "train", np.arange(3)), StepContext(1, "eval", np.arange(3))
    first = client.on_device(train, sent[:])
    assert client.on_device(train, sent[:]) is first  # another client's view of the same broadcast
    sent += 10  # the server changes its array in place
    again = client.on_device(evaluate, sent[:])
    assert again is not first and np.array_equal(again.numpy(), sent) and np.array_equal(first.numpy(), sent - 10)
