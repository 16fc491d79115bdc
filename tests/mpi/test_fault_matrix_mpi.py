"""Every algorithm × every fault mode on a real communicator (``mpirun -n 3 python -m pytest --with-mpi``).

Each scenario runs on the world communicator (a server and two workers hosting the clients and their state) and once
more in one process (after the scenarios, each rank running its share of those runs at once); both must complete
and agree bit for bit (rank-count invariance under faults). A new algorithm is covered as soon as it is
registered. ``faults.nonfinite: abort`` ends the job, which a pytest-mpi session cannot survive:
``tests/test_faults.py`` covers it for every algorithm in one process and for a real 3-rank job.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mpifl.comm.transport import arrive_together
from mpifl.registry import known_algorithms, parse_config
from mpifl.results import read_results
from tests.conftest import _merge, assert_same, deterministic, run_engine, shared_dir
from tests.test_checkpoint import RUNS, SERVER_OPTIMIZERS

SCENARIOS = {
    # clients drop out before the round; with 2 of them sampled some rounds end up with nobody
    "dropout_empties_rounds": {"clients_per_round": 2, "rounds": 8, "faults": {"dropout": 0.8}},
    "nonfinite_some_skip": {"faults": {"corrupt": 0.4}},
    "nonfinite_all_skip": {"faults": {"corrupt": 1.0}},
    # links differ (log-normal); the deadline (set below) cuts about half; over-selection samples 3 for 2
    "deadline_over_selection": {"clients_per_round": 2, "faults": {"over_selection": 0.5},
                                "network": {"distribution": "lognormal", "sigma": 1.0, "latency_s": 0.01,
                                            "seconds_per_sample": 1e-4}},
    "eval_chunk": {"eval_chunk": 3},
}


ONE_PROCESS: list[tuple[str, dict, Path]] = []
"""The fault runs on three ranks (case, its config for one process, its results file), in the order they ran:
each rank's list, the same on every rank."""


def scenario_config(algorithm: str, scenario: str) -> dict:
    raw = _merge(RUNS[algorithm], {"rounds": 4, "eval_every": 2})
    raw = _merge(raw, SCENARIOS[scenario])
    if scenario == "deadline_over_selection":
        raw["faults"]["deadline_s"] = median_expected_seconds(raw)
    return raw


def median_expected_seconds(raw: dict) -> float:
    """The median over seen clients of the time the fault model expects a round to take them (its links,
    the plan's bytes and messages, and the algorithm's samples per round)."""
    from mpifl.algorithms.base import RunContext
    from mpifl.comm.network import NetworkModel
    from mpifl.data import build_federated_dataset
    from mpifl.registry import get_algorithm

    cfg = parse_config(raw)
    layout = build_federated_dataset(cfg.data, cfg.seed).layout
    protocol = get_algorithm(cfg.algorithm).server.protocol_type(RunContext(cfg, layout))
    network = NetworkModel.from_config(cfg.network, layout.num_clients, cfg.seed)
    plan = [m for m in protocol.train_plan(1) if getattr(m, "logical", False)]
    seen = np.flatnonzero(~layout.unseen)
    down = np.full(len(seen), sum(m.nbytes for m in plan if m.direction == "down"))
    up = np.full(len(seen), sum(m.nbytes for m in plan if m.direction == "up"))
    compute = network.seconds_per_sample[seen] * protocol.samples_per_round()[seen]
    return float(np.median(network.client_seconds(seen, down, len(plan), up, 0, compute)))


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
@pytest.mark.parametrize("algorithm", known_algorithms() + sorted(SERVER_OPTIMIZERS))
def test_fault_on_three_ranks_completes_and_matches_one_process(algorithm, scenario, tmp_path_factory):
    """Every algorithm, and the adaptive server optimizers (``fedavg_adam``, ...) under each fault."""
    from mpi4py import MPI

    asynchronous = RUNS[algorithm]["algorithm"] in ("fedbuff", "fedasync")
    if asynchronous and scenario == "deadline_over_selection":
        pytest.skip("asynchronous algorithms refuse deadlines and over-selection: clients arrive one at a time")
    world = MPI.COMM_WORLD
    raw = scenario_config(algorithm, scenario)
    directory = shared_dir(tmp_path_factory, "faults")
    path = run_engine(raw, world, directory / "world.h5")
    alone = raw if scenario != "eval_chunk" else {k: v for k, v in raw.items() if k != "eval_chunk"}
    ONE_PROCESS.append((f"{algorithm}-{scenario}", alone, path))
    if world.Get_rank() != 0:
        return
    rounds = read_results(path).table("rounds")
    # the clients whose updates the server used: an asynchronous step applies those that arrived (its
    # participants are the clients it dispatched during the step)
    used = rounds["updates_applied"] if asynchronous else rounds["participants"]
    if scenario == "dropout_empties_rounds":
        assert (used == 0).any() and used.sum() > 0
    elif scenario == "nonfinite_some_skip" and algorithm != "local":  # Local uploads nothing
        assert rounds["rejected_updates"].sum() > 0 and used.sum() > 0
    elif scenario == "nonfinite_all_skip" and algorithm != "local":
        assert (used == 0).all() and (rounds["rejected_updates"] > 0).all()
    elif scenario == "deadline_over_selection":
        assert rounds["participants"].max() <= 2 and rounds["participants"].sum() > 0


