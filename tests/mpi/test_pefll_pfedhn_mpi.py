"""PeFLL and pFedHN on the world communicator, evaluated whole or in chunks of 3 clients, equal the same
runs in one process evaluated whole, bit for bit (``mpirun -n 3 python -m pytest --with-mpi tests/mpi``)."""

import numpy as np
import pytest

from mpifl.config import parse_config
from mpifl.runtime.engine import Engine
from tests.algorithms.test_pefll import PEFLL
from tests.algorithms.test_pfedhn import PFEDHN


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("chunk", [0, 3])
@pytest.mark.parametrize("config", [PEFLL, PFEDHN], ids=["pefll", "pfedhn"])
def test_world_run_equals_single_process_run(tmp_path_factory, config, chunk):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    settings = {**config, "rounds": 2, "eval_every": 1}
    out = tmp_path_factory.mktemp("world") / "r.h5"
    engine = Engine(parse_config({**settings, "eval_chunk": chunk}), world, out)
    engine.setup()
    engine.run(progress=False)
    if world.Get_rank() > 0:
        assert engine.server is None and not engine.client.start and not engine.client.deltas
        return
    alone = Engine(parse_config(settings), MPI.COMM_SELF, out.with_name("alone.h5"))
    alone.setup()
    alone.run(progress=False)
    state, state1 = engine.server.final_state(), alone.server.final_state()
    assert state.keys() == state1.keys() and all(np.array_equal(state[k], state1[k]) for k in state)
    assert engine.eval_table.columns == alone.eval_table.columns
    ledger, ledger1 = engine.transport.ledger.columns(), alone.transport.ledger.columns()
    order, order1 = [np.lexsort([table[k] for k in ("client", "message", "stage", "round")])  # chunk order aside
                     for table in (ledger, ledger1)]
    for key in ledger:
        assert np.array_equal(ledger[key][order], ledger1[key][order1]), key
