"""Client availability on the simulated clock: trace files and on/off periods against hand-derived answers, and
whole runs that sample only online clients, wait when nobody is online, and stay the same on any rank count and
across a resume."""

import re
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

from mpifl.cli import main
from mpifl.comm.availability import Availability, OnOffPeriods, read_trace
from mpifl.comm.config import AvailabilityConfig
from tests.conftest import TINY, _merge, assert_same, deterministic, run_config, run_mpifl_batch

TRACE = "client,start_s,end_s\n2,5,15\n0,20,30\n0,0,10\n"  # unsorted on purpose; period: the last end, 30 s


def trace_file(tmp_path, text: str = TRACE):  # noqa: ANN001, ANN201
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return path


def online(availability: Availability, t: float) -> list[int]:
    return np.flatnonzero(availability.available(t)).tolist()


def test_a_trace_answers_who_is_online_by_hand(tmp_path):
    av = Availability(AvailabilityConfig(mode="trace", trace=str(trace_file(tmp_path))), 4, seed=0)
    # [start, end): client 0 on 0–10 and 20–30, client 2 on 5–15; repeating every 30 s
    expected = {0: [0], 4.999: [0], 5: [0, 2], 10: [2], 15: [], 19.5: [], 20: [0], 29.9: [0], 30: [0], 35: [0, 2],
                44: [2], 65: [0, 2]}
    for t, who in expected.items():
        assert online(av, t) == who, t
    assert av.next_online(15) == 20 and av.next_online(12) == 20  # client 0's second interval
    assert av.next_online(29) == 30  # none left in this period: the next period's first start
    assert av.next_online(3) == 5
    explicit = Availability(AvailabilityConfig(mode="trace", trace=str(trace_file(tmp_path)), trace_period_s=100), 4, 0)
    assert online(explicit, 35) == [] and explicit.next_online(35) == 100


@pytest.mark.parametrize(("text", "message"), [
    ("client,start,end\n0,0,1\n", "header client,start_s,end_s"),
    ("client,start_s,end_s\n", "no intervals"),
    ("client,start_s,end_s\n0,0,x\n", "line 2: expected client,start_s,end_s numbers"),
    ("client,start_s,end_s\n0,0,1,2\n", "line 2: expected"),
    ("client,start_s,end_s\n0,0,1\n0,nan,3\n", "line 3: values must be finite"),
    ("client,start_s,end_s\n4,0,1\n", "line 2: client ids must be integers in [0, 4)"),
    ("client,start_s,end_s\n1.5,0,1\n", "client ids must be integers"),
    ("client,start_s,end_s\n1,-1,1\n", "start_s must be ≥ 0"),
    ("client,start_s,end_s\n1,2,2\n", "end_s must be greater than start_s"),
    ("client,start_s,end_s\n1,0,5\n1,4,6\n", "client 1 has overlapping intervals"),
])
def test_a_bad_trace_is_one_clear_error(tmp_path, text, message):
    from mpifl.schema import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        read_trace(str(trace_file(tmp_path, text)), None, 4)


def test_onoff_periods_are_stationary_and_the_same_however_the_clock_is_asked():
    """Online with probability on/(on + off) at any time (the process starts stationary); a client's periods are
    a function of (seed, client, period index) alone, so asking every second or once gives the same answer."""
    n, on, off = 200_000, 1.0, 3.0
    periods = OnOffPeriods(on, off, seed=5, num_clients=n)
    p = on / (on + off)
    bound = 4 * np.sqrt(p * (1 - p) / n)  # 4 standard deviations of a binomial fraction
    for t in (0.0, 0.7, 10.0, 100.0):
        assert abs(periods.available(t).mean() - p) < bound, t
    stepped = OnOffPeriods(on, off, seed=5, num_clients=1000)
    for t in np.arange(0.0, 40.0, 0.25):
        stepped.available(float(t))
    direct = OnOffPeriods(on, off, seed=5, num_clients=1000)
    assert np.array_equal(stepped.available(40.0), direct.available(40.0))
    assert np.array_equal(stepped.available(3.0), OnOffPeriods(on, off, 5, 1000).available(3.0))  # back in time
    assert not np.array_equal(direct.available(40.0), OnOffPeriods(on, off, 6, 1000).available(40.0))  # seeded
    # one client's time online over a long horizon: on/(on + off) too (renewal-reward theorem)
    one = OnOffPeriods(on, off, seed=1, num_clients=1)
    grid = np.arange(0.0, 20_000.0, 0.5)
    assert abs(np.mean([one.available(float(t))[0] for t in grid]) - p) < 0.03
    nxt = direct.next_online(40.0)
    assert nxt > 40.0 and (direct.available(nxt) & ~direct.available(40.0)).any()


# ---------------------------------------------------------------------------------------------- end to end
# 10 digits clients, 8 seen (seed 7); each round takes 0.002 s per planned sample, about 0.3 s
RUN_TRACE = "client,start_s,end_s\n" + "".join(f"{c},0,0.5\n" for c in range(10)) + "".join(
    f"{c},3,100\n" for c in (1, 4, 6, 8))


