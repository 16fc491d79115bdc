"""FedAsync: the server's mixing against hand-derived numbers for each staleness function, and a real run whose
every step is one arrival mixed in. Resume, rank invariance and the fault matrix: tests/test_checkpoint.py and
tests/mpi/ (CONFIGS["fedasync"])."""

import numpy as np
import pytest

from mpifl.algorithms.base import StepContext
from mpifl.results import read_results
from mpifl.runtime.asynchronous import Events
from tests.algorithms.conftest import _merge, both_sides
from tests.conftest import run_engine
from tests.test_checkpoint import CONFIGS

FEDASYNC = CONFIGS["fedasync"]


def server_with(**options):  # noqa: ANN003, ANN201
    """The server, with rank 0's events beside it (``server.events``, as the runtime keeps them)."""
    _, server, _ = both_sides(_merge(FEDASYNC, {"fedasync": options}))
    server.params = np.array([1.0, -2.0, 4.0, 0.5], dtype=np.float32)  # a model small enough to mix by hand
    server.events = Events(server.protocol.concurrency)
    return server


def next_arrival(server) -> bool:  # noqa: ANN001
    """The runtime's arrival: the clock moves to the next client in flight, whose upload the server takes."""
    return server.arrive(server.events.arrive())


def arrive(server, client: int, at: float, model: list[float] | None) -> None:  # noqa: ANN001
    """Dispatch ``client`` now, deliver its model (``None``: it never comes), and take its arrival."""
    server.events.dispatch(np.array([client]), np.array([at]))
    server.dispatch(np.array([client]))
    if model is not None:
        server.consume(server.protocol.upload_msg, StepContext(1, "train", np.array([client])),
                       np.array([model], dtype=np.float32))


def test_polynomial_staleness_by_hand():
    """α = 0.5, s(τ) = (1 + τ)^(−0.5). Clients 1 and 2 leave at version 0; 2 arrives first (τ = 0, α_τ = 0.5):
    θ = 0.5·[1, −2, 4, 0.5] + 0.5·[3, 0, 0, 0.5] = [2, −1, 2, 0.5]. Client 1 arrives one step later (τ = 1,
    α_τ = 0.5/√2 = 0.35355339...): θ = (1 − α_τ)·[2, −1, 2, 0.5] + α_τ·[−2, 2, 2, 2.5]."""
    server = server_with(alpha=0.5, staleness="polynomial", a=0.5)
    arrive(server, 1, 3.0, [-2.0, 2.0, 2.0, 2.5])
    arrive(server, 2, 1.0, [3.0, 0.0, 0.0, 0.5])
    assert next_arrival(server) and server.events.now_s == 1.0 and server.version == 1
    assert server.params.tolist() == [2.0, -1.0, 2.0, 0.5]
    assert next_arrival(server) and server.events.now_s == 3.0 and server.version == 2
    alpha = 0.35355339059327373
    expected = [2 - 4 * alpha, -1 + 3 * alpha, 2.0, 0.5 + 2 * alpha]  # θ + α_τ·(θᵢ − θ)
    assert server.params == pytest.approx(np.array(expected, dtype=np.float32), abs=2e-7)
    assert server.round_metrics() == {"staleness": 1.0, "mixing_weight": pytest.approx(alpha, rel=1e-15),
                                      "updates_applied": 1.0, "server_version": 2.0}


@pytest.mark.parametrize(("staleness", "tau", "weight"), [
    ("constant", 5, 1.0), ("hinge", 2, 1.0), ("hinge", 3, 1 / (2 * (3 - 2) + 1)), ("hinge", 6, 1 / (2 * 4 + 1))])
def test_constant_and_hinge_staleness_by_hand(staleness, tau, weight):
    """s(τ) = 1, and the hinge with a = 2, b = 2: 1 up to τ = 2, then 1/(2·(τ − 2) + 1); a model of all 1 mixed
    into zeros gives α·s(τ) everywhere (α = 0.8)."""
    server = server_with(alpha=0.8, staleness=staleness, a=2.0, b=2)
    server.params = np.zeros(4, dtype=np.float32)
    server.version = tau  # the client downloaded version 0, τ steps ago
    server.downloaded[7] = 0
    server.consume(server.protocol.upload_msg, StepContext(1, "train", np.array([7])), np.ones((1, 4), np.float32))
    assert server.arrive(7)
    assert server.params.tolist() == [np.float32(0.8 * weight)] * 4


def test_a_lost_model_is_a_step_that_changes_nothing():
    server = server_with()
    before = server.params.copy()
    arrive(server, 4, 2.0, None)
    assert next_arrival(server) and server.version == 0 and np.array_equal(server.params, before)
    assert np.isnan(server.round_metrics()["mixing_weight"]) and server.round_metrics()["updates_applied"] == 0


def test_a_real_run_steps_once_per_arrival(tmp_path):
    """Every round is one arrival: one step, the model changes, the staleness is never negative."""
    from mpi4py import MPI

    path = run_engine(_merge(FEDASYNC, {"rounds": 6, "eval_every": 3}), MPI.COMM_SELF, tmp_path / "r.h5")
    res = read_results(path)
    rounds = res.table("rounds")
    assert rounds["server_version"].tolist() == [1, 2, 3, 4, 5, 6]
    assert (rounds["staleness"] >= 0).all() and (np.diff(rounds["sim_clock_s"]) >= 0).all()
    assert res.table("eval")["global.seen.acc_pooled"][-1] > 0
