"""Per-client compute speed (``network.speed``): read from a file or drawn per client id, and followed by
deadlines, over-selection, the simulated clock and FedBuff's arrivals; numbers worked out by hand."""

from __future__ import annotations

import re

import h5py
import numpy as np
import pytest

from mpifl.cli import main
from mpifl.comm.config import NetworkConfig, SpeedConfig
from mpifl.comm.network import NetworkModel
from mpifl.comm.wire import WireFormat
from mpifl.config import FaultsConfig
from mpifl.runtime.faults import FaultModel
from mpifl.runtime.simtime import SimulatedTime, Traffic
from mpifl.schema import ConfigError
from tests.conftest import assert_same, deterministic, run_config

SPEEDS = "client,seconds_per_sample\n0,0.5\n1,0.25\n2,0.125\n3,1.0\n"


def speed_file(tmp_path, text: str = SPEEDS):  # noqa: ANN001, ANN201
    path = tmp_path / "speeds.csv"
    path.write_text(text)
    return path


def network(speed: dict, **links) -> NetworkConfig:  # noqa: ANN003
    return NetworkConfig(**{"latency_s": 0.0, **links}, speed=SpeedConfig(**speed))


def test_a_speed_file_gives_each_client_its_seconds_per_sample(tmp_path):
    model = NetworkModel.from_config(network({"mode": "file", "file": str(speed_file(tmp_path))}), 4, 0)
    assert model.seconds_per_sample.tolist() == [0.5, 0.25, 0.125, 1.0]
    shuffled = "client,seconds_per_sample\n3,1\n\n1,0.25\n0,0.5\n2,1.25e-1\n"  # any order, blank lines
    model = NetworkModel.from_config(network({"mode": "file", "file": str(speed_file(tmp_path, shuffled))}), 4, 0)
    assert model.seconds_per_sample.tolist() == [0.5, 0.25, 0.125, 1.0]


@pytest.mark.parametrize(("text", "message"), [
    ("", "the first line must be the header client,seconds_per_sample"),
    ("client,seconds\n0,1\n", "the first line must be the header client,seconds_per_sample"),
    ("client,seconds_per_sample\n0,fast\n", "line 2: expected client,seconds_per_sample numbers, got 0,fast"),
    ("client,seconds_per_sample\n0,1,2\n", "line 2: expected client,seconds_per_sample numbers"),
    ("client,seconds_per_sample\n0\n", "line 2: expected client,seconds_per_sample numbers"),
    ("client,seconds_per_sample\n0,1\n1,-0.5\n", "line 3: seconds_per_sample must be a finite number ≥ 0, got -0.5"),
    ("client,seconds_per_sample\n0,nan\n", "line 2: seconds_per_sample must be a finite number ≥ 0"),
    ("client,seconds_per_sample\n0,inf\n", "line 2: seconds_per_sample must be a finite number ≥ 0"),
    ("client,seconds_per_sample\n0,1\n1,1\n0,2\n", "line 4: client 0 appears twice"),
    ("client,seconds_per_sample\n0,1\n2,1\n", "2 of the data's 4 clients have no row (first: client 1)"),
    ("client,seconds_per_sample\n4,1\n", "line 2: client ids must be integers in [0, 4) (the data's clients), got 4"),
    ("client,seconds_per_sample\n-1,1\n", "line 2: client ids must be integers in [0, 4)"),
    ("client,seconds_per_sample\n1.5,1\n", "line 2: client ids must be integers in [0, 4)"),
    ("client,seconds_per_sample\nnan,1\n", "line 2: client ids must be integers in [0, 4)"),
    ("client,seconds_per_sample\n1e30,1\n", "line 2: client ids must be integers in [0, 4)"),
])
def test_a_bad_speed_file_is_one_clear_error(tmp_path, text, message):
    path = speed_file(tmp_path, text)
    with pytest.raises(ConfigError, match=re.escape(f"network.speed.file: {path}: {message}")) as caught:
        NetworkModel.from_config(network({"mode": "file", "file": str(path)}), 4, 0)
    assert "\n" not in str(caught.value)


