"""Every algorithm gives bitwise the same results on 1, 2, 3 and 4 ranks (server plus 0 to 3 workers), from one
4-rank job: the world, then sub-communicators of its first 3 and 2 ranks, then rank 0 alone."""

import pytest

from mpifl.config import parse_config
from mpifl.registry import known_algorithms
from tests.conftest import _merge, assert_same, deterministic, run_engine, shared_dir
from tests.test_checkpoint import CONFIGS


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("algorithm", known_algorithms())
def test_results_are_bitwise_the_same_on_1_to_4_ranks(algorithm, tmp_path_factory):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    cfg = parse_config(_merge(CONFIGS[algorithm], {"rounds": 2, "eval_every": 1}))
    directory = shared_dir(tmp_path_factory, f"ranks_{algorithm}")
    paths = {}
    for size in (4, 3, 2):
        comm = world.Split(0 if world.Get_rank() < size else MPI.UNDEFINED, world.Get_rank())
        if comm != MPI.COMM_NULL:
            paths[size] = run_engine(cfg, comm, directory / f"p{size}.h5")
            comm.Free()
        world.Barrier()
    if world.Get_rank() == 0:
        alone = deterministic(run_engine(cfg, MPI.COMM_SELF, directory / "p1.h5"))
        for path in paths.values():
            assert_same(deterministic(path), alone)
