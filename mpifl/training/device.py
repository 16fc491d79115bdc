"""Which torch device a rank computes on, how it is set up, and how tensors cross between it and the host.

A rank's clients (workspace models, data tensors) live on its device; everything that crosses to MPI
stays numpy in host memory. On a GPU, device→host copies go through pinned host memory, so no
CUDA-aware MPI is needed. On the CPU nothing changes: host views are the tensors' own memory.

Workers map to GPUs by their index among the worker ranks of their node (:func:`worker_gpu`); the server
(rank 0) is not one of them and opens no GPU context unless ``server.device`` gives its networks a GPU
(PeFLL's and pFedHN's), or it is the only rank and hosts the clients itself. docs/how-to/gpus.md says more.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mpifl import cpukernels
from mpifl.schema import ConfigError

CPU = torch.device("cpu")
CUBLAS_WORKSPACE = ":4096:8"
"""cuBLAS's workspace setting that makes its GEMMs deterministic (NVIDIA's cuBLAS docs, "Results
reproducibility"); read when cuBLAS starts, so it is set before a rank's first CUDA operation."""


@dataclass(frozen=True)
class RankDevices:
    """Where one rank computes: its clients (workers, and rank 0 of a one-rank job) and the server's
    networks (rank 0 only); the CPU for whatever the rank does not do."""

    clients: torch.device = CPU
    server: torch.device = CPU


def worker_gpu(worker: int, workers: int, gpus: int) -> int:
    """The GPU of the ``worker``-th of a node's ``workers`` worker ranks (0-based, the server not counted)
    when ``gpus`` are visible: consecutive workers share a GPU in blocks as even as can be (8 workers on 4
    GPUs: 0 0 1 1 2 2 3 3; 3 on 2: 0 0 1; 2 on 4: 0 2). Consecutive blocks because launchers bind
    consecutive ranks to the same socket, and GPUs are numbered by socket too."""
    if gpus < 1 or not 0 <= worker < workers:
        raise ValueError(f"worker {worker} of {workers} on {gpus} GPUs")
    return worker * gpus // workers


def server_gpu(workers: int, gpus: int) -> int:
    """The GPU for the server's networks on a node whose ``workers`` worker ranks share ``gpus`` GPUs: the
    first one that serves the fewest of them (GPU 0 on a node without workers)."""
    load = [0] * gpus
    for worker in range(workers):
        load[worker_gpu(worker, workers, gpus)] += 1
    return load.index(min(load))


def pick_device(setting: str, gpus: int, gpu: int, where: str = "this rank", key: str = "device") -> str:
    """The device for ``setting`` (``cpu``, ``cuda`` or ``auto``) where ``gpus`` GPUs are visible and this
    rank's is ``gpu``: ``cuda:gpu`` for ``cuda``, and for ``auto`` when a GPU is visible; ``cpu`` otherwise.
    ``cuda`` without a GPU is a :class:`ConfigError` naming the config ``key``."""
    if setting == "cpu":
        return "cpu"
    if gpus > 0:
        return f"cuda:{gpu}"
    if setting == "cuda":
        raise ConfigError(f"{key}: 'cuda', but PyTorch sees no CUDA GPU on {where} (CPU-only build, no GPU "
                          "allocated, or CUDA_VISIBLE_DEVICES empty); use 'auto' or 'cpu'")
    return "cpu"


def node_ranks(comm) -> list[int]:  # noqa: ANN001 - an mpi4py Comm
    """The ranks of ``comm`` on this process's node, ascending: MPI's shared-memory split (MPI 3), else the
    ranks reporting the same host name. A collective: every rank of ``comm`` calls it."""
    from mpi4py import MPI

    try:
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    except (NotImplementedError, MPI.Exception):  # an MPI older than 3.0
        names = comm.allgather(platform.node())
        return [r for r, name in enumerate(names) if name == names[comm.Get_rank()]]
    ranks = node.allgather(comm.Get_rank())
    node.Free()
    return sorted(ranks)


def node_workers(comm) -> tuple[int | None, int]:  # noqa: ANN001 - an mpi4py Comm
    """(this rank's index among its node's worker ranks, or ``None`` for the server; how many worker ranks its
    node has). Rank 0 is the server, a worker too only when it is the only rank. A collective over ``comm``."""
    if comm is None or comm.Get_size() == 1:
        return 0, 1
    workers = [r for r in node_ranks(comm) if r > 0]
    rank = comm.Get_rank()
    return (workers.index(rank) if rank > 0 else None), len(workers)


