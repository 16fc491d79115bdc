"""PeFLL and pFedHN on the world communicator, evaluated whole or in chunks of 3 clients, equal the same
runs in one process evaluated whole, bit for bit (``mpirun -n 3 python -m pytest --with-mpi tests/mpi``)."""

import pytest

from mpifl.registry import parse_config
from tests.algorithms.test_pefll import PEFLL
from tests.algorithms.test_pfedhn import PFEDHN
from tests.conftest import assert_same, deterministic, run_engine


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("chunk", [0, 3])
@pytest.mark.parametrize("config", [PEFLL, PFEDHN], ids=["pefll", "pfedhn"])
def test_world_run_equals_single_process_run(tmp_path_factory, config, chunk):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    settings = {**config, "rounds": 2, "eval_every": 1}
    path = run_engine(parse_config({**settings, "eval_chunk": chunk}), world, tmp_path_factory.mktemp("w") / "r.h5")
    if world.Get_rank() == 0:
        alone = run_engine(parse_config(settings), MPI.COMM_SELF, tmp_path_factory.mktemp("s") / "r.h5")
        assert_same(deterministic(path), deterministic(alone))
