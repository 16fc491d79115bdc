"""Checkpoints: every rank's state saved at a round boundary, and back on any rank count.

The server's state is its algorithm object's (an HDF5 tree in the results file, never a pickle); a worker's is
the committed state of the clients it hosts, keyed by client id, in its own shard file beside the results file,
so no rank gathers another's state and a resume on another rank count hands each client's state to whichever
worker hosts it now. No algorithm writes checkpoint code.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from mpifl.algorithms.base import ServerAlgorithm
from mpifl.algorithms.state import ClientState
from mpifl.comm import Transport
from mpifl.config import RunConfig, config_to_dict
from mpifl.registry import parse_config
from mpifl.results import SHARDS, Results, shard_dir
from mpifl.runtime.timing import RankTimes
from mpifl.schema import ConfigError
from mpifl.state_io import load_client_states, load_state_blob, read_checkpoint, state_blob, write_client_shard


def shard_name(round_: int, rank: int) -> str:
    return f"round{round_}-rank{rank}.h5"


class Checkpointer:
    def __init__(self, transport: Transport, times: RankTimes, output: Path):
        self.transport, self.times, self.output = transport, times, output
        self.latest: dict[str, Any] | None = None  # rank 0: {"round": r, "blobs": {"server": ..., "worker_R": ...}}

    def take(self, round_: int, server: ServerAlgorithm | None, state: ClientState | None) -> None:
        """Every rank with client state writes it to its own shard file beside the results file, client by
        client; the server learns only each shard's size (a small collective), then keeps its own state and the
        shards' manifest, which go into the next results write and commit the checkpoint. A collective on
        every rank."""
        start = time.perf_counter()
        nbytes = -1
        if state is not None:
            folder = shard_dir(self.output)
            folder.mkdir(parents=True, exist_ok=True)
            nbytes = write_client_shard(folder / shard_name(round_, self.transport.rank), state)
        self.times.serialization += time.perf_counter() - start
        sizes = self.transport.gather_bytes(round_, "checkpoint", np.array([nbytes], dtype=np.int64).view(np.uint8))
        if server is None:
            return
        start = time.perf_counter()
        manifest = [{"rank": rank, "file": shard_name(round_, rank), "bytes": int(size.view(np.int64)[0])}
                    for rank, size in enumerate(sizes) if size.view(np.int64)[0] >= 0]
        shards = np.frombuffer(json.dumps(manifest).encode(), dtype=np.uint8)
        self.latest = {"round": round_, "blobs": {"server": state_blob(server), SHARDS: shards}}
        self.times.serialization += time.perf_counter() - start

    def load(self, path: Path, cfg: RunConfig, server: ServerAlgorithm | None, state: ClientState | None,
                clients: np.ndarray) -> tuple[int, Results]:
        """Load the checkpoint in ``path`` into this rank (the server's state, or the states of ``clients``,
        the ones this rank hosts); returns its round and the saved results (for rank 0's tables). The config
        must be the one the file was written with (its ``rounds`` and ``output`` may change)."""
        import yaml

        saved = read_checkpoint(path)
        if saved.attrs.get("layout") != "append":  # its tables cannot grow in place
            raise ConfigError(f"--resume: {path} was written before the append-only results format; resume it "
                              "with the mpifl version that wrote it")
        # the saved config read as this version reads it (a key added since takes its default), then compared
        mine, given = config_to_dict(parse_config(yaml.safe_load(saved.attrs["config"]))), config_to_dict(cfg)
        for volatile in ("output", "rounds", "data_memory_gb", "state_memory_gb", "state_spill_dir"):
            mine.pop(volatile, None)
            given.pop(volatile, None)
        if mine != given:
            changed = sorted(k for k in set(mine) | set(given) if mine.get(k) != given.get(k))
            raise ConfigError(f"--resume: the config differs from the one in {path} (in: {', '.join(changed)})")
        round_ = int(saved.table_attrs["checkpoint"]["round"])
        if round_ >= cfg.rounds:
            raise ConfigError(f"--resume: {path} is already at round {round_} of {cfg.rounds}")
        blobs = saved.tables["checkpoint"]
        if server is not None:
            load_state_blob(blobs["server"], server)
            self.latest = {"round": round_, "blobs": dict(blobs)}
        if state is not None:
            load_client_states(path, dict(blobs), state, clients)
        return round_, saved