@pytest.mark.mpi(min_size=3)
def test_every_fault_run_on_three_ranks_matches_its_run_in_one_process(tmp_path_factory):
    """The runs of the test above against one process each, bit for bit. The ranks share those one-process runs
    out and run them at once (rank 0 alone took most of this file's time, the others waiting)."""
    from mpi4py import MPI

    if not ONE_PROCESS:
        pytest.skip("no fault run on three ranks in this session")
    world = MPI.COMM_WORLD
    directory = shared_dir(tmp_path_factory, "alone")
    differ = []
    for case, raw, path in ONE_PROCESS[world.Get_rank()::world.Get_size()]:
        reference = run_engine(raw, MPI.COMM_SELF, directory / f"{case}.h5")
        try:
            assert_same(deterministic(path), deterministic(reference))
        except AssertionError as exc:
            differ.append(f"{case}: {exc}")
    arrive_together(world)
    differ = [line for lines in world.allgather(differ) for line in lines]
    assert not differ, "\n".join(differ)


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("algorithm", known_algorithms() + sorted(SERVER_OPTIMIZERS))
def test_checkpoint_on_three_ranks_resumes_on_two_under_faults(algorithm, tmp_path_factory):
    """A run checkpointed at round 2 on 3 ranks (dropped and rejected clients included) continues on 2
    ranks to round 4 and ends bitwise where an uninterrupted one-process run ends: every client's state
    travels by client id to whichever rank now hosts it."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    raw = _merge(RUNS[algorithm], {"rounds": 4, "eval_every": 1, "checkpoint_every": 2,
                                      "faults": {"dropout": 0.2, "corrupt": 0.3}})
    directory = shared_dir(tmp_path_factory, "resume")
    path = directory / "run.h5"
    run_engine({**raw, "rounds": 2}, world, path)
    pair = world.Split(0 if world.Get_rank() < 2 else MPI.UNDEFINED, world.Get_rank())
    if pair != MPI.COMM_NULL:
        run_engine(raw, pair, path, resume=True)
        pair.Free()
    elif world.Get_rank() == 2:  # the rank the resume leaves out runs the uninterrupted one meanwhile
        run_engine(raw, MPI.COMM_SELF, directory / "alone.h5")
    arrive_together(world)
    if world.Get_rank() == 0:
        assert_same(deterministic(path), deterministic(directory / "alone.h5"))
        assert read_results(path).table("rounds")["rejected_updates"].sum() > 0 or algorithm == "local"
