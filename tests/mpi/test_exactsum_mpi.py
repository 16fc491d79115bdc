"""Exact sums over a real communicator (``mpirun -n 3 python -m pytest --with-mpi tests/mpi/test_exactsum_mpi.py``):
however the rows are spread over the ranks and ordered on each, one MPI.SUM of the int64 buffers gives the
correctly rounded exact total, bit for bit, whether the ranks fold with numpy or with torch (here on the CPU)."""

import numpy as np
import pytest
import torch

from mpifl.comm.exactsum import ExactSum, Window, _backends, round_sum, words
from tests.comm.test_exactsum import adversarial_rows, reference, same_bits

ROWS, SIZE, CHUNK = 24, 300, 64


def spreads(ranks: int) -> dict[str, list[list[int]]]:
    """Rows per rank, in the order each rank folds them."""
    rng = np.random.default_rng(2)
    owner = rng.integers(0, ranks, ROWS)
    return {
        "round robin": [list(range(r, ROWS, ranks)) for r in range(ranks)],
        "blocks, reversed": [list(reversed(block)) for block in np.array_split(np.arange(ROWS), ranks)],
        "all on the last rank": [[] for _ in range(ranks - 1)] + [list(range(ROWS))],
        "random, shuffled": [list(rng.permutation(np.flatnonzero(owner == r))) for r in range(ranks)],
    }


