"""SCAFFOLD: twice FedAvg's bytes, and the server's c stays the weighted mean of every client's cᵢ."""

import numpy as np
from mpi4py import MPI

from mpifl.config import parse_config
from mpifl.report import logical_totals
from mpifl.runtime.engine import Engine
from tests.algorithms.conftest import SHARDS, _merge


def test_control_variates_double_the_bytes(run_algo):
    fedavg, scaffold = run_algo("fedavg"), run_algo("scaffold")
    base, mine = logical_totals(fedavg)["train"], logical_totals(scaffold)["train"]
    assert mine["down"] == {"model": base["down"]["model"], "control": base["down"]["model"]}
    assert mine["up"] == {"delta": base["up"]["delta"], "control_delta": base["up"]["delta"]}


def test_server_control_is_the_population_mean_of_client_controls(tmp_path):
    cfg = parse_config(_merge(SHARDS, {"algorithm": "scaffold", "rounds": 2, "eval_every": 1, "clients_per_round": 2}))
    engine = Engine(cfg, MPI.COMM_SELF, tmp_path / "s.h5")
    engine.setup()
    engine.run(progress=False)
    sizes = engine.layout.train_sizes / engine.layout.train_sizes.sum()
    controls = {c: s["control"] for c, s in engine.client.state.export().items()}
    assert 2 <= len(controls) < cfg.data.num_clients  # partial participation: some cᵢ are still zero
    expected = sum(w * controls[c].astype(np.float64) for c, w in enumerate(sizes) if c in controls)
    assert np.allclose(engine.server.control, expected, atol=1e-5)
    assert np.abs(engine.server.control).max() > 1e-3
