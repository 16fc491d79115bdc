"""PeFLL and pFedHN on the world communicator equal the same runs in one process, bit for bit
(``mpirun -n 3 python -m pytest --with-mpi tests/mpi``)."""

import numpy as np
import pytest

from mpifl.config import parse_config
from mpifl.runtime.engine import Engine
from tests.algorithms.test_pefll import PEFLL
from tests.algorithms.test_pfedhn import PFEDHN


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("config", [PEFLL, PFEDHN], ids=["pefll", "pfedhn"])
def test_world_run_equals_single_process_run(tmp_path_factory, config):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    cfg = parse_config({**config, "rounds": 2, "eval_every": 1})
    out = tmp_path_factory.mktemp("world") / "r.h5"
    engine = Engine(cfg, world, out)
    engine.setup()
    engine.run(progress=False)
    if world.Get_rank() > 0:
        assert engine.server is None and not engine.client.start and not engine.client.deltas
        return
    alone = Engine(cfg, MPI.COMM_SELF, out.with_name("alone.h5"))
    alone.setup()
    alone.run(progress=False)
    state, state1 = engine.server.final_state(), alone.server.final_state()
    assert state.keys() == state1.keys() and all(np.array_equal(state[k], state1[k]) for k in state)
    assert engine.eval_table.columns == alone.eval_table.columns
    ledger, ledger1 = engine.transport.ledger.columns(), alone.transport.ledger.columns()
    for key in ledger:
        assert np.array_equal(ledger[key], ledger1[key]), key
