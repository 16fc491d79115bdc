"""State to and from HDF5: what a checkpoint holds (when to take one and where it goes: the runtime's
:mod:`~mpifl.runtime.checkpointer`), as plain HDF5 trees, every algorithm's state saved and restored without pickle.

A worker's state is its clients' committed states (:class:`~mpifl.algorithms.state.ClientState`), one group
per client id, so a resume hands each client's state to whichever worker hosts it now. A server
algorithm's state is whatever its attributes hold, minus what is rebuilt from the config
(``ctx``, the protocol; frozen dataclasses such as options). ``write_object``
turns that object graph into a tree of arrays and scalars; ``read_object`` writes it back into a
freshly built algorithm: modules and optimizers load in place; a class lists attributes derived
from others in ``checkpoint_derived`` (e.g. a flat buffer that a module's parameters view).
Nothing in a checkpoint is ever executed: the only classes that can be instantiated are mpifl's
own, and unknown value types are refused at save time, so a new algorithm cannot silently lose
state.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
from torch import nn

from mpifl.algorithms.state import ClientState
from mpifl.comm.messages import Message
from mpifl.results import KEPT, SHARDS, shard_dir
from mpifl.results.space import STORAGE_ERRNOS, written_hdf5
from mpifl.schema import ConfigError

SKIPPED_ATTRIBUTES = frozenset({"ctx", "protocol", "handler_table"})
"""Rebuilt from the config on resume, in every server algorithm (the handler table: from its methods)."""

_TORCH_DTYPES = {str(t): t for t in (torch.float32, torch.float64, torch.float16, torch.int64, torch.int32,
                                     torch.uint8, torch.bool, torch.bfloat16)}


def _key(key: Any) -> str:
    if isinstance(key, bool) or not isinstance(key, (int, np.integer, str)):
        raise TypeError(f"dict key {key!r} of type {type(key).__name__} cannot be checkpointed")
    return f"i:{int(key)}" if isinstance(key, (int, np.integer)) else "s:" + key.replace("/", "\\x2f")


def _unkey(name: str) -> int | str:
    return int(name[2:]) if name.startswith("i:") else name[2:].replace("\\x2f", "/")


def _skip(value: Any) -> bool:
    frozen = dataclasses.is_dataclass(value) and not isinstance(value, type) and value.__dataclass_params__.frozen  # type: ignore[attr-defined]
    # a device comes from the config (server.device) and is chosen again on resume
    return frozen or isinstance(value, (Message, torch.nn.modules.loss._Loss, torch.device))


def write_state(group: h5py.Group, name: str, value: Any) -> None:
    """Write ``value`` as child ``name`` of ``group`` (a dataset or a subgroup, tagged with its kind)."""
    if isinstance(value, np.ndarray):
        node = group.create_dataset(name, data=value)
        node.attrs["kind"] = "array"
    elif isinstance(value, torch.Tensor):
        data = value.detach().cpu()
        node = group.create_dataset(name, data=data.float().numpy() if data.dtype == torch.bfloat16 else data.numpy())
        node.attrs["kind"], node.attrs["dtype"] = "tensor", str(data.dtype)
    elif value is None or isinstance(value, (bool, int, float, str, np.generic)):
        node = group.create_dataset(name, data=json.dumps(value.item() if isinstance(value, np.generic) else value))
        node.attrs["kind"] = "json"
    elif isinstance(value, np.random.Generator):
        node = group.create_dataset(name, data=json.dumps(value.bit_generator.state))
        node.attrs["kind"] = "np_generator"
    elif isinstance(value, torch.Generator):
        node = group.create_dataset(name, data=value.get_state().numpy())
        node.attrs["kind"] = "torch_generator"
    elif isinstance(value, nn.Module):
        node = group.create_group(name)
        node.attrs["kind"] = "module"
        for key, tensor in value.state_dict().items():
            write_state(node, _key(key), tensor)
    elif isinstance(value, torch.optim.Optimizer):
        node = group.create_group(name)
        node.attrs["kind"] = "optimizer"
        write_state(node, "state_dict", value.state_dict())
    elif isinstance(value, dict):
        node = group.create_group(name)
        node.attrs["kind"] = "dict"
        for key, item in value.items():
            write_state(node, _key(key), item)
    elif isinstance(value, (list, tuple)):
        node = group.create_group(name)
        node.attrs["kind"] = "tuple" if isinstance(value, tuple) else "list"
        for i, item in enumerate(value):
            write_state(node, str(i), item)
    elif type(value).__module__.startswith("mpifl."):
        node = group.create_group(name)
        node.attrs["kind"] = "object"
        node.attrs["class"] = f"{type(value).__module__}:{type(value).__qualname__}"
        write_object(node, value)
    else:
        raise TypeError(f"cannot checkpoint {name!r} of type {type(value).__module__}.{type(value).__qualname__}")


def write_object(group: h5py.Group, obj: Any, skip: frozenset[str] = SKIPPED_ATTRIBUTES) -> None:
    skip = skip | frozenset(getattr(obj, "checkpoint_derived", ()))
    for attr, value in vars(obj).items():
        if attr in skip or _skip(value) or inspect.isroutine(value) or isinstance(value, type):
            continue
        try:
            write_state(group, attr, value)
        except TypeError as exc:
            raise TypeError(f"{type(obj).__name__}.{attr}: {exc}") from None


def read_state(node: h5py.Dataset | h5py.Group, existing: Any = None) -> Any:
    """The value stored at ``node``. Arrays and tensors are new objects (a fresh algorithm may alias
    attributes that the saved one no longer did); modules and optimizers are loaded in place, so the
    parameters other objects refer to stay the same tensors."""
    kind = node.attrs["kind"]
    if kind == "array":
        return node[()]
    if kind == "tensor":  # on the device of the tensor it replaces (a server network's state on a GPU)
        device = existing.device if isinstance(existing, torch.Tensor) else None
        return torch.from_numpy(np.array(node[()])).to(device=device, dtype=_TORCH_DTYPES[node.attrs["dtype"]])
    if kind == "json":
        return json.loads(node[()])
    if kind == "np_generator":
        rng = existing if isinstance(existing, np.random.Generator) else np.random.default_rng()
        rng.bit_generator.state = json.loads(node[()])
        return rng
    if kind == "torch_generator":
        gen = existing if isinstance(existing, torch.Generator) else torch.Generator()
        gen.set_state(torch.from_numpy(np.array(node[()])))
        return gen
    if kind == "module":
        state = {_unkey(k): read_state(v) for k, v in node.items()}
        existing.load_state_dict(state)
        return existing
    if kind == "optimizer":
        existing.load_state_dict(read_state(node["state_dict"]))
        return existing
    if kind == "dict":
        old = existing if isinstance(existing, dict) else {}
        return {_unkey(k): read_state(v, old.get(_unkey(k))) for k, v in node.items()}
    if kind in ("list", "tuple"):
        before = list(existing) if isinstance(existing, (list, tuple)) else []
        items = [read_state(node[str(i)], before[i] if i < len(before) else None) for i in range(len(node))]
        return tuple(items) if kind == "tuple" else items
    if kind == "object":
        module, qualname = node.attrs["class"].split(":")
        if not module.startswith("mpifl."):
            raise ConfigError(f"checkpoint refers to class {module}.{qualname}, which is not mpifl's own")
        cls = getattr(importlib.import_module(module), qualname)
        obj = existing if isinstance(existing, cls) else cls.__new__(cls)
        read_object(node, obj)
        return obj
    raise ConfigError(f"checkpoint node {node.name} has unknown kind {kind!r}")


def read_object(group: h5py.Group, obj: Any) -> None:
    for attr, child in group.items():
        setattr(obj, attr, read_state(child, getattr(obj, attr, None)))


class _Tally:
    """Stands in for an h5py group where :func:`write_object` writes: counts the bytes and HDF5 objects it would
    write, and keeps none of them (:func:`state_size`)."""

    def __init__(self, counts: list[int]):
        self.counts, self.attrs = counts, dict[str, Any]()

    def create_group(self, name: str) -> _Tally:
        self.counts[1] += 1
        return _Tally(self.counts)

    def create_dataset(self, name: str, data: Any) -> _Tally:
        self.counts[0] += len(data.encode()) if isinstance(data, str) else np.asarray(data).nbytes
        self.counts[1] += 1
        return _Tally(self.counts)


def state_size(obj: Any) -> tuple[int, int]:
    """The bytes of data and the number of HDF5 objects (datasets, groups) ``obj``'s checkpoint file holds,
    counted without writing it or copying its arrays (a space estimate, :mod:`mpifl.runtime.footprint`); an
    optimizer that has not stepped yet counted with the state its first step makes."""
    counts = [0, 0]
    write_object(_Tally(counts), obj)  # a stand-in: the calls write_state makes, counted
    for optimizer in _optimizers(obj):
        if not optimizer.state:
            for group in optimizer.param_groups:
                buffers = OPTIMIZER_BUFFERS.get(type(optimizer).__name__, 0)
                if type(optimizer).__name__ == "SGD" and not group.get("momentum"):
                    buffers = 0
                for param in group["params"]:  # a group by parameter, its buffers and its step count
                    counts[0] += buffers * param.numel() * param.element_size() + 8 * (buffers > 1)
                    counts[1] += (1 + buffers + (buffers > 1)) * (buffers > 0)
    return counts[0], counts[1]


OPTIMIZER_BUFFERS = {"SGD": 1, "Adagrad": 1, "RMSprop": 1, "Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2,
                     "Adamax": 2}
"""The buffers of a parameter's shape each torch optimizer keeps (SGD: with momentum; Adam: two and a step)."""


