"""A whole FedAvg run on the world communicator equals the same run in one process, bit for bit."""

import numpy as np
import pytest

from mpifl.config import parse_config
from mpifl.runtime.engine import Engine
from tests.conftest import TINY


@pytest.mark.mpi(min_size=2)
def test_world_run_equals_single_process_run(tmp_path_factory):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    cfg = parse_config({**TINY, "rounds": 2, "client": {"lr": 0.1, "momentum": 0.5, "batch_size": 8}})
    out = tmp_path_factory.mktemp("world") / "r.h5"
    engine = Engine(cfg, world, out)
    engine.setup()
    engine.run(progress=False)
    if world.Get_rank() == 0:
        alone = Engine(cfg, MPI.COMM_SELF, out.with_name("alone.h5"))
        alone.setup()
        alone.run(progress=False)
        assert np.array_equal(engine.server.params, alone.server.params)
        assert engine.eval_table.columns == alone.eval_table.columns
        ledger, ledger1 = engine.transport.ledger.columns(), alone.transport.ledger.columns()
        for key in ledger:
            assert np.array_equal(ledger[key], ledger1[key]), key
    else:
        assert engine.server is None and len(engine.client.data) > 0


def _run(cfg, comm, out, resume=False):
    engine = Engine(cfg, comm, out, resume=resume)
    engine.setup()
    engine.run(progress=False)
    return engine


@pytest.mark.mpi(min_size=2)
def test_checkpoint_then_resume_on_the_world_equals_an_uninterrupted_run(tmp_path_factory):
    """Stop after round 2 with a checkpoint, resume to round 4 (also with drop-out): same as straight through."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    base = {**TINY, "algorithm": "feddeper", "clients_per_round": 4, "eval_every": 2, "checkpoint_every": 2,
            "faults": {"dropout": 0.3}}
    directory = world.bcast(str(tmp_path_factory.mktemp("ckpt")) if world.Get_rank() == 0 else None)
    straight = _run(parse_config({**base, "rounds": 4}), world, f"{directory}/straight.h5")
    _run(parse_config({**base, "rounds": 2}), world, f"{directory}/resumed.h5")
    world.Barrier()  # rank 0 writes the file after the workers are done: a new job would start later
    resumed = _run(parse_config({**base, "rounds": 4}), world, f"{directory}/resumed.h5", resume=True)
    assert resumed.start_round == 3
    if world.Get_rank() == 0:
        assert np.array_equal(straight.server.params, resumed.server.params)
        assert straight.eval_table.columns == resumed.eval_table.columns
        assert list(resumed.rounds_table.columns["participants"]) == list(straight.rounds_table.columns["participants"])