@pytest.fixture
def data(monkeypatch):
    monkeypatch.setattr(_backends, "CHUNK", CHUNK)  # several chunks per row, and a wire split at whole chunks
    rng = np.random.default_rng(9)
    rows = adversarial_rows(rng, ROWS, SIZE)
    rows[ROWS // 2 :] *= 1e-150  # ranks holding only these see a far lower window than the others
    return rows, rng.uniform(-3, 3, ROWS)


def local_total(comm, rows, weights, mine, device="numpy") -> tuple[ExactSum, Window]:
    from mpi4py import MPI

    if device == "mixed":  # odd ranks torch, even ones numpy: their words add up all the same
        device = ("numpy", "cpu")[comm.Get_rank() % 2]
    total = ExactSum(SIZE, device)
    for i in mine:
        total.add(rows[i] if device == "numpy" else torch.from_numpy(rows[i]).to(device), weights[i])
    maxima = total.window.maxima()
    comm.Allreduce(MPI.IN_PLACE, maxima, op=MPI.MAX)
    return total, Window.from_maxima(maxima)


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("device", ["numpy", "cpu", "mixed"])
def test_any_spread_over_ranks_reduces_to_the_same_bits(data, device):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rows, weights = data
    results = {}
    for name, spread in spreads(comm.Get_size()).items():
        total, agreed = local_total(comm, rows, weights, spread[comm.Get_rank()], device)
        wire = total.export(agreed)
        summed = np.empty_like(wire) if comm.Get_rank() == 0 else None
        comm.Ireduce(wire, summed, op=MPI.SUM, root=0).Wait()
        if comm.Get_rank() == 0:
            results[name] = round_sum(summed, agreed)
    if comm.Get_rank() == 0:
        expected = reference(rows, weights)
        for name, result in results.items():
            assert same_bits(result, expected), name


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("device", ["numpy", "cpu", "mixed"])
def test_a_reduce_scatter_over_whole_chunks_gives_the_same_bits(data, device):
    """Each rank reduces and rounds a block of whole chunks; rank 0 gathers the float64 blocks."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rows, weights = data
    spread = spreads(comm.Get_size())["random, shuffled"]
    total, agreed = local_total(comm, rows, weights, spread[comm.Get_rank()], device)
    wire, per = total.export(agreed), words(agreed)
    chunks = np.array_split(np.arange(-(-SIZE // CHUNK)), comm.Get_size())
    entries = [min(SIZE, CHUNK * (c[-1] + 1)) - CHUNK * c[0] if len(c) else 0 for c in chunks]
    block = np.empty(entries[comm.Get_rank()] * per, dtype=np.int64)
    comm.Reduce_scatter(wire, block, recvcounts=[e * per for e in entries], op=MPI.SUM)
    mine = round_sum(block, agreed)
    gathered = np.empty(SIZE) if comm.Get_rank() == 0 else None
    comm.Gatherv(mine, (gathered, entries) if comm.Get_rank() == 0 else None, root=0)
    if comm.Get_rank() == 0:
        assert same_bits(gathered, reference(rows, weights))


def workers_sum():  # noqa: ANN201 - (the world, a DistributedSum over it, the worker count)
    """A float64 message of two groups summed over the world, its clients 2 per worker (client i on worker
    i mod workers + 1): the sum, not yet given any term."""
    from mpi4py import MPI

    from mpifl.comm.exactsum.distributed import DistributedSum
    from mpifl.comm.messages import Message
    from mpifl.comm.placement import Placement
    from mpifl.comm.transport import Transport

    comm = MPI.COMM_WORLD
    workers = comm.Get_size() - 1
    msg = Message("delta", "up", SIZE, "float64", summed="samples", groups=2)
    transport = Transport(comm, Placement(np.arange(2 * workers) % workers + 1, comm.Get_size()))
    return comm, DistributedSum(msg, transport), workers


@pytest.mark.mpi(min_size=3)
@pytest.mark.parametrize("few", [True, False])
def test_the_transport_moves_the_cheaper_of_rows_and_totals_with_the_same_bits(data, few):
    """Two float64 rows per worker (16 B per entry) are cheaper than the totals' wire words: they are gathered
    and folded on rank 0. A worker that kept none (too many to keep) makes the workers reduce-scatter their words
    and round their shares, and rank 0 gathers the float64 sums (it neither exports nor rounds). Either way each
    group's sum is the correctly rounded exact sum, bit for bit."""
    comm, part, workers = workers_sum()
    rows, weights = data
    if not few and comm.Get_rank() == 1:
        part.kept = None  # as if it had folded too many to keep
    for i in range(2 * workers):
        if i % workers == comm.Get_rank() - 1:
            part.add(rows[i], weights[i], i % 2)
    sums = part.total(1)
    transport = part.transport
    if comm.Get_rank() == 0:
        ops = {op for _, name, op, _, _ in transport.physical.rows if name == "delta"}
        assert ops == {"gatherv"}  # rank 0 takes no part in the workers' reduce-scatter
        moved = {(name, op): nbytes for _, name, op, nbytes, _ in transport.physical.rows}
        assert moved[("delta_window", "allreduce")] == 5 * 8  # lowest and highest bit, terms kept, folded, on rank 0
        if few:  # each term: its weight and group (two float64), then its row
            assert moved[("delta_sizes", "gather")] == 8
            assert moved[("delta", "gatherv")] == 2 * workers * (16 + SIZE * 8)
        else:  # each group's sums, rounded by the workers: one float64 per entry
            assert moved[("delta", "gatherv")] == 2 * SIZE * 8
        for group in (0, 1):
            chosen = list(range(group, 2 * workers, 2))
            assert same_bits(sums[group], reference(rows[chosen], weights[chosen])), group
    else:
        assert sums is None


@pytest.mark.mpi(min_size=3)
def test_a_server_that_folds_terms_too_takes_the_reduced_totals_with_the_same_bits(data):
    """Where rank 0 folds a term of its own, the totals' wire words are reduced onto it (one MPI.SUM), and it
    rounds them: each group's sum is still the correctly rounded exact sum of every term, its own included."""
    comm, part, workers = workers_sum()
    rows, weights = data
    own = 2 * workers  # rank 0's term, in group 0
    if comm.Get_rank() == 1:
        part.kept = None  # as if it had folded too many to keep: the totals move, not the rows
    for i in range(2 * workers + 1):
        if (i == own and comm.Get_rank() == 0) or (i < own and i % workers == comm.Get_rank() - 1):
            part.add(rows[i], weights[i], i % 2)
    sums = part.total(1)
    if comm.Get_rank() == 0:
        assert {op for _, name, op, _, _ in part.transport.physical.rows if name == "delta"} == {"reduce"}
        for group in (0, 1):
            chosen = list(range(group, 2 * workers + 1, 2))
            assert same_bits(sums[group], reference(rows[chosen], weights[chosen])), group
    else:
        assert sums is None