def _optimizers(value: Any, depth: int = 4) -> Iterator[torch.optim.Optimizer]:
    """The torch optimizers among ``value``'s attributes, and theirs (mpifl objects, dicts, lists, tuples)."""
    if isinstance(value, torch.optim.Optimizer):
        yield value
    elif depth and isinstance(value, dict):
        for item in value.values():
            yield from _optimizers(item, depth - 1)
    elif depth and isinstance(value, (list, tuple)):
        for item in value:
            yield from _optimizers(item, depth - 1)
    elif depth and type(value).__module__.startswith("mpifl.") and hasattr(value, "__dict__"):
        for item in vars(value).values():
            yield from _optimizers(item, depth - 1)


def state_blob(obj: Any) -> np.ndarray:
    """``obj``'s state as the bytes of an in-memory HDF5 file (moved between ranks as a flat buffer)."""
    buffer = io.BytesIO()
    with h5py.File(buffer, "w") as f:
        write_object(f, obj)
    return np.frombuffer(buffer.getvalue(), dtype=np.uint8)


def load_state_blob(blob: np.ndarray, obj: Any) -> None:
    with h5py.File(io.BytesIO(blob.tobytes()), "r") as f:
        read_object(f, obj)


def _write_synced(path: Path, fill: Any) -> int:
    """An HDF5 file written by ``fill(file)`` under a temporary name, synced and renamed, so a file that exists
    is complete and on the disk. Returns its size."""
    # the temporary name prune_checkpoints knows; a full, read-only or failing file system leaves no half file
    with written_hdf5(path, "the checkpoint file", path.with_name(f".{path.name}.tmp"), STORAGE_ERRNOS,
                      durable=True) as f:
        fill(f)
    return path.stat().st_size