def test_a_missing_or_unreadable_speed_file_is_one_clear_error(tmp_path):
    for path in (tmp_path / "absent.csv", tmp_path):  # a folder cannot be read as a file either
        with pytest.raises(ConfigError, match=re.escape(f"network.speed.file: {path}: cannot read it")):
            NetworkModel.from_config(network({"mode": "file", "file": str(path)}), 4, 0)
    (tmp_path / "binary.csv").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="cannot read it"):
        NetworkModel.from_config(network({"mode": "file", "file": str(tmp_path / "binary.csv")}), 4, 0)


def test_lognormal_speeds_are_drawn_per_client_id():
    """A client's speed depends on (seed, client id) only: the same in a run of 5 clients or of 20,000 (so on any
    rank and rank count); σ = 0 is the configured speed itself; the links are those of the default mode."""
    cfg = network({"mode": "lognormal", "sigma": 0.8}, seconds_per_sample=0.01, distribution="lognormal")
    few, many = NetworkModel.from_config(cfg, 5, 3), NetworkModel.from_config(cfg, 20_000, 3)
    assert np.array_equal(few.seconds_per_sample, many.seconds_per_sample[:5])
    logs = np.log(many.seconds_per_sample / 0.01)
    assert abs(np.median(logs)) < 0.03 and abs(logs.std() - 0.8) < 0.02  # log-normal of median 0.01 and σ 0.8
    assert not np.array_equal(NetworkModel.from_config(cfg, 5, 4).seconds_per_sample, few.seconds_per_sample)
    flat = NetworkModel.from_config(network({"mode": "lognormal", "sigma": 0.0}, seconds_per_sample=0.01), 5, 3)
    assert flat.seconds_per_sample.tolist() == [0.01] * 5
    links = NetworkModel.from_config(network({}, seconds_per_sample=0.01, distribution="lognormal"), 5, 3)
    assert np.array_equal(links.latency_s, few.latency_s) and np.array_equal(links.up_bytes_per_s, few.up_bytes_per_s)


def test_deadline_and_over_selection_keep_the_clients_the_speeds_make_fastest(tmp_path):
    """No latency and no bytes: a client's expected round is its seconds per sample × its 8 samples, i.e.
    [4, 2, 1, 8] s for clients 0-3 of the file."""
    model = NetworkModel.from_config(network({"mode": "file", "file": str(speed_file(tmp_path))}), 4, 0)
    clock = SimulatedTime(model, WireFormat(), np.full(4, 8), turns=False)
    nothing = Traffic(np.zeros(4), np.ones(4), np.zeros(4), np.ones(4), 0)

    def keep(deadline_s: float | None, over_selection: float, wanted: int) -> list[int]:
        faults = FaultModel(FaultsConfig(deadline_s=deadline_s, over_selection=over_selection), 0)
        return faults.participants(1, np.arange(4), wanted,
                                   lambda clients: clock.expected_finish(clients, nothing.of(clients))).tolist()

    assert keep(4.5, 0.0, 4) == [0, 1, 2]  # client 3 (8 s) misses the deadline
    assert keep(1.5, 0.0, 4) == [2]
    assert keep(None, 1.0, 2) == [1, 2]  # over-selection keeps the 2 fastest of the 4 sampled
    assert keep(None, 1.0, 3) == [0, 1, 2]
    assert keep(1.5, 1.0, 2) == [2]  # the deadline first, then the fastest


def speed_run(tmp_path, extra: dict | None = None) -> dict:  # noqa: ANN001
    """4 clients, all seen, each training 2 steps of 4 samples (8 samples a round), on links so fast that a
    round's simulated time is its compute alone (to 1e-6 s)."""
    from tests.conftest import _merge

    return _merge({"rounds": 2, "clients_per_round": 4, "data": {"num_clients": 4, "unseen_fraction": 0.0},
                   "client": {"steps": 2, "batch_size": 4},
                   "network": {"compute": "model", "latency_s": 0.0, "up_mbps": 1e9, "down_mbps": 1e9,
                               "speed": {"mode": "file", "file": str(speed_file(tmp_path))}}}, extra or {})


