"""Every algorithm on the world communicator equals the same run in one process (rank 0, COMM_SELF)."""

import numpy as np
import pytest

from mpifl.config import parse_config
from mpifl.runtime.engine import Engine
from tests.conftest import _merge
from tests.test_checkpoint import CONFIGS

COVERED_ELSEWHERE = {"fedals", "feddeper", "pefll", "pfedhn"}  # their own pytest-mpi files


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", sorted(set(CONFIGS) - COVERED_ELSEWHERE))
def test_world_run_equals_single_process_run(algorithm, tmp_path_factory):
    from mpi4py import MPI

    cfg = parse_config(_merge(CONFIGS[algorithm], {"rounds": 2, "eval_every": 2}))
    world = MPI.COMM_WORLD
    engine = Engine(cfg, world, tmp_path_factory.mktemp("w") / "r.h5")
    engine.setup()
    engine.run(progress=False)
    if world.Get_rank() != 0:
        return
    alone = Engine(cfg, MPI.COMM_SELF, tmp_path_factory.mktemp("s") / "r.h5")
    alone.setup()
    alone.run(progress=False)
    for name, value in alone.server.final_state().items():
        assert np.array_equal(engine.server.final_state()[name], value), name
    for key, values in alone.eval_table.arrays().items():
        assert np.array_equal(engine.eval_table.arrays()[key], values, equal_nan=True), key
