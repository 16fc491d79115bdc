"""Checkpoints: every rank's state into the results file at a round boundary, and back on any rank count.

The server's state is its algorithm object's (an HDF5 tree, never a pickle); a worker's is the committed
state of the clients it hosts, keyed by client id, so a resume on another rank count hands each client's
state to whichever worker hosts it now. No algorithm writes checkpoint code.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from mpifl.algorithms.base import ServerAlgorithm
from mpifl.algorithms.state import ClientState
from mpifl.checkpoint import client_state_blob, load_client_states, load_state_blob, read_checkpoint, state_blob
from mpifl.comm import Transport
from mpifl.config import RunConfig, config_to_dict, parse_config
from mpifl.results import Results
from mpifl.runtime.clock import RankClock
from mpifl.schema import ConfigError


class Checkpointer:
    def __init__(self, transport: Transport, clock: RankClock):
        self.transport, self.clock = transport, clock
        self.latest: dict[str, Any] | None = None  # rank 0: {"round": r, "blobs": {"server": ..., "worker_R": ...}}

    def take(self, round_: int, server: ServerAlgorithm | None, state: ClientState | None) -> None:
        """Every rank serializes its state and rank 0 keeps the blobs, which go into every results file
        written from now on. A collective on every rank."""
        start = time.perf_counter()
        mine = client_state_blob(state) if state is not None else np.zeros(0, dtype=np.uint8)
        self.clock.serialization += time.perf_counter() - start
        gathered = self.transport.gather_bytes(round_, "checkpoint", mine)
        if server is None:
            return
        start = time.perf_counter()
        workers = {f"worker_{r}": blob for r, blob in enumerate(gathered) if self.transport.size == 1 or r > 0}
        self.latest = {"round": round_, "blobs": {"server": state_blob(server), **workers}}
        self.clock.serialization += time.perf_counter() - start

    def restore(self, path: Path, cfg: RunConfig, server: ServerAlgorithm | None, state: ClientState | None,
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
        for volatile in ("output", "rounds", "data_memory_gb"):
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
            workers = sorted((k for k in blobs if k.startswith("worker_")), key=lambda k: int(k.split("_")[1]))
            load_client_states([blobs[k] for k in workers], state, clients)
        return round_, saved