def rounds_table(path) -> dict[str, np.ndarray]:  # noqa: ANN001
    with h5py.File(path) as f:
        return {k: f["rounds"][k][()] for k in f["rounds"]}


def test_the_simulated_clock_and_over_selection_follow_the_speeds(write_config, tmp_path):
    run_config(write_config(speed_run(tmp_path)), tmp_path / "all.h5")
    rounds = rounds_table(tmp_path / "all.h5")
    np.testing.assert_allclose(rounds["sim_time_s"], [8.0, 8.0], atol=1e-6)  # client 3: 1 s × 8 samples
    picky = speed_run(tmp_path, {"clients_per_round": 2, "faults": {"over_selection": 1.0}})
    run_config(write_config(picky, "picky.yaml"), tmp_path / "picky.h5")
    rounds = rounds_table(tmp_path / "picky.h5")
    np.testing.assert_allclose(rounds["sim_time_s"], [2.0, 2.0], atol=1e-6)  # clients 1 and 2 kept: 0.25 s × 8
    assert rounds["participants"].tolist() == [2, 2]


def test_fedbuff_arrivals_follow_the_speeds(write_config, tmp_path):
    """All 4 clients start at 0 with one update per server step: client 2 (1 s) arrives first and trains again
    (back at 2 s), client 1 arrives at 2 s (ties: the lower id first), then client 2 again: the steps happen at
    1, 2 and 2 s simulated; with equal speeds every client would arrive at once."""
    fedbuff = speed_run(tmp_path, {"algorithm": "fedbuff", "rounds": 3, "fedbuff": {"buffer_size": 1}})
    run_config(write_config(fedbuff), tmp_path / "buff.h5")
    np.testing.assert_allclose(rounds_table(tmp_path / "buff.h5")["sim_clock_s"], [1.0, 2.0, 2.0], atol=1e-6)


def test_lognormal_speeds_give_the_same_run_on_one_and_three_ranks(write_config, tmp_path):
    config = write_config({"rounds": 2, "clients_per_round": 3, "faults": {"over_selection": 0.5},
                           "network": {"compute": "model", "seconds_per_sample": 0.01,
                                       "speed": {"mode": "lognormal", "sigma": 1.5}}})
    run_config(config, tmp_path / "one.h5")
    run_config(config, tmp_path / "three.h5", ranks=3)
    assert_same(deterministic(tmp_path / "one.h5"), deterministic(tmp_path / "three.h5"))


@pytest.mark.parametrize(("speed", "extra", "message"), [
    ({"mode": "file"}, {}, "network.speed.file: a CSV file is required with mode: file"),
    ({"file": "speeds.csv"}, {}, "network.speed.file: read only with mode: file (the mode is network)"),
    ({"mode": "lognormal"}, {}, "network.speed: mode lognormal scales network.seconds_per_sample, which is 0"),
    ({"mode": "file", "file": "speeds.csv"}, {"seconds_per_sample": 0.1},
     "network.seconds_per_sample: network.speed.file gives every client's; leave it out"),
    ({"mode": "file", "file": "bad.csv"}, {}, "network.speed.file: bad.csv: line 3: client 0 appears twice"),
    ({"mode": "file", "file": "speeds.csv"}, {}, "network.speed.file: speeds.csv: 6 of the data's 10 clients have"),
])
def test_speed_config_errors_are_one_line_at_validation(write_config, tmp_path, monkeypatch, capsys, speed, extra,
                                                        message):
    monkeypatch.chdir(tmp_path)
    speed_file(tmp_path)
    (tmp_path / "bad.csv").write_text("client,seconds_per_sample\n0,1\n0,1\n")
    assert main(["validate", str(write_config({"network": {"speed": speed, **extra}}))]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