def cuda_count() -> int:
    """GPUs visible to this process (0 with a CPU-only PyTorch)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def rank_devices(clients: str, server: str = "cpu", comm=None, allow_tf32: bool = False,  # noqa: ANN001 - a Comm
                 data_bytes: float = 0.0) -> RankDevices:
    """This rank's devices for config ``device: clients`` and ``server.device: server``, set up once: TF32 as
    ``allow_tf32`` says (:func:`set_tf32`), and on a rank with GPU work the deterministic settings
    (:func:`make_deterministic`), its GPU made current, and a check that the ``data_bytes`` of client data each
    worker may keep fit the GPU's free memory beside those of the workers sharing it. A collective over
    ``comm`` unless both settings are ``cpu`` (the same on every rank, so either all ranks take part or none);
    a rank without GPU work never touches CUDA. First the CPU kernels (:func:`check_cpu_kernels`, a collective
    where ``comm`` has several ranks)."""
    check_cpu_kernels(comm)
    set_tf32(allow_tf32)
    if clients == "cpu" and server == "cpu":
        return RankDevices()
    worker, workers = node_workers(comm)
    rank = 0 if comm is None else comm.Get_rank()
    where = f"rank {rank} (host {platform.node()})"
    wants_gpu = (worker is not None and clients != "cpu") or (rank == 0 and server != "cpu")
    gpus = cuda_count() if wants_gpu else 0
    devices = RankDevices()
    if worker is not None:
        gpu = worker_gpu(worker, workers, gpus) if gpus else 0
        devices = RankDevices(clients=torch.device(pick_device(clients, gpus, gpu, where)))
    if rank == 0:
        gpu = (0 if worker is not None else server_gpu(workers, gpus)) if gpus else 0
        devices = RankDevices(devices.clients, torch.device(pick_device(server, gpus, gpu, where, "server.device")))
    used = [d for d in (devices.clients, devices.server) if d.type == "cuda"]
    if used:
        make_deterministic()
        torch.cuda.set_device(used[0])  # CUDA context and pinned buffers on this rank's GPU, not all on GPU 0
    if devices.clients.type == "cuda" and worker is not None:
        gpu = devices.clients.index or 0
        sharing = sum(worker_gpu(w, workers, gpus) == gpu for w in range(workers))
        free, total = torch.cuda.mem_get_info(devices.clients)
        check_data_fits(free, total, data_bytes, sharing, f"{devices.clients} of {where}")
    return devices


MKL_CBWR_BRANCH, MKL_CBWR_COMPATIBLE = 1, 3  # mkl_service.h: mkl_cbwr_get's query and the branch it names


def mkl_branch() -> int | None:
    """MKL's code-path branch in this process (``mkl_cbwr_get(MKL_CBWR_BRANCH)``, exported by torch's x86 wheels as
    ``mkl_serv_cbwr_get``); None where torch carries no MKL."""
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        get = lib.mkl_serv_cbwr_get
    except (OSError, AttributeError):
        return None
    get.argtypes, get.restype = [ctypes.c_int], ctypes.c_int
    return int(get(MKL_CBWR_BRANCH))


def cpu_kernels() -> str:
    """What this rank's CPU kernels are, as the results file records it."""
    capability = torch.backends.cpu.get_cpu_capability()
    if _kernels_kind() == "native":
        return f"native ({platform.machine()}, ATen {capability}; MKL and oneDNN choose by CPU)"
    return "portable (x86-64: MKL_CBWR=COMPATIBLE, ATen AVX2, oneDNN AVX2)"


def _kernels_kind() -> str:
    """``portable`` where this rank computes with the pinned kernels, else ``native``: what every rank must share
    (two native nodes may differ in their paths, which is what native means)."""
    return "portable" if cpukernels.mode() == "portable" and cpukernels.is_x86() else "native"


