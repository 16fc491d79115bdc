"""Per-client state owned by the runtime: ``state[client][name]`` is a numpy array, or a tensor kept on a GPU.

An algorithm keeps nothing about a client between rounds except here. During a round it edits a
client's working copy; the runtime then decides the client's fate: the edits are committed when the
server accepted every update the client sent, and discarded when one was rejected (a non-finite
update), so a client whose update never reached the server keeps exactly the state it had before the
round. That is what keeps SCAFFOLD's c = Σᵢ wᵢcᵢ exact under rejections. The runtime checkpoints the
committed states by client id and restores them on any rank count, so no algorithm writes checkpoint
code, and an algorithm that never writes state is stateless by observation.
"""

from __future__ import annotations

import json
import math
import tempfile
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import overload

import numpy as np
import torch

from mpifl.training.device import host_numpy
from mpifl.training.sgd import to_device

Entry = np.ndarray | torch.Tensor
StateDict = dict[str, Entry]
HostState = dict[str, np.ndarray]
"""A state as checkpoints and moves between ranks carry it: arrays only."""


class ClientState:
    """The states of the clients one rank hosts: committed (what survives rounds) and this round's edits.

    With a memory budget (``state_memory_gb``) the committed states beyond it are spilled to disk, least
    recently used first, one ``.npz`` file per client in a folder of this rank's own (rewriting a client
    replaces its file, so the disk holds each client once), and read back when next used: the same arrays, bit
    for bit, so results do not change; only time does. This round's edits always stay in memory.

    An entry may be a tensor on a GPU (an algorithm that keeps a client's state where it trains: SCAFFOLD's
    control): it stays there within ``device_budget_bytes`` (``state_device_gb``), beyond it the least recently
    used clients' tensors come to host memory (and may spill from there), the same bits. A tensor on the CPU is
    kept as an array. Checkpoints and moves between ranks take host copies (:meth:`export_states`).
    """

    def __init__(self, budget_bytes: float = math.inf, spill_dir: str | Path | None = None,
                 device_budget_bytes: float | None = None) -> None:
        """``device_budget_bytes``: GPU memory for tensor entries; None: :data:`DEVICE_SHARE` of the GPU's."""
        self._committed: OrderedDict[int, StateDict] = OrderedDict()  # in memory, least recently used first
        self._working: dict[int, StateDict] = {}
        self._on_device: OrderedDict[int, None] = OrderedDict()  # committed clients with tensor entries, LRU first
        self.budget_bytes = budget_bytes
        self.device_budget_bytes = device_budget_bytes
        self.memory_bytes = 0  # of the committed states in memory
        self.device_bytes = 0  # of their tensor entries on the GPU
        self._spilled: set[int] = set()
        self._disk: tempfile.TemporaryDirectory | None = None
        if budget_bytes < math.inf:
            self._disk = tempfile.TemporaryDirectory(prefix="mpifl-state-", dir=spill_dir)
        self.spills = self.reloads = 0  # states written to disk / read back, so far

    def read(self, client: int) -> Mapping[str, Entry]:
        """``client``'s state as this round left it so far (read-only arrays, tensors as kept; empty if none)."""
        if client in self._working:
            return {name: _read_only(value) for name, value in self._working[client].items()}
        return self._resident(client) or {}

    @overload
    def get(self, client: int, name: str) -> np.ndarray | None: ...
    @overload
    def get(self, client: int, name: str, default: np.ndarray) -> np.ndarray: ...

    def get(self, client: int, name: str, default: np.ndarray | None = None) -> np.ndarray | None:
        """``client``'s entry ``name`` as an array (a tensor entry copied to the host), or ``default`` while it
        has none (e.g. the initial model)."""
        value = self.read(client).get(name)
        if value is None:
            return default
        return _host_read_only(value)

    def get_on(self, client: int, name: str, device: torch.device) -> torch.Tensor | None:
        """``client``'s entry ``name`` as a tensor on ``device``: a tensor kept there as it is (no copy: do not
        change it), an array copied (up); None while it has none."""
        value = self.read(client).get(name)
        if value is None or isinstance(value, torch.Tensor) and value.device == device:
            return value
        return to_device(torch.tensor(value), device)  # a copy: the array is read-only

    def edit(self, client: int) -> StateDict:
        """``client``'s working copy for this round, created from its committed state on first use: the
        algorithm may change its arrays in place and add or replace entries until the round ends."""
        if client not in self._working:
            self._working[client] = {name: value.clone() if isinstance(value, torch.Tensor) else value.copy()
                                     for name, value in (self._resident(client) or {}).items()}
        return self._working[client]

    def commit(self, clients: Iterable[int]) -> None:
        """Keep these clients' edits of this round."""
        for client in clients:
            edits = self._working.pop(int(client), None)
            if edits is not None:
                self._keep(int(client), {name: _frozen(name, value) for name, value in edits.items()})
        self._fit_device()
        self._spill()

    def discard(self, clients: Iterable[int]) -> None:
        """Forget these clients' edits of this round: their state is what it was before it."""
        for client in clients:
            self._working.pop(int(client), None)

    def clients(self) -> list[int]:
        """Clients that have committed state, in id order."""
        return sorted(self._spilled.union(self._committed))

    def export_states(self, clients: Iterable[int] | None = None) -> dict[int, HostState]:
        """Committed states (all, or of ``clients``) by client id, e.g. for a checkpoint; a spilled state is read
        from disk without being kept in memory."""
        ids = self.clients() if clients is None else [int(c) for c in clients]
        out = {}
        for client in ids:
            if client in self._committed:
                out[client] = _on_host(self._committed[client])
            elif client in self._spilled:
                out[client] = self._load(client)
        return out

    def import_states(self, states: Mapping[int, Mapping[str, np.ndarray]]) -> None:
        """Take these committed states (e.g. read back from a checkpoint), replacing what was there."""
        for client, state in states.items():
            self._keep(int(client), {name: _frozen(name, np.asarray(value)) for name, value in state.items()})
            self._spill()

    def drop(self, clients: Iterable[int]) -> None:
        """Forget these clients entirely (visitors that went home)."""
        for client in clients:
            self._forget(int(client))
            self._working.pop(int(client), None)

    def close(self) -> None:
        """Remove the spill folder (also done at exit)."""
        if self._disk is not None:
            self._disk.cleanup()

    # ------------------------------------------------------------------------------------------- spilling
    def _resident(self, client: int) -> StateDict | None:
        """``client``'s committed state, brought back into memory if it was spilled; now the most recent."""
        if client in self._spilled:
            self._keep(client, self._load(client))
            self.reloads += 1
            self._spill(keep=client)
        elif client in self._committed:
            self._committed.move_to_end(client)
            if client in self._on_device:
                self._on_device.move_to_end(client)
        return self._committed.get(client)

    def _keep(self, client: int, state: Mapping[str, Entry]) -> None:
        self._forget(client)
        self._committed[client] = dict(state)
        self.memory_bytes += _nbytes(state, host=True)
        if _nbytes(state, host=False):
            self.device_bytes += _nbytes(state, host=False)
            self._on_device[client] = None

    def _forget(self, client: int) -> None:
        if client in self._committed:
            state = self._committed.pop(client)
            self.memory_bytes -= _nbytes(state, host=True)
            self.device_bytes -= _nbytes(state, host=False)
            self._on_device.pop(client, None)
        if client in self._spilled:
            self._spilled.discard(client)
            self._file(client).unlink()

    def _fit_device(self) -> None:
        """Bring the least recently used clients' tensor entries to the host until the rest fit the GPU's budget
        (all of a CPU's: there, the host is the device)."""
        while self._on_device:
            client = next(iter(self._on_device))
            tensors = [v for v in self._committed[client].values() if isinstance(v, torch.Tensor)]
            if self.device_bytes <= self._device_budget(tensors[0].device):
                return
            self._keep(client, _on_host(self._committed[client]))

    def _device_budget(self, device: torch.device) -> float:
        if device.type == "cpu":
            return 0.0
        if self.device_budget_bytes is None:
            self.device_budget_bytes = DEVICE_SHARE * torch.cuda.get_device_properties(device).total_memory
        return self.device_budget_bytes

    def _spill(self, keep: int | None = None) -> None:
        """Write the least recently used committed states to disk until the rest fit the budget."""
        while self.memory_bytes > self.budget_bytes and len(self._committed) > (keep is not None):
            client = next(c for c in self._committed if c != keep)
            state = _on_host(self._committed[client])
            self._forget(client)
            names = list(state)  # positional arrays: a state's names are not valid keyword arguments
            np.savez(self._file(client), *(state[name] for name in names), names=np.array(names, dtype=str))
            self._spilled.add(client)
            self.spills += 1

    def _load(self, client: int) -> HostState:
        with np.load(self._file(client), allow_pickle=False) as saved:
            return {str(name): _host_read_only(saved[f"arr_{i}"]) for i, name in enumerate(saved["names"])}

    def _file(self, client: int) -> Path:
        assert self._disk is not None, "only a budgeted state spills"
        return Path(self._disk.name) / f"{client}.npz"


