"""FedBuff: the server's buffer and staleness weights against hand-derived numbers, the event order of a real run
replayed independently, the reduction to FedAvg, and link speeds that change the model (not only the time).
Resume and rank invariance: tests/test_checkpoint.py and tests/mpi/ (CONFIGS["fedbuff"])."""

import numpy as np
import pytest

from mpifl.algorithms.base import StepContext
from mpifl.comm.network import NetworkModel
from mpifl.registry import parse_config
from mpifl.runtime.asynchronous import DISPATCH_TAG, Events
from tests.algorithms.conftest import SHARDS, _merge, both_sides
from tests.conftest import run_mpifl_batch
from tests.test_checkpoint import CONFIGS

FEDBUFF = CONFIGS["fedbuff"]


def _event_driven(server, events):  # noqa: ANN001, ANN202
    """What the runtime does at a dispatch and at an arrival, for ``server`` and rank 0's ``events``."""

    def dispatch(clients: list[int], arrival_s: list[float]) -> None:
        events.dispatch(np.array(clients), np.array(arrival_s))
        server.dispatch(np.array(clients))

    return dispatch, lambda: server.arrive(events.arrive())


def test_buffer_staleness_and_lost_updates_by_hand():
    """K = 1, a = 0.5, η_s = 1. Clients 1 and 2 leave at version 0 (back at 3 s and 1 s); 2 arrives first (τ = 0),
    3 leaves at version 1 and arrives at 2 s (τ = 0); 1 arrives at 3 s after two steps (τ = 2, weight 3^−½);
    4 leaves at version 2 but its update never comes: its arrival ends a step that changes nothing."""
    _, server, _ = both_sides(_merge(FEDBUFF, {"fedbuff": {"buffer_size": 1, "staleness_exponent": 0.5}}))
    msg = server.protocol.delta_msg
    rng = np.random.default_rng(0)
    d = {c: rng.standard_normal(server.params.size).astype(np.float32) for c in (1, 2, 3)}
    expected = server.params.copy()

    def step(delta: np.ndarray, weight: float) -> np.ndarray:
        acc = np.zeros(delta.size)
        acc += weight * delta.astype(np.float64)  # weighted_sum accumulates in float64
        return (expected + 1.0 * acc).astype(np.float32)

    events = Events(server.protocol.concurrency)
    dispatch, arrive = _event_driven(server, events)
    dispatch([1, 2], [3.0, 1.0])
    server.consume(msg, StepContext(1, "train", np.array([1, 2])), np.stack([d[1], d[2]]))
    assert events.next_arrival() == (2, 1.0)
    assert arrive() and events.now_s == 1.0 and server.version == 1
    expected = step(d[2], 1.0)
    assert np.array_equal(server.params, expected)
    dispatch([3], [2.0])
    server.consume(msg, StepContext(2, "train", np.array([3])), d[3][None])
    assert arrive() and events.now_s == 2.0
    expected = step(d[3], 1.0)
    dispatch([4], [5.0])  # no consume: its upload was lost
    assert arrive() and events.now_s == 3.0 and server.version == 3
    expected = step(d[1], 3.0 ** -0.5)
    assert np.array_equal(server.params, expected)
    assert server.round_metrics()["staleness_max"] == 2
    assert arrive() and events.now_s == 5.0 and server.version == 3
    assert np.array_equal(server.params, expected) and server.round_metrics()["updates_applied"] == 0
    assert events.free_slots == server.protocol.concurrency and not len(events.in_flight())


