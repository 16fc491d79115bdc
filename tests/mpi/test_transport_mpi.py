"""The transport on a real communicator (run with ``mpirun -n 3 python -m pytest --with-mpi tests/mpi``)."""

import numpy as np
import pytest

from mpifl.comm import Message, Placement, Transport


@pytest.fixture
def transport():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    sizes = np.arange(1, 12) * 10
    return Transport(comm, Placement.balanced(sizes, comm.Get_size()))


@pytest.mark.mpi(min_size=2)
def test_scatter_delivers_each_client_its_row(transport):
    clients = np.array([0, 3, 4, 7, 10])
    msg = Message("theta", "down", 3)
    payload = (clients[:, None] * 10 + np.arange(3)).astype(np.float32) if transport.is_server else None
    rows = transport.down(1, msg, payload, clients)
    local = transport.local_clients(clients)
    assert rows.shape == (len(local), 3)
    assert np.array_equal(rows, (local[:, None] * 10 + np.arange(3)).astype(np.float32))


@pytest.mark.mpi(min_size=2)
def test_gather_returns_rows_in_client_order_whatever_the_owner(transport):
    clients = np.array([1, 2, 5, 6, 8, 9])
    msg = Message("delta", "up", 2, "float64")
    local = transport.local_clients(clients)
    rows = np.array([[c, -c] for c in local], dtype=np.float64).reshape(-1, 2)
    out = transport.up(1, msg, rows, clients)
    if transport.is_server:
        assert np.array_equal(out, np.stack([clients, -clients], axis=1).astype(np.float64))
    else:
        assert out is None


@pytest.mark.mpi(min_size=2)
def test_broadcast_reaches_every_rank_and_is_sent_once_per_worker(transport):
    clients = np.arange(11)
    msg = Message("model", "down", 5, broadcast=True)
    payload = np.arange(5, dtype=np.float32) if transport.is_server else None
    rows = transport.down(2, msg, payload, clients)
    assert rows.shape == (len(transport.local_clients(clients)), 5)
    assert np.all(rows == np.arange(5, dtype=np.float32))
    if transport.is_server:
        size = transport.size
        assert transport.physical.total_bytes == 20 * (size - 1)


@pytest.mark.mpi(min_size=2)
def test_wrong_payload_shape_is_refused(transport):
    msg = Message("delta", "up", 4)
    with pytest.raises(ValueError, match="expected"):
        transport.up(1, msg, np.zeros((99, 4), dtype=np.float32), np.arange(11))


def _blob(client: int) -> np.ndarray:
    """A client's encoded message of its own length (client 4's is empty): its id repeated id % 5 times."""
    return np.full(client % 5, client, dtype=np.uint8)


@pytest.mark.mpi(min_size=2)
def test_variable_size_uploads_arrive_exactly_in_client_order(transport):
    clients = np.array([0, 1, 4, 6, 9, 10])
    msg = Message("delta", "up", 8)
    local = transport.local_clients(clients)
    (out,) = transport.upload(3, [msg], [[_blob(int(c)) for c in local]], clients)
    if not transport.is_server:
        assert out is None
        return
    assert [b.tolist() for b in out] == [_blob(int(c)).tolist() for c in clients]  # each its own size, not padded
    moved = sum(r[3] for r in transport.physical.rows if r[1] == "delta")  # rank 0's rows, not yet drained
    assert transport.physical.by_message(("delta",))[0] == moved
    assert moved == sum(c % 5 for c in clients)  # the MPI gather carried exactly the encoded bytes


@pytest.mark.mpi(min_size=2)
def test_variable_size_downloads_reach_their_clients(transport):
    clients = np.array([2, 3, 4, 7, 8])  # some ranks may hold none of them
    msg = Message("model", "down", 8)
    blobs = [_blob(int(c)) for c in clients] if transport.is_server else None
    local = transport.local_clients(clients)
    arrived = transport.down_blobs(5, msg, blobs, clients)
    assert [b.tolist() for b in arrived] == [_blob(int(c)).tolist() for c in local]


@pytest.mark.mpi(min_size=2)
def test_an_encoded_broadcast_is_sent_once_per_worker(transport):
    clients = np.arange(11)
    msg = Message("model", "down", 8, broadcast=True)
    blob = np.arange(7, dtype=np.uint8)
    arrived = transport.down_blobs(2, msg, [blob] if transport.is_server else None, clients)
    assert len(arrived) == len(transport.local_clients(clients))
    assert all(b.tolist() == list(range(7)) for b in arrived)
    if transport.is_server:
        assert transport.physical.by_message(("model",))[0] == 7 * (transport.size - 1)


@pytest.mark.mpi(min_size=2)
def test_ranks_waiting_for_a_busy_rank_sleep_instead_of_polling_a_core():
    """``arrive_together`` (the engine's set-up and end-of-run meetings, the tests' shared folders): while rank 0
    is busy for half a second, the others wait on a fraction of a core; a blocking MPI barrier polls a whole one
    (Open MPI), which on an oversubscribed node is taken from the ranks still working."""
    import time

    from mpi4py import MPI

    from mpifl.comm.transport import arrive_together

    world = MPI.COMM_WORLD
    arrive_together(world)
    wall, cpu = time.perf_counter(), time.process_time()
    if world.Get_rank() == 0:
        time.sleep(0.5)
    arrive_together(world)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if world.Get_rank() > 0:  # each waited about the half second (a rank sees a meeting end a poll before another)
        assert cpu < 0.25 * wall, f"waited {wall:.2f} s on {cpu:.2f} s of CPU"