DEVICE_SHARE = 0.25
"""``state_device_gb: auto``: the share of a GPU's memory that client states may keep there."""


def _nbytes(state: Mapping[str, Entry], host: bool) -> int:
    """The bytes of ``state``'s arrays (``host``) or of its tensors."""
    return sum(value.nbytes for value in state.values() if isinstance(value, np.ndarray) == host)


def _on_host(state: StateDict) -> HostState:
    """``state`` with every tensor entry copied to a (read-only) host array."""
    return {name: _host_read_only(value) for name, value in state.items()}


def pack_states(states: Mapping[int, Mapping[str, np.ndarray]]) -> np.ndarray:
    """Client states as one flat byte buffer (to move between ranks): an 8-byte header length, a JSON header
    of (client, name, dtype, shape) entries, then every array's raw bytes in that order. Exact bytes, no pickle."""
    entries, chunks = [], []
    for client in sorted(states):
        for name, value in states[client].items():
            array = np.ascontiguousarray(value)
            entries.append([int(client), name, array.dtype.str, list(array.shape)])
            chunks.append(array.view(np.uint8).reshape(-1))
    header = np.frombuffer(json.dumps(entries).encode(), dtype=np.uint8)
    size = np.frombuffer(np.array([len(header)], dtype="<u8").tobytes(), dtype=np.uint8)
    return np.concatenate([size, header, *chunks]) if chunks else np.concatenate([size, header])