def test_a_step_averages_its_k_updates_over_k():
    """K = 2: (1/K)·Σ s(τᵢ)·Δᵢ, the staleness weights not renormalized (the paper's buffer)."""
    _, server, _ = both_sides(_merge(FEDBUFF, {"fedbuff": {"buffer_size": 2, "staleness_exponent": 1.0}}))
    msg = server.protocol.delta_msg
    a, b, c = (np.full(server.params.size, v, dtype=np.float32) for v in (0.5, 3.0, -1.0))
    start = server.params.copy()
    events = Events(server.protocol.concurrency)
    dispatch, arrive = _event_driven(server, events)
    dispatch([0, 1], [1.0, 4.0])
    server.consume(msg, StepContext(1, "train", np.array([0, 1])), np.stack([a, b]))
    assert not arrive()
    dispatch([2], [2.0])
    server.consume(msg, StepContext(1, "train", np.array([2])), c[None])
    assert arrive() and server.version == 1  # 0 and 2 arrived, both fresh: (a + c)/2
    assert np.allclose(server.params, start + (0.5 - 1.0) / 2, rtol=0, atol=1e-6)
    dispatch([3], [9.0])
    server.consume(msg, StepContext(2, "train", np.array([3])), a[None])
    assert not arrive()  # client 1 at 4 s, one step stale: weight 1/2
    assert arrive() and events.now_s == 9.0  # client 3, fresh
    assert np.allclose(server.params, start - 0.25 + (3.0 / 2 + 0.5) / 2, rtol=0, atol=1e-6)


def replay(raw: dict, rounds: int) -> list[dict]:
    """The event simulation written out again from the paper's description: each client's time alone on its link
    (download + samples × seconds per sample + upload, a latency per message), the first arrival first, a step
    every K arrivals, a freed slot refilled once every arrival of that instant is in, from the idle clients (the
    engine's draw per dispatch)."""
    from mpifl.data import build_federated_dataset
    from mpifl.training.sgd import planned_samples

    cfg = parse_config(raw)
    layout = build_federated_dataset(cfg.data, cfg.seed).layout
    net = NetworkModel.from_config(cfg.network, layout.num_clients, cfg.seed)
    numel = both_sides(raw)[1].params.size
    samples = planned_samples(layout.train_sizes, cfg.client)
    seen = np.flatnonzero(~layout.unseen)
    k, free = cfg.algorithm_options.buffer_size, cfg.algorithm_options.concurrency or cfg.clients_per_round
    clock, version, dispatches, arrivals = 0.0, 0, 0, 0
    flying: dict[int, tuple[float, int]] = {}
    out = []
    for _ in range(rounds):
        dispatched, staleness = [], []
        while True:
            idle = np.setdiff1d(seen, sorted(flying))
            due = flying and min(t for t, _ in flying.values()) <= clock  # arrivals now come before refills
            if not due and free and len(idle):
                rng = np.random.default_rng(np.random.SeedSequence([cfg.seed, DISPATCH_TAG, dispatches]))
                count = min(free, len(idle))
                for c in np.sort(rng.choice(idle, size=count, replace=False)).tolist():
                    alone = (2 * net.latency_s[c] + 4 * numel / net.down_bytes_per_s[c]
                             + net.seconds_per_sample[c] * samples[c] + 4 * numel / net.up_bytes_per_s[c])
                    flying[c] = (clock + alone, version)
                    dispatched.append(c)
                free -= count
                dispatches += 1
                continue
            first = min(flying, key=lambda c: (flying[c][0], c))
            (clock, left), free, arrivals = flying.pop(first), free + 1, arrivals + 1
            staleness.append(version - left)
            if arrivals == k:
                arrivals, version = 0, version + 1
                break
        out.append({"dispatched": sorted(dispatched), "clock": clock, "staleness_max": max(staleness),
                    "staleness_mean": float(np.mean(staleness))})
    return out


def test_the_event_order_of_a_run_is_the_papers_replayed_independently(run_algo):
    raw = _merge(FEDBUFF, {"rounds": 6})
    res = run_algo("fedbuff", {k: v for k, v in raw.items() if k != "algorithm"})
    rounds, ledger = res.table("rounds"), res.table("ledger")
    up = [i for i, d in enumerate(res.table_attrs["ledger"]["directions"]) if d == "up"]
    for r, events in enumerate(replay(raw, 6), start=1):
        uploads = np.sort(ledger["client"][(ledger["round"] == r) & np.isin(ledger["message"], up)])
        assert uploads.tolist() == events["dispatched"], r
        assert rounds["sim_clock_s"][r - 1] == pytest.approx(events["clock"], rel=1e-12)
        assert rounds["staleness_max"][r - 1] == events["staleness_max"]
        assert rounds["staleness_mean"][r - 1] == pytest.approx(events["staleness_mean"])
    assert rounds["staleness_max"].max() > 0  # the lognormal links made some updates stale


