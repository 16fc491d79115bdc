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
    rows = transport.down(1, "train", msg, payload, clients)
    local = transport.local_clients(clients)
    assert rows.shape == (len(local), 3)
    assert np.array_equal(rows, (local[:, None] * 10 + np.arange(3)).astype(np.float32))


@pytest.mark.mpi(min_size=2)
def test_gather_returns_rows_in_client_order_whatever_the_owner(transport):
    clients = np.array([1, 2, 5, 6, 8, 9])
    msg = Message("delta", "up", 2, "float64")
    local = transport.local_clients(clients)
    rows = np.array([[c, -c] for c in local], dtype=np.float64).reshape(-1, 2)
    out = transport.up(1, "train", msg, rows, clients)
    if transport.is_server:
        assert np.array_equal(out, np.stack([clients, -clients], axis=1).astype(np.float64))
        ledger = transport.ledger.columns()
        assert np.array_equal(ledger["client"], clients) and np.all(ledger["bytes"] == 16)
    else:
        assert out is None


@pytest.mark.mpi(min_size=2)
def test_broadcast_reaches_every_rank_and_counts_each_client(transport):
    clients = np.arange(11)
    msg = Message("model", "down", 5, broadcast=True)
    payload = np.arange(5, dtype=np.float32) if transport.is_server else None
    rows = transport.down(2, "train", msg, payload, clients)
    assert rows.shape == (len(transport.local_clients(clients)), 5)
    assert np.all(rows == np.arange(5, dtype=np.float32))
    if transport.is_server:
        assert transport.ledger.round_totals(2) == {"up": 0, "down": 11 * 20}
        size = transport.size
        assert transport.physical.total_bytes == 20 * (size - 1)


@pytest.mark.mpi(min_size=2)
def test_wrong_payload_shape_is_refused(transport):
    msg = Message("delta", "up", 4)
    with pytest.raises(ValueError, match="expected"):
        transport.up(1, "train", msg, np.zeros((99, 4), dtype=np.float32), np.arange(11))
