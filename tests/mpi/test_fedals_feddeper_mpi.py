"""FedALS and FedDeper on a real communicator (``mpirun -n 3 python -m pytest --with-mpi tests/mpi``):
per-client state lives only on the rank that owns the client, and the ledger matches the formula."""

import h5py
import numpy as np
import pytest

from mpifl.results import read_results
from mpifl.state_io import read_client_states
from tests.algorithms.conftest import SHARDS, _merge
from tests.conftest import run_engine, shared_dir


def run_world(tmp_path_factory, overrides):  # noqa: ANN001, ANN201
    """Run on the world communicator with a checkpoint at the end; every rank gets the results file's path."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    directory = shared_dir(tmp_path_factory, "r")
    rounds = overrides.get("rounds", SHARDS["rounds"])
    return run_engine(_merge(SHARDS, {**overrides, "checkpoint_every": rounds}), world, f"{directory}/r.h5")


def owners(path) -> np.ndarray:  # noqa: ANN001
    with h5py.File(path) as f:
        return f["clients/owner"][()]


@pytest.mark.mpi(min_size=3)
def test_feddeper_personal_models_stay_on_their_owner(tmp_path_factory):
    from mpi4py import MPI

    path = run_world(tmp_path_factory, {"algorithm": "feddeper", "clients_per_round": 3})
    if MPI.COMM_WORLD.Get_rank() != 0:
        return
    by_worker = read_client_states(path)
    assert "worker_0" not in by_worker  # the server hosts no client, hence no vᵢ
    owner = owners(path)
    assert any(by_worker.values())
    for name, states in by_worker.items():
        assert set(states) <= set(np.flatnonzero(owner == int(name.split("_")[1])).tolist())
        assert all(set(s) == {"personal"} for s in states.values())


@pytest.mark.mpi(min_size=3)
def test_fedals_state_and_ledger(tmp_path_factory):
    from mpi4py import MPI

    rounds, alpha = 4, 2
    path = run_world(tmp_path_factory, {"algorithm": "fedals", "rounds": rounds, "fedals": {"alpha": alpha}})
    if MPI.COMM_WORLD.Get_rank() != 0:
        return
    owner = owners(path)
    for name, states in read_client_states(path).items():  # full participation: every client has state
        assert set(states) == set(np.flatnonzero(owner == int(name.split("_")[1])).tolist())
    res = read_results(path)
    names = res.table_attrs["ledger"]["message_names"]
    ledger = res.table("ledger")
    train = ledger["stage"] == 0
    sizes = {n: int(ledger["bytes"][train & (ledger["message"] == names.index(n))][0]) // 4
             for n in ("head", "extractor")}
    expected = 2 * 4 * SHARDS["clients_per_round"] * (rounds * sizes["head"] + rounds // alpha * sizes["extractor"])
    assert int(ledger["bytes"][train].sum()) == expected
    assert sizes["head"] + sizes["extractor"] == res.table("model")["global_model"].size