def test_k_equal_to_c_with_equal_links_is_fedavg_bitwise(run_algo):
    """Every client training at once, all on the same link and K = C: each step waits for all of them, none is
    stale, and the buffer's mean is FedAvg's with equal weights, summed in the same (client-id) order."""
    network = {"compute": "model", "seconds_per_sample": 0.0}
    fedbuff = run_algo("fedbuff", {"fedbuff": {"buffer_size": 6, "concurrency": 6}, "network": network})
    fedavg = run_algo("fedavg", {"server": {"weighting": "uniform"}})
    assert np.array_equal(fedbuff.table("model")["global_model"], fedavg.table("model")["global_model"])
    for key in ("global.seen.loss", "global.seen.acc_pooled"):
        assert np.array_equal(fedbuff.table("eval")[key], fedavg.table("eval")[key])
    assert (fedbuff.table("rounds")["staleness_max"] == 0).all()


def test_link_speeds_change_fedbuffs_model_but_not_fedavgs(run_algo):
    """Who arrives first decides what the buffer holds: other link draws give another model. FedAvg waits for
    every client, so its links change only the time."""
    models = {}
    for algorithm in ("fedbuff", "fedavg"):
        for sigma in (0.5, 1.5):
            net = {**FEDBUFF["network"], "sigma": sigma}
            extra = {"fedbuff": FEDBUFF["fedbuff"]} if algorithm == "fedbuff" else {}
            res = run_algo(algorithm, {"clients_per_round": 4, "network": net, **extra}, tag=str(sigma))
            models[algorithm, sigma] = res.table("model")["global_model"]
    assert not np.array_equal(models["fedbuff", 0.5], models["fedbuff", 1.5])
    assert np.array_equal(models["fedavg", 0.5], models["fedavg", 1.5])


def test_dispatches_only_clients_online_at_that_time(run_algo, tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("client,start_s,end_s\n" + "".join(f"{c},0,1000\n" for c in (0, 2, 3, 5)))
    net = {**FEDBUFF["network"], "availability": {"mode": "trace", "trace": str(trace)}}
    res = run_algo("fedbuff", {"clients_per_round": 3, "fedbuff": FEDBUFF["fedbuff"], "network": net})
    assert set(np.unique(res.table("ledger")["client"][res.table("ledger")["stage"] == 0])) <= {0, 2, 3, 5}


CANNOT = [
    ({"network": {"compute": "measured"}}, "set network.compute: model"),
    ({"faults": {"deadline_s": 1.0}}, "faults.deadline_s: not available with the asynchronous fedbuff"),
    ({"network": {"server_down_mbps": 10}}, "network.server_down_mbps: not available"),
    ({"fedbuff": {"concurrency": 7}}, "fedbuff.concurrency: 7 clients training at once exceeds the 6 seen"),
]


@pytest.fixture(scope="module")
def cannot_run(tmp_path_factory) -> list:
    """Every case of :data:`CANNOT` run as ``mpifl run`` on 2 ranks, all in one launch."""
    import yaml

    folder = tmp_path_factory.mktemp("fedbuff_cannot")
    jobs = []
    for i, (extra, _) in enumerate(CANNOT):
        config = folder / f"c{i}.yaml"
        config.write_text(yaml.safe_dump(_merge(_merge(SHARDS, FEDBUFF), extra)))
        jobs.append(["run", str(config), "--out", str(folder / f"x{i}.h5")])
    return run_mpifl_batch(jobs, 2, folder / "batch")


@pytest.mark.parametrize(("extra", "message"), CANNOT)
def test_what_fedbuff_cannot_run_with_is_one_line(cannot_run, extra, message):
    proc = cannot_run[CANNOT.index((extra, message))]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mpifl")]
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr
