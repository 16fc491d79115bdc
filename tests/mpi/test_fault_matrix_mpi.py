"""Every algorithm × every fault mode on a real communicator (``mpirun -n 3 python -m pytest --with-mpi``).

Each scenario runs on the world communicator (a server and two workers hosting the clients and their
state) and, on rank 0, once more in one process; both must complete and agree bit for bit (rank-count
invariance under faults). A new algorithm is covered as soon as it is registered. ``faults.nonfinite:
abort`` ends the job, which a pytest-mpi session cannot survive: ``tests/test_faults.py`` covers it for
every algorithm in one process and for a real 3-rank job.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mpifl.config import parse_config
from mpifl.registry import known_algorithms
from mpifl.runtime.engine import Engine
from tests.conftest import _merge, rank_dependent
from tests.test_checkpoint import CONFIGS

SCENARIOS = {
    # clients drop out before the round; with 2 of them sampled some rounds end up with nobody
    "dropout_empties_rounds": {"clients_per_round": 2, "faults": {"dropout": 0.8}},
    "nonfinite_some_skip": {"faults": {"corrupt": 0.4}},
    "nonfinite_all_skip": {"faults": {"corrupt": 1.0}},
    # links differ (log-normal); the deadline (set below) cuts about half; over-selection samples 3 for 2
    "deadline_over_selection": {"clients_per_round": 2, "faults": {"over_selection": 0.5},
                                "network": {"distribution": "lognormal", "sigma": 1.0, "latency_s": 0.01,
                                            "seconds_per_sample": 1e-4}},
    "eval_chunk": {"eval_chunk": 3},
}


def shared_dir(tmp_path_factory, name: str) -> Path:  # noqa: ANN001
    """One directory every rank agrees on (rank 0's)."""
    from mpi4py import MPI

    path = str(tmp_path_factory.mktemp(name)) if MPI.COMM_WORLD.Get_rank() == 0 else None
    return Path(MPI.COMM_WORLD.bcast(path, root=0))


def run(cfg, comm, out: Path, resume: bool = False) -> Engine:  # noqa: ANN001
    engine = Engine(cfg, comm, out, resume=resume)
    engine.setup()
    engine.run(progress=False)
    return engine


def outcome(engine: Engine) -> dict[str, np.ndarray]:
    """Everything a run computes: the server's final state, every evaluation, the rounds' deterministic
    columns (participants, rejections, losses, bytes) and the logical ledger."""
    out = {f"model/{k}": np.asarray(v) for k, v in engine.server.final_state().items() if v is not None}
    ledger = engine.transport.ledger.columns()  # in (round, stage, message, client) order: evaluation chunks
    order = np.lexsort([ledger[k] for k in ("client", "message", "stage", "round")])  # record theirs in turn
    tables = {"eval": engine.eval_table.arrays(), "rounds": engine.rounds_table.arrays(),
              "ledger": {k: v[order] for k, v in ledger.items()}}
    for table, columns in tables.items():
        out.update({f"{table}/{k}": v for k, v in columns.items() if not rank_dependent(k)})
    return out


def assert_same(one: dict[str, np.ndarray], other: dict[str, np.ndarray]) -> None:
    assert one.keys() == other.keys()
    for key in one:
        assert np.array_equal(one[key], other[key], equal_nan=one[key].dtype.kind == "f"), key


def scenario_config(algorithm: str, scenario: str) -> dict:
    raw = _merge(CONFIGS[algorithm], {"rounds": 4, "eval_every": 2, **SCENARIOS[scenario]})
    if scenario == "deadline_over_selection":
        raw["faults"]["deadline_s"] = median_expected_seconds(raw)
    return raw


def median_expected_seconds(raw: dict) -> float:
    """The median over seen clients of the time the fault model expects a round to take them."""
    from mpi4py import MPI

    engine = Engine(parse_config(raw), MPI.COMM_SELF, Path("unused.h5"))
    engine.setup()
    plan = [m for m in engine.protocol.train_plan(1) if getattr(m, "logical", False)]
    down = sum(m.nbytes for m in plan if m.direction == "down")
    up = sum(m.nbytes for m in plan if m.direction == "up")
    seen = engine.seen
    expected = engine.network.client_seconds(seen, np.full(len(seen), down), len(plan), np.full(len(seen), up), 0,
                                             engine.network.seconds_per_sample[seen] * engine.samples_per_round[seen])
    return float(np.median(expected))


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("algorithm", known_algorithms())
def test_fault_on_three_ranks_completes_and_matches_one_process(algorithm, scenario, tmp_path_factory):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    raw = scenario_config(algorithm, scenario)
    directory = shared_dir(tmp_path_factory, "faults")
    engine = run(parse_config(raw), world, directory / "world.h5")
    if world.Get_rank() != 0:
        return
    alone = raw if scenario != "eval_chunk" else {k: v for k, v in raw.items() if k != "eval_chunk"}
    reference = run(parse_config(alone), MPI.COMM_SELF, directory / "alone.h5")
    assert_same(outcome(engine), outcome(reference))
    rounds = engine.rounds_table.arrays()
    if scenario == "dropout_empties_rounds":
        assert (rounds["participants"] == 0).any() and rounds["participants"].sum() > 0
    elif scenario == "nonfinite_some_skip" and algorithm != "local":  # Local uploads nothing
        assert rounds["rejected_updates"].sum() > 0 and rounds["participants"].sum() > 0
    elif scenario == "nonfinite_all_skip" and algorithm != "local":
        assert (rounds["participants"] == 0).all() and (rounds["rejected_updates"] > 0).all()
    elif scenario == "deadline_over_selection":
        assert rounds["participants"].max() <= 2 and rounds["participants"].sum() > 0


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("algorithm", known_algorithms())
def test_checkpoint_on_three_ranks_resumes_on_two_under_faults(algorithm, tmp_path_factory):
    """A run checkpointed at round 2 on 3 ranks (dropped and rejected clients included) continues on 2
    ranks to round 4 and ends bitwise where an uninterrupted one-process run ends: every client's state
    travels by client id to whichever rank now hosts it."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    raw = _merge(CONFIGS[algorithm], {"rounds": 4, "eval_every": 1, "checkpoint_every": 2,
                                      "faults": {"dropout": 0.2, "corrupt": 0.3}})
    directory = shared_dir(tmp_path_factory, "resume")
    path = directory / "run.h5"
    run(parse_config({**raw, "rounds": 2}), world, path)
    pair = world.Split(0 if world.Get_rank() < 2 else MPI.UNDEFINED, world.Get_rank())
    if pair != MPI.COMM_NULL:
        resumed = run(parse_config(raw), pair, path, resume=True)
        pair.Free()
        if world.Get_rank() == 0:
            reference = run(parse_config(raw), MPI.COMM_SELF, directory / "alone.h5")
            assert resumed.start_round == 3
            assert_same(outcome(resumed), outcome(reference))
            assert resumed.rounds_table.arrays()["rejected_updates"].sum() > 0 or algorithm == "local"
    world.Barrier()