def write_client_shard(path: Path, state: ClientState) -> int:
    """A rank's committed client states into its own shard file, one client at a time (so a rank never holds a
    second copy of its clients' state): an HDF5 tree with one group per client id, one array per name. Returns
    its size."""
    def fill(f: h5py.File) -> None:
        states = f.create_group("states")
        states.attrs["kind"] = "dict"
        for client in state.clients():
            write_state(states, _key(client), state.export_states([client])[client])

    return _write_synced(path, fill)


def write_server_shard(path: Path, server: Any) -> int:
    """The server algorithm's state into its own file beside the results file (not inside it: HDF5 never gives
    back the space of a deleted group, so a results file holding checkpoints would grow with each). Returns its
    size."""
    return _write_synced(path, lambda f: write_object(f, server))


def shard_states(f: h5py.File, only: set[int] | None = None) -> dict[int, dict[str, np.ndarray]]:
    """The client states in one shard (or an old checkpoint's worker blob), by client id (``only`` these
    clients': the others are not read)."""
    if "states" not in f:
        return {}
    states = {}
    for key, node in f["states"].items():
        client = int(_unkey(key))
        if only is None or client in only:
            states[client] = {str(_unkey(name)): read_state(a) for name, a in node.items()}
    return states


def manifests(blobs: dict[str, np.ndarray]) -> list[tuple[int | None, list[dict[str, Any]]]]:
    """The checkpoints a results file's checkpoint group lists, newest first: (round, shard entries); the newest
    one's round is the group's own (``None`` here)."""
    newest = json.loads(blobs[SHARDS].tobytes()) if SHARDS in blobs else []
    kept = json.loads(blobs[KEPT].tobytes()) if KEPT in blobs else []
    return [(None, newest)] + [(int(k["round"]), k["shards"]) for k in kept]