def availability_run(trace: str) -> dict:
    network = {"compute": "model", "seconds_per_sample": 0.002, "latency_s": 0.0,
               "availability": {"mode": "trace", "trace": trace, "trace_period_s": 1000}}
    return {"rounds": 5, "network": network}


def test_a_run_samples_only_online_clients_and_waits_when_nobody_is(write_config, tmp_path):
    """The first rounds sample among every client (all online until 0.5 s); once the clock passes 0.5 s nobody is
    online until 3 s, so the server waits (the wait is part of that round's simulated time) and then samples
    among clients 1, 4, 6 and 8 only."""
    trace = trace_file(tmp_path, RUN_TRACE)
    run_config(write_config(availability_run(str(trace))), tmp_path / "r.h5")
    with h5py.File(tmp_path / "r.h5") as f:
        rounds = {k: f["rounds"][k][()] for k in f["rounds"]}
        ledger = {k: f["ledger"][k][()] for k in ("round", "client", "stage")}
        seen = np.flatnonzero(~f["clients"]["unseen"][()].astype(bool))
    clock = 0.0
    intervals = np.loadtxt(trace, delimiter=",", skiprows=1)
    waited = False
    for r in range(1, 6):
        up = (intervals[:, 1] <= clock) & (clock < intervals[:, 2])
        on = np.intersect1d(seen, intervals[up, 0].astype(int))
        start = clock if len(on) else 3.0  # nobody online: the server waits for the next interval
        waited |= not len(on)
        on = on if len(on) else np.intersect1d(seen, [1, 4, 6, 8])
        assert rounds["sim_clock_s"][r - 1] == start and rounds["available_clients"][r - 1] == len(on)
        sampled = np.unique(ledger["client"][(ledger["round"] == r) & (ledger["stage"] == 0)])
        assert len(sampled) == min(4, len(on)) and set(sampled) <= set(on), r
        clock += rounds["sim_time_s"][r - 1]
    assert waited  # the trace made the server wait once


def test_availability_is_the_same_on_one_and_three_ranks_and_across_a_resume(write_config, tmp_path, monkeypatch):
    onoff = {"mode": "onoff", "mean_on_s": 1, "mean_off_s": 1}
    config = write_config({"rounds": 5, "checkpoint_every": 2,
                           "network": {"compute": "model", "seconds_per_sample": 0.002, "availability": onoff}})
    run_config(config, tmp_path / "one.h5")
    run_config(config, tmp_path / "three.h5", ranks=3)
    assert_same(deterministic(tmp_path / "one.h5"), deterministic(tmp_path / "three.h5"))
    monkeypatch.setenv("MPIFL_INJECT_FAULT", "0:4")  # dies in round 4; resumes from round 2's checkpoint
    assert main(["run", str(config), "--out", str(tmp_path / "part.h5"), "--quiet"]) == 1
    monkeypatch.delenv("MPIFL_INJECT_FAULT")
    assert main(["run", str(config), "--resume", str(tmp_path / "part.h5"), "--quiet"]) == 0
    assert_same(deterministic(tmp_path / "one.h5"), deterministic(tmp_path / "part.h5"))
    with h5py.File(tmp_path / "one.h5") as f:
        available = f["rounds"]["available_clients"][()]
    assert 0 < available.min() and len(set(available)) > 1  # about half of the 8 seen clients, changing


CONFIG_ERRORS = [
    ({"availability": {"mode": "onoff"}}, {}, "set network.compute: model"),
    ({"compute": "model", "availability": {"mode": "onoff"}}, {"mode": "central", "noise_multiplier": 1.0},
     "amplification-by-sampling"),
    ({"compute": "model", "availability": {"mode": "trace"}}, {}, "a trace file is required"),
    ({"compute": "model", "availability": {"mode": "trace", "trace": "/nonexistent.csv"}}, {}, "cannot read it"),
]


@pytest.fixture(scope="module")
def config_errors(tmp_path_factory) -> tuple[Path, list]:
    """Every case of :data:`CONFIG_ERRORS` run as ``mpifl run`` on 2 ranks, all in one launch."""
    folder = tmp_path_factory.mktemp("availability_errors")
    jobs = []
    for i, (network, privacy, _) in enumerate(CONFIG_ERRORS):
        extra = {"network": network, **({"privacy": privacy, "server": {"weighting": "uniform"}} if privacy else {})}
        config = folder / f"c{i}.yaml"
        config.write_text(yaml.safe_dump(_merge(TINY, extra)))
        jobs.append(["run", str(config), "--out", str(folder / f"x{i}.h5")])
    return folder, run_mpifl_batch(jobs, 2, folder / "batch")


@pytest.mark.parametrize(("network", "privacy", "message"), CONFIG_ERRORS)
def test_availability_config_errors_are_one_line_before_training(config_errors, network, privacy, message):
    folder, results = config_errors
    i = CONFIG_ERRORS.index((network, privacy, message))
    lines = [line for line in results[i].stderr.splitlines() if line.startswith("mpifl")]
    assert results[i].returncode == 2 and len(lines) == 1 and message in lines[0], results[i].stderr
    assert not (folder / f"x{i}.h5").exists()
