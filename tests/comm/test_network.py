"""The network model's flow schedule (the server's shared link, multicast) against hand-derived finish times, and
the compute model's reproducible simulated time end to end."""

from collections.abc import Callable

import h5py
import numpy as np
import pytest

from mpifl.comm.network import NetworkModel, fluid_schedule, star_rates, water_fill
from mpifl.registry import parse_config
from mpifl.training.sgd import planned_samples
from tests.conftest import TINY, _merge, run_config

MB = 1e6  # bytes/s in the hand-derived numbers


def model(down: list[float], up: list[float], server_down: float = np.inf, server_up: float = np.inf,
          multicast: bool = False, latency: float = 0.0) -> NetworkModel:
    n = len(down)
    return NetworkModel(latency_s=np.full(n, latency), up_bytes_per_s=np.array(up, dtype=float),
                        down_bytes_per_s=np.array(down, dtype=float), seconds_per_sample=np.zeros(n),
                        server_up_bytes_per_s=server_up, server_down_bytes_per_s=server_down, multicast=multicast)


def seconds(net: NetworkModel, down: list[float], up: list[float], compute: list[float], broadcast: int = 0,
            down_messages: int = 1, up_messages: int = 1) -> np.ndarray:
    n = len(down)
    return net.round_seconds(np.arange(n), np.array(down), np.full(n, down_messages), np.array(up),
                             np.full(n, up_messages), np.array(compute, dtype=float), broadcast)


def test_infinite_server_link_is_exactly_the_per_client_formula():
    net = model(down=[3 * MB, 7 * MB, 11 * MB], up=[1 * MB, 0.3 * MB, 2 * MB], latency=0.05)
    down, up, compute = [4e6, 1234567.0, 99.0], [5e5, 7654321.0, 1.0], [0.25, 1.5, 0.0]
    got = seconds(net, down, up, compute, down_messages=2, up_messages=3)
    by_hand = (5 * 0.05 + np.array(down) / net.down_bytes_per_s + np.array(compute)
               + np.array(up) / net.up_bytes_per_s)
    assert np.array_equal(got, by_hand)
    # the flow schedule itself (no contention once the server's link is infinite) agrees up to rounding
    flows = model(down=[3 * MB, 7 * MB, 11 * MB], up=[1 * MB, 0.3 * MB, 2 * MB], latency=0.05, multicast=True)
    assert seconds(flows, down, up, compute, down_messages=2, up_messages=3) == pytest.approx(by_hand, rel=1e-12)


@pytest.mark.parametrize(("multicast", "download_s"), [(False, 4.0), (True, 1.0)])
def test_broadcast_over_the_server_downlink_once_per_client_or_once_with_multicast(multicast, download_s):
    """4 clients with links ≫ the server's 1 MB/s downlink each get a 1 MB broadcast: 4 s (4·S/B) sent once
    per client, 1 s (S/B) as one multicast stream; the download's latency comes on top."""
    net = model(down=[1e12] * 4, up=[1e12] * 4, server_down=1 * MB, multicast=multicast, latency=0.01)
    got = seconds(net, down=[1e6] * 4, up=[0.0] * 4, compute=[0.0] * 4, broadcast=1_000_000, up_messages=0)
    assert np.array_equal(got, np.full(4, download_s + 0.01))
    alone = net.cohort_seconds(np.arange(4), {"down": (np.full(4, 1_000_000), np.ones(4, int)),
                                              "up": (np.zeros(4, int), np.zeros(4, int))},
                               np.zeros(4), 1_000_000, turns=True)
    assert alone == pytest.approx(4 * (1.0 + 0.01))  # one after another: each alone at the server's 1 MB/s


def test_max_min_shares_under_a_shared_server_link():
    """Server 10 MB/s; A capped at 2 MB/s by its own link, B uncapped: A gets 2, B the other 8. A's 4 MB end at
    2 s, when B has 16 of its 20 MB; B's last 4 MB at the whole 10 MB/s take 0.4 s more."""
    net = model(down=[2 * MB, np.inf], up=[1.0, 1.0], server_down=10 * MB)
    assert np.array_equal(water_fill(10 * MB, np.array([2 * MB, np.inf])), [2 * MB, 8 * MB])
    assert np.array_equal(star_rates(10 * MB, np.array([2 * MB, np.inf]), np.array([False, True]), False)[0],
                          [0.0, 10 * MB])
    got = seconds(net, down=[4e6, 20e6], up=[0.0, 0.0], compute=[0.0, 0.0], up_messages=0)
    assert got == pytest.approx([2.0, 2.4], rel=1e-12)


