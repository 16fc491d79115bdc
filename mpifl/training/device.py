"""Which torch device a rank computes on, and how tensors cross between it and the host.

A rank's clients (workspace models, data tensors) live on its device; everything that crosses to MPI
stays numpy in host memory. On a GPU, device→host copies go through pinned host memory, so no
CUDA-aware MPI is needed. On the CPU nothing changes: host views are the tensors' own memory.

GPU ranks are mapped by their rank within the node: local rank ``r`` uses ``cuda:(r % visible GPUs)``,
so 8 ranks on a node with 4 GPUs put 2 ranks on each, and rank 0 (the server) shares GPU 0 with the
workers of its node (the server's own state stays on the CPU).
"""

from __future__ import annotations

import os
import platform

import numpy as np
import torch

from mpifl.schema import ConfigError

LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID")
"""Launcher variables holding a process's rank within its node (Open MPI, MPICH/Intel MPI, Slurm)."""


def pick_device(setting: str, local_rank: int, cuda_count: int, where: str = "this rank") -> str:
    """The device for ``setting`` (``cpu``, ``cuda`` or ``auto``) of the process with ``local_rank`` on a
    node where ``cuda_count`` GPUs are visible: ``cuda:(local_rank % cuda_count)`` for ``cuda``, and for
    ``auto`` when a GPU is visible; ``cpu`` otherwise. ``cuda`` without a GPU is a :class:`ConfigError`."""
    if setting == "cpu":
        return "cpu"
    if cuda_count > 0:
        return f"cuda:{local_rank % cuda_count}"
    if setting == "cuda":
        raise ConfigError(f"device: 'cuda', but PyTorch sees no CUDA GPU on {where} (CPU-only build, no GPU "
                          "allocated, or CUDA_VISIBLE_DEVICES empty); use 'auto' or 'cpu'")
    return "cpu"


def local_rank(comm=None) -> int:  # noqa: ANN001 - an mpi4py Comm
    """This process's rank among the processes of its node: from MPI's shared-memory split of ``comm``
    (any MPI; a collective, so every rank of ``comm`` must call it), else from the launcher's variables."""
    if comm is not None:
        from mpi4py import MPI

        try:
            node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        except (NotImplementedError, MPI.Exception):  # an MPI older than 3.0
            pass
        else:
            rank = node.Get_rank()
            node.Free()
            return rank
    for name in LOCAL_RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def cuda_count() -> int:
    """GPUs visible to this process (0 with a CPU-only PyTorch)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_device(setting: str, comm=None) -> torch.device:  # noqa: ANN001 - an mpi4py Comm
    """The device of this rank for config ``device: setting`` (a collective over ``comm`` unless ``cpu``)."""
    if setting == "cpu":  # the same on every rank, so either all ranks split the communicator or none
        return torch.device("cpu")
    where = "this rank" if comm is None else f"rank {comm.Get_rank()}"
    where += f" (host {platform.node()})"
    device = torch.device(pick_device(setting, local_rank(comm), cuda_count(), where))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # CUDA context and pinned buffers on this rank's GPU, not all on GPU 0
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    return device


def host_numpy(tensor: torch.Tensor) -> np.ndarray:
    """``tensor`` as a numpy array in host memory: on the CPU a view (no copy), as ``Tensor.numpy()``;
    on a GPU a new array, copied through pinned host memory."""
    if tensor.device.type == "cpu":
        return tensor.numpy()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor)
    return host.numpy()
