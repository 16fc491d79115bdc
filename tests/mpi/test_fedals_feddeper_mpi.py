"""FedALS and FedDeper on a real communicator (``mpirun -n 3 python -m pytest --with-mpi tests/mpi``):
per-client state lives only on the rank that owns the client, and the ledger matches the formula."""

import pytest

from mpifl.config import parse_config
from mpifl.runtime.engine import Engine
from tests.algorithms.conftest import SHARDS, _merge


def run_engine(tmp_path, overrides):
    from mpi4py import MPI

    engine = Engine(parse_config(_merge(SHARDS, overrides)), MPI.COMM_WORLD, tmp_path / "r.h5")
    engine.setup()
    engine.run(progress=False)
    return engine


@pytest.mark.mpi(min_size=3)
def test_feddeper_personal_models_stay_on_their_owner(tmp_path):
    engine = run_engine(tmp_path, {"algorithm": "feddeper", "clients_per_round": 3})
    if engine.rank == 0:
        assert engine.client is None  # the server hosts no client, hence no vᵢ
        return
    owned = set(engine.placement.clients_of(engine.rank).tolist())
    assert engine.client.state.clients() and set(engine.client.state.clients()) <= owned


@pytest.mark.mpi(min_size=3)
def test_fedals_state_and_ledger(tmp_path):
    rounds, alpha = 4, 2
    engine = run_engine(tmp_path, {"algorithm": "fedals", "rounds": rounds, "fedals": {"alpha": alpha}})
    if engine.rank > 0:
        assert set(engine.client.state.clients()) == set(engine.placement.clients_of(engine.rank).tolist())
        return
    protocol = engine.protocol
    head, = (p for p in protocol.parts if p.name == "head")
    ledger = engine.transport.ledger.columns()
    train = ledger["stage"] == 0
    expected = 2 * 4 * SHARDS["clients_per_round"] * (rounds * head.numel + rounds // alpha * protocol.extractor.numel)
    assert int(ledger["bytes"][train].sum()) == expected