def unpack_states(blob: np.ndarray) -> dict[int, HostState]:
    """The inverse of :func:`pack_states` (each array a copy of its bytes)."""
    if blob.size == 0:
        return {}
    length = int(blob[:8].view("<u8")[0])
    entries = json.loads(blob[8 : 8 + length].tobytes())
    out: dict[int, HostState] = {}
    offset = 8 + length
    for client, name, dtype, shape in entries:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        out.setdefault(client, {})[name] = blob[offset : offset + nbytes].copy().view(dtype).reshape(shape)
        offset += nbytes
    return out


def _frozen(name: str, value: Entry) -> Entry:
    if not isinstance(value, np.ndarray | torch.Tensor):
        raise TypeError(f"client state {name!r} must be a numpy array or a tensor, got {type(value).__name__}")
    return _read_only(_owned(value))


def _owned(value: Entry) -> Entry:
    """``value`` in memory of its own: a row of a larger block (a view: SCAFFOLD's cᵢ⁺ are rows of the call's
    batch of mean gradients) is copied out, on its device, so that the state holds the bytes it counts. Kept as a
    view, each row would keep its whole block alive, on the GPU too, for as long as its client is not sampled
    again: under partial participation several times the state's counted bytes, beyond its budgets."""
    if isinstance(value, torch.Tensor):
        return value.clone() if value.untyped_storage().nbytes() > value.numel() * value.element_size() else value
    root = value
    while isinstance(root.base, np.ndarray):
        root = root.base
    if root.base is None:  # numpy's own memory
        whole = root.nbytes == value.nbytes
    else:  # a CPU tensor's (Tensor.numpy()), or another owner's: kept only where it holds no more than the array
        whole = isinstance(root.base, torch.Tensor) and root.base.untyped_storage().nbytes() == value.nbytes
    return value if whole else value.copy()


def _host_read_only(value: Entry) -> np.ndarray:
    """``value`` as a read-only host array (a tensor copied from its device)."""
    array = host_numpy(value) if isinstance(value, torch.Tensor) else value.view()
    array.setflags(write=False)
    return array


def _read_only(value: Entry) -> Entry:
    """An array's read-only view (a tensor has no such flag: as it is)."""
    if isinstance(value, torch.Tensor):
        return value
    view = value.view()
    view.setflags(write=False)
    return view