def test_uploads_starting_at_different_times_share_the_server_uplink():
    """Server uplink 10 MB/s, 20 MB each. A starts at 0 (no compute) alone: 10 MB by 1 s; B joins after 1 s of
    compute and both get 5 MB/s, so A's last 10 MB end at 3 s; B, 10 MB done by then, has the link alone: 4 s."""
    net = model(down=[1.0, 1.0], up=[1e12, 1e12], server_up=10 * MB)
    got = seconds(net, down=[0.0, 0.0], up=[20e6, 20e6], compute=[0.0, 1.0], down_messages=0, up_messages=0)
    assert np.array_equal(got, [3.0, 4.0])
    # the same as bare flows: start times, sizes, the server's link, the clients' caps
    finish = fluid_schedule(np.array([0.0, 1.0]), np.array([20e6, 20e6]), 10 * MB, np.array([1e12, 1e12]))
    assert np.array_equal(finish, got)


def test_a_multicast_stream_shares_client_links_with_their_own_downloads():
    """Server 10 MB/s; A's link 4 MB/s with 2 MB of its own besides the 4 MB stream, B's link 100 MB/s with 6 MB
    of its own. All grow together until A's link is full at 2 + 2: the stream stays at 2 MB/s, B gets the 6 left
    on the server's link. At 1 s A's own 2 MB and B's 6 MB are done; the stream (2 MB left) then takes the
    whole of A's link: 4 MB/s, done at 1.5 s."""
    unicast, stream = star_rates(10 * MB, np.array([4 * MB, 100 * MB]), np.array([True, True]), True)
    assert (unicast.tolist(), stream) == ([2 * MB, 6 * MB], 2 * MB)
    net = model(down=[4 * MB, 100 * MB], up=[1.0, 1.0], server_down=10 * MB, multicast=True)
    got = seconds(net, down=[6e6, 10e6], up=[0.0, 0.0], compute=[0.0, 0.0], broadcast=4_000_000, up_messages=0)
    assert np.array_equal(got, [1.5, 1.5])


def test_server_link_config_is_in_bytes_per_second():
    cfg = parse_config(_merge(TINY, {"network": {"server_up_mbps": 8, "server_down_mbps": 80, "multicast": True}}))
    net = NetworkModel.from_config(cfg.network, 10, cfg.seed)
    assert (net.server_up_bytes_per_s, net.server_down_bytes_per_s, net.multicast) == (1e6, 1e7, True)
    default = NetworkModel.from_config(parse_config(TINY).network, 10, 0)
    assert np.isinf(default.server_up_bytes_per_s) and np.isinf(default.server_down_bytes_per_s)


# ---------------------------------------------------------------------------------------------- end to end
MODELED = {"network": {"compute": "model", "seconds_per_sample": 0.002, "distribution": "lognormal", "sigma": 0.7}}


def rounds(path):  # noqa: ANN001, ANN201
    with h5py.File(path) as f:
        return {k: f["rounds"][k][()] for k in f["rounds"]}


def test_modeled_round_time_is_the_closed_form_and_unchanged_by_an_infinite_server_link(write_config, tmp_path):
    """With no server link (the default, or explicitly none) each round is the slowest client's latency +
    bytes/bandwidth + seconds_per_sample × its samples, bit for bit."""
    run_config(write_config(MODELED), tmp_path / "a.h5")
    explicit = _merge(MODELED, {"network": {"server_up_mbps": None, "server_down_mbps": None, "multicast": False}})
    run_config(write_config(explicit, "b.yaml"), tmp_path / "b.h5")
    sim = rounds(tmp_path / "a.h5")["sim_time_s"]
    assert np.array_equal(sim, rounds(tmp_path / "b.h5")["sim_time_s"])
    cfg = parse_config(_merge(TINY, MODELED))
    net = NetworkModel.from_config(cfg.network, 10, cfg.seed)
    with h5py.File(tmp_path / "a.h5") as f:
        ledger = {k: f["ledger"][k][()] for k in ("round", "client", "message", "stage", "bytes")}
        directions = [str(d) for d in f["ledger"].attrs["directions"]]
        samples = planned_samples(f["clients"]["train_size"][()], cfg.client)
    for r, got in zip(range(1, cfg.rounds + 1), sim):
        rows = (ledger["round"] == r) & (ledger["stage"] == 0)
        clients = np.unique(ledger["client"][rows])
        moved = {"down": np.zeros(len(clients)), "up": np.zeros(len(clients))}  # FedAvg: one message each way
        for m, direction in enumerate(directions):
            mine = rows & (ledger["message"] == m)
            moved[direction][np.searchsorted(clients, ledger["client"][mine])] += ledger["bytes"][mine]
        down, up = moved["down"], moved["up"]
        expected = (2 * net.latency_s[clients] + down / net.down_bytes_per_s[clients]
                    + net.seconds_per_sample[clients] * samples[clients] + up / net.up_bytes_per_s[clients])
        assert got == expected.max()


