"""A whole FedAvg run on the world communicator equals the same run in one process, bit for bit; so does one
checkpointed and resumed on the world."""

import h5py
import pytest

from mpifl.comm.transport import arrive_together
from mpifl.registry import parse_config
from mpifl.state_io import read_client_states
from tests.conftest import TINY, assert_same, deterministic, run_engine, shared_dir


@pytest.mark.mpi(min_size=2)
def test_world_run_equals_single_process_run(tmp_path_factory):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    cfg = parse_config({**TINY, "rounds": 2, "checkpoint_every": 2,
                        "client": {"lr": 0.1, "momentum": 0.5, "batch_size": 8}})
    directory = shared_dir(tmp_path_factory, "world")
    path = run_engine(cfg, world, f"{directory}/r.h5")
    if world.Get_rank() == 0:
        alone = run_engine(cfg, MPI.COMM_SELF, f"{directory}/alone.h5")
        assert_same(deterministic(path), deterministic(alone))
        with h5py.File(path) as f:
            assert sorted(f["checkpoint"]) == ["kept", "shards"]  # only the manifest: the state is in the folder
        states = read_client_states(path)
        assert sorted(states) == [f"worker_{r}" for r in range(1, world.Get_size())]
        assert not any(states.values())  # FedAvg's clients keep nothing


@pytest.mark.mpi(min_size=2)
def test_checkpoint_then_resume_on_the_world_equals_an_uninterrupted_run(tmp_path_factory):
    """Stop after round 2 with a checkpoint, resume to round 4 (also with drop-out): same as straight through."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    base = {**TINY, "algorithm": "feddeper", "clients_per_round": 4, "eval_every": 2, "checkpoint_every": 2,
            "faults": {"dropout": 0.3}}
    directory = shared_dir(tmp_path_factory, "ckpt")
    straight = run_engine(parse_config({**base, "rounds": 4}), world, f"{directory}/straight.h5")
    run_engine(parse_config({**base, "rounds": 2}), world, f"{directory}/resumed.h5")
    arrive_together(world)  # rank 0 writes the file after the workers are done: a new job would start later
    resumed = run_engine(parse_config({**base, "rounds": 4}), world, f"{directory}/resumed.h5", resume=True)
    if world.Get_rank() == 0:
        assert_same(deterministic(straight), deterministic(resumed))