def check_cpu_kernels(comm=None) -> str:  # noqa: ANN001 - an mpi4py Comm
    """Refuse, in one line, a rank whose CPU kernels are not :mod:`mpifl.cpukernels`' (a wrong
    ``MPIFL_CPU_KERNELS``; a library that chose its path before ``import mpifl`` pinned it; a CPU without AVX2), and
    ranks of which some compute with the portable kernels and others not: either would let a client's bits depend
    on its node. Every rank reaches the one ``allgather`` (its own failure travels in it), so all raise the same
    line. Returns :func:`cpu_kernels`."""
    try:
        mine = (platform.node(), _cpu_kernels_problem(), _kernels_kind(), cpu_kernels())
    except Exception as exc:  # noqa: BLE001 - an unexpected torch or ctypes error must not skip the collective
        mine = (platform.node(), f"cannot tell its CPU kernels: {type(exc).__name__}: {exc}", "?", "?")
    ranks = comm.allgather(mine) if comm is not None and comm.Get_size() > 1 else [mine]
    for rank, (host, problem, _, _) in enumerate(ranks):
        if problem is not None:
            raise ConfigError(f"rank {rank} (host {host}): {problem}" if len(ranks) > 1 else problem)
    kinds: dict[str, list[str]] = {}
    for rank, (_, _, kind, _) in enumerate(ranks):
        kinds.setdefault(kind, []).append(str(rank))
    if len(kinds) > 1:
        raise ConfigError("ranks compute with different CPU kernels, so a client's bits would depend on its node: "
                          + "; ".join(f"rank(s) {', '.join(r)}: {kind}" for kind, r in kinds.items())
                          + f"; set {cpukernels.SETTING} the same for every rank (mpirun -x {cpukernels.SETTING})")
    return mine[3]


def _cpu_kernels_problem() -> str | None:
    """Why this rank's CPU kernels are not the ones its ``MPIFL_CPU_KERNELS`` asks for, or None."""
    setting = cpukernels.mode()
    if setting not in cpukernels.MODES:
        return f"{cpukernels.SETTING}={setting!r}: expected one of {', '.join(cpukernels.MODES)}"
    if _kernels_kind() == "native":
        return None
    if not cpukernels.has_avx2():
        return (f"this CPU has no AVX2, which the portable CPU kernels need; set {cpukernels.SETTING}=native on "
                "every rank (then bits depend on the node)")
    capability, branch = torch.backends.cpu.get_cpu_capability(), mkl_branch()
    if capability != "AVX2" or branch not in (None, MKL_CBWR_COMPATIBLE):
        return (f"the CPU kernels were chosen before mpifl could pin them (ATen {capability}, MKL branch {branch}): "
                f"import mpifl before torch computes anything, or set {cpukernels.SETTING}=native for this node's "
                "own (then bits depend on the node)")
    return None


def check_data_fits(free: int, total: int, data_bytes: float, sharing: int, where: str) -> None:
    """Refuse, before any client data is staged, a ``data_memory_gb`` budget (``data_bytes`` per worker) that
    the ``sharing`` worker ranks of one GPU cannot all keep in its ``free`` bytes (of ``total``): one line
    now, not an out-of-memory traceback in some later round."""
    need = sharing * data_bytes
    if need > free:
        ranks = "1 worker rank keeps" if sharing == 1 else f"{sharing} worker ranks each keep"
        raise ConfigError(f"data_memory_gb: {ranks} up to {data_bytes / 2**30:.2f} GB of client data on "
                          f"{where}, {need / 2**30:.2f} GB in all, but it has {free / 2**30:.2f} GB free of "
                          f"{total / 2**30:.2f} GB; lower data_memory_gb or put fewer ranks on each GPU")


def set_tf32(allow: bool) -> None:
    """TF32 (10-bit mantissa products) in CUDA matrix products and cuDNN convolutions and RNNs: off unless
    ``allow``, so a GPU's float32 arithmetic is float32's (PyTorch leaves cuDNN's on by default). Only the
    CUDA flags are turned on: the general ``float32_matmul_precision('high')`` would let oneDNN round CPU
    products differently too."""
    if not allow:
        torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = allow
    torch.backends.cudnn.allow_tf32 = allow


def make_deterministic() -> None:
    """Deterministic GPU kernels for every model kind (the LSTM's cuBLAS calls included), set before the
    rank's first CUDA operation. An operation PyTorch has no deterministic kernel for warns once instead of
    stopping the run: ResNet-20's global average pool has none for its backward pass, but with one output
    per channel every input gradient receives one contribution, so it is deterministic in fact."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.use_deterministic_algorithms(True, warn_only=True)


def host_numpy(tensor: torch.Tensor) -> np.ndarray:
    """``tensor`` as a numpy array in host memory: on the CPU a view (no copy), as ``Tensor.numpy()``;
    on a GPU a new array, copied through pinned host memory."""
    if tensor.device.type == "cpu":
        return tensor.numpy()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor)
    return host.numpy()


def host_floats(values: Sequence[torch.Tensor]) -> np.ndarray:
    """Device scalars (a client's per-step losses, say) as one float64 array: one device→host copy where
    reading them one by one would wait for the device once per value."""
    if not values:
        return np.empty(0)
    return host_numpy(torch.stack([v.detach().to(torch.float64) for v in values]))