def test_modeled_sim_time_is_bitwise_the_same_across_runs_and_rank_counts(write_config, tmp_path):
    config = write_config(_merge(MODELED, {"network": {"server_down_mbps": 2, "server_up_mbps": 1}}))
    for name, ranks in (("one.h5", 0), ("again.h5", 0), ("three.h5", 3)):
        run_config(config, tmp_path / name, ranks=ranks)
    sim = [rounds(tmp_path / name)["sim_time_s"] for name in ("one.h5", "again.h5", "three.h5")]
    assert np.all(sim[0] > 0)
    assert np.array_equal(sim[0], sim[1]) and np.array_equal(sim[0], sim[2])


@pytest.mark.parametrize("multicast", [False, True])
def test_a_slow_server_downlink_carries_fedavgs_model_once_per_client_or_once(write_config, tmp_path, multicast):
    """4 clients, each downlink and uplink ≫ the server's 1 Mbit/s downlink, no latency or compute: a round
    takes 4·(4d)/B for the model sent to each client, (4d)/B multicast, plus the upload at the client's rate."""
    net = {"compute": "model", "latency_s": 0.0, "down_mbps": 1e4, "up_mbps": 1e4, "server_down_mbps": 1,
           "multicast": multicast}
    run_config(write_config({"network": net}), tmp_path / "r.h5")
    with h5py.File(tmp_path / "r.h5") as f:
        d = f["model"]["global_model"].size
    server_b, client_b = 1e6 / 8, 1e4 * 1e6 / 8
    copies = 1 if multicast else 4
    expected = copies * 4 * d / server_b + 4 * d / client_b
    assert rounds(tmp_path / "r.h5")["sim_time_s"] == pytest.approx(np.full(3, expected), rel=1e-9)


def test_deadlines_and_over_selection_count_the_shared_server_link():
    """4 clients each download 1 MB through a 1 MB/s server downlink; clients 0-2 have fast links, client 3 a
    0.1 MB/s one. Alone, clients 0-2 take 1 s and client 3 10 s. Together (max-min): client 3 gets its 0.1 MB/s,
    the others 0.3 MB/s each until 10/3 s; client 3 then has 2/3 MB left at 0.1 MB/s: 10 s. A 2.5 s deadline
    keeps clients 0-2 alone and nobody together; over-selection keeps the 2 first (ties by id)."""
    from mpifl.config import FaultsConfig
    from mpifl.runtime.faults import FaultModel

    clients, samples = np.arange(4), np.zeros(4, dtype=np.int64)
    links = [1e12, 1e12, 1e12, 0.1 * MB]
    alone, shared = model(down=links, up=[1e12] * 4), model(down=links, up=[1e12] * 4, server_down=1 * MB)
    assert seconds(shared, [1e6] * 4, [0.0] * 4, [0.0] * 4, down_messages=1, up_messages=0) == pytest.approx(
        [10 / 3, 10 / 3, 10 / 3, 10.0])
    deadline = FaultsConfig(deadline_s=2.5)

    def expected(network: NetworkModel) -> Callable[[np.ndarray], np.ndarray]:
        def finish(chosen: np.ndarray) -> np.ndarray:
            n = len(chosen)
            return network.round_seconds(chosen, np.full(n, 1_000_000), np.ones(n), np.zeros(n), np.zeros(n),
                                         network.seconds_per_sample[chosen] * samples[chosen])
        return finish

    assert FaultModel(deadline, 0).participants(1, clients, 4, expected(alone)).tolist() == [0, 1, 2]
    assert FaultModel(deadline, 0).participants(1, clients, 4, expected(shared)).tolist() == []
    keep = FaultModel(FaultsConfig(over_selection=1.0), 0)
    assert keep.participants(1, clients, 2, expected(shared)).tolist() == [0, 1]
