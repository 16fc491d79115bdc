"""Devices on a real world communicator: every rank of this (one-node) job finds the node's worker ranks,
the server is not one of them, and a server without GPU work never asks CUDA anything.
Run: mpirun -n 3 python -m pytest --with-mpi tests/mpi/test_device_mpi.py"""

import pytest
import torch

from mpifl.schema import ConfigError
from mpifl.training.device import RankDevices, node_ranks, node_workers, rank_devices


@pytest.mark.mpi(min_size=2)
def test_the_server_is_no_worker_and_workers_count_from_zero():
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    assert node_ranks(world) == list(range(size))  # the test job runs on one node
    assert node_workers(world) == ((None if rank == 0 else rank - 1), size - 1)


@pytest.mark.mpi(min_size=2)
def test_a_server_without_networks_on_a_gpu_never_asks_cuda(monkeypatch):
    """device: cuda puts the workers' clients on GPUs; rank 0 (server.device: cpu) opens no GPU context: it does
    not even count the GPUs. Without a GPU the workers refuse in one line."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.Get_rank() == 0:
        def no_cuda() -> bool:
            raise AssertionError("the server asked CUDA")

        monkeypatch.setattr(torch.cuda, "is_available", no_cuda)
    try:
        devices = rank_devices("cuda", "cpu", world)
    except ConfigError as exc:
        assert world.Get_rank() > 0 and not torch.cuda.is_available()
        assert str(exc).startswith(f"device: 'cuda', but PyTorch sees no CUDA GPU on rank {world.Get_rank()}")
    else:
        assert devices.server == torch.device("cpu")
        assert devices.clients.type == ("cpu" if world.Get_rank() == 0 else "cuda")
    assert rank_devices("cpu", "cpu", world) == RankDevices()