def checkpoint_shards(path: str | Path, entries: list[dict[str, Any]]) -> dict[str, Path]:
    """The shard file of every rank that saved client states in one checkpoint of the results file ``path``
    ({"worker_R": file}; the server's own file is not one of them); one missing is a one-line error, since the
    file alone cannot resume."""
    files = {f"worker_{e['rank']}": shard_dir(path) / e["file"] for e in entries if not e.get("server")}
    for file in files.values():
        if not file.exists():
            raise ConfigError(f"--resume: {file}, a checkpoint shard of {path}, is missing (copy the folder "
                              f"{shard_dir(path).name} together with the results file)")
    return files


def complete(path: str | Path, entries: list[dict[str, Any]]) -> bool:
    """Whether every file of one checkpoint is there."""
    return all((shard_dir(path) / e["file"]).exists() for e in entries)


def load_server_state(path: str | Path, blobs: dict[str, np.ndarray], entries: list[dict[str, Any]],
                      server: Any) -> None:
    """The server's state from its file in the shard folder (or, in files written before that, from the
    checkpoint group itself)."""
    if "server" in blobs:
        load_state_blob(blobs["server"], server)
        return
    entry = next(e for e in entries if e.get("server"))
    with h5py.File(shard_dir(path) / entry["file"], "r") as f:
        read_object(f, server)


def read_client_states(path: str | Path) -> dict[str, dict[int, dict[str, np.ndarray]]]:
    """Every worker's client states in the last checkpoint of a results file: {"worker_R": {client: state}}."""
    blobs = read_checkpoint(path).tables["checkpoint"]
    out = {}
    for name, file in checkpoint_shards(path, manifests(blobs)[0][1]).items():
        with h5py.File(file, "r") as f:
            out[name] = shard_states(f)
    for name, blob in blobs.items():  # a checkpoint written before shards: the states inside the file
        if name.startswith("worker_"):
            with h5py.File(io.BytesIO(blob.tobytes()), "r") as f:
                out[name] = shard_states(f)
    return out


def load_client_states(path: str | Path, blobs: dict[str, np.ndarray], entries: list[dict[str, Any]],
                       state: ClientState, clients: np.ndarray) -> None:
    """Restore ``clients``' states from the shards of however many ranks saved them (any rank count), each
    shard opened and only these clients' groups read."""
    mine = {int(c) for c in clients}
    for file in checkpoint_shards(path, entries).values():
        with h5py.File(file, "r") as f:
            state.import_states(shard_states(f, mine))
    for name, blob in blobs.items():
        if name.startswith("worker_"):
            with h5py.File(io.BytesIO(blob.tobytes()), "r") as f:
                state.import_states(shard_states(f, mine))


def read_checkpoint(path: str | Path) -> Any:
    from mpifl.results import read_results

    saved = read_results(path, checkpoint=True, ledger=False)  # the per-client ledger stays in the file
    if "checkpoint" not in saved.tables:
        raise ConfigError(f"--resume: {path} holds no checkpoint (checkpoint_minutes saves one every so many "
                          "minutes of training, checkpoint_every every so many rounds)")
    return saved
