"""Checkpoints: every rank's state saved at a round boundary, and back on any rank count.

Every file of a checkpoint lies in the shard folder beside the results file (``RESULTS.h5.ckpt/``): the server's
state is its algorithm object's (``roundR-server.h5``, an HDF5 tree, never a pickle); a worker's is the committed
state of the clients it hosts, keyed by client id (``roundR-rankW.h5``), so no rank gathers another's state and a
resume on another rank count hands each client's state to whichever worker hosts it now. The results file holds
only the manifest that commits a checkpoint, so it does not grow with each; the newest ``checkpoint_keep`` are
kept and older files deleted as each new one is committed. No algorithm writes checkpoint code.
"""

from __future__ import annotations

import errno
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from mpifl.algorithms.base import ServerAlgorithm
from mpifl.algorithms.state import ClientState
from mpifl.comm import Transport
from mpifl.config import RESULT_NEUTRAL, RunConfig, config_differences, config_to_dict
from mpifl.registry import parse_config
from mpifl.results import KEPT, SHARDS, Results, shard_dir
from mpifl.results.space import StorageFull, cause, mount_point
from mpifl.runtime.timing import RankTimes
from mpifl.schema import ConfigError
from mpifl.state_io import (
    complete,
    load_client_states,
    load_server_state,
    manifests,
    read_checkpoint,
    write_client_shard,
    write_server_shard,
)

RUNTIME = "runtime"  # marks the manifest entry of the rounds' own state (rank 0's asynchronous events)


SHARD_FAILED = -2
"""The size a rank reports for a checkpoint file the file system could not take, less the error's number
(``SHARD_FAILED - errno``: rank 0 names the cause, a full disk, a quota, a read-only or failing file system; -1: the
rank holds no client state)."""


def shard_name(round_: int, rank: int) -> str:
    return f"round{round_}-rank{rank}.h5"


def server_shard_name(round_: int) -> str:
    return f"round{round_}-server.h5"


def runtime_shard_name(round_: int) -> str:
    return f"round{round_}-runtime.h5"


class Checkpointer:
    def __init__(self, transport: Transport, times: RankTimes, output: Path, keep: int):
        self.transport, self.times, self.output, self.keep = transport, times, output, keep
        self.latest: dict[str, Any] | None = None  # rank 0: {"round": r, "blobs": {SHARDS: ..., KEPT: ...}}
        self.kept: list[dict[str, Any]] = []  # rank 0: the older checkpoints still kept ({"round", "shards"})

    def take(self, round_: int, server: ServerAlgorithm | None, state: ClientState | None,
             runtime: object | None = None) -> None:
        """Every rank with client state writes it to its own shard file beside the results file, client by
        client, and the server its own state to a file there too; the server learns only each shard's size (a
        small collective), then keeps the manifest, which goes into the next results write and commits the
        checkpoint. A collective on every rank."""
        start = time.perf_counter()
        folder = shard_dir(self.output)
        nbytes = -1
        if state is not None or server is not None:
            folder.mkdir(parents=True, exist_ok=True)
        if state is not None:
            try:
                nbytes = write_client_shard(folder / shard_name(round_, self.transport.rank), state)
            except StorageFull as exc:  # said once, by rank 0, for every rank it happened to (the gather below)
                nbytes = SHARD_FAILED - (exc.errno or errno.ENOSPC)
        self.times.serialization += time.perf_counter() - start
        sizes = self.transport.gather_bytes(round_, "checkpoint", np.array([nbytes], dtype=np.int64).view(np.uint8))
        if server is None:
            return
        codes = {rank: SHARD_FAILED - int(size.view(np.int64)[0]) for rank, size in enumerate(sizes)
                 if size.view(np.int64)[0] <= SHARD_FAILED}
        if codes:
            code = next(iter(codes.values()))
            raise StorageFull(code, f"the file system at {mount_point(folder)} could not take round {round_}'s "
                              f"checkpoint files of rank(s) {', '.join(map(str, codes))}: {cause(code, folder)}")
        start = time.perf_counter()
        server_bytes = write_server_shard(folder / server_shard_name(round_), server)
        manifest = [{"rank": 0, "file": server_shard_name(round_), "bytes": server_bytes, "server": True}]
        if runtime is not None:  # the rounds' own state on rank 0 (the asynchronous events), a file of its own
            runtime_bytes = write_server_shard(folder / runtime_shard_name(round_), runtime)
            manifest.append({"rank": 0, "file": runtime_shard_name(round_), "bytes": runtime_bytes, "server": True,
                             RUNTIME: True})
        manifest += [{"rank": rank, "file": shard_name(round_, rank), "bytes": int(size.view(np.int64)[0])}
                     for rank, size in enumerate(sizes) if size.view(np.int64)[0] >= 0]
        if self.latest is not None and self.latest["round"] != round_:
            newest = json.loads(self.latest["blobs"][SHARDS].tobytes())
            self.kept = [{"round": self.latest["round"], "shards": newest}, *self.kept][: self.keep - 1]
        self.latest = {"round": round_, "blobs": {SHARDS: _json_blob(manifest), KEPT: _json_blob(self.kept)}}
        self.times.serialization += time.perf_counter() - start

    def load(self, path: Path, cfg: RunConfig, server: ServerAlgorithm | None, state: ClientState | None,
             clients: np.ndarray, runtime: object | None = None) -> tuple[int, Results]:
        """Load the newest checkpoint in ``path`` whose files are all there (the newest, unless its files were
        lost) into this rank (the server's state and the rounds' own state ``runtime``, or the states of
        ``clients``, the ones this rank hosts); returns its round and the saved results (for rank 0's tables). The
        config must be the one the file was written with (its ``rounds``, ``output``, memory settings and
        ``checkpoint_keep`` may change)."""
        import yaml

        saved = read_checkpoint(path)
        if saved.attrs.get("layout") != "append":  # its tables cannot grow in place
            raise ConfigError(f"--resume: {path} was written before the append-only results format; resume it "
                              "with the mpifl version that wrote it")
        # the saved config read as this version reads it (a key added since takes its default), then compared
        mine, given = config_to_dict(parse_config(yaml.safe_load(saved.attrs["config"]))), config_to_dict(cfg)
        for volatile in (*RESULT_NEUTRAL, "rounds"):
            mine.pop(volatile, None)
            given.pop(volatile, None)
        changed = config_differences(mine, given)
        if changed:
            raise ConfigError(f"--resume: the config differs from the one in {path}: {'; '.join(changed)} (only "
                              "rounds, checkpoint_keep and the memory settings may change on resume)")
        blobs = saved.tables["checkpoint"]
        newest = int(saved.table_attrs["checkpoint"]["round"])
        listed = [(newest if r is None else r, entries) for r, entries in manifests(blobs)]
        round_, entries = next(((r, e) for r, e in listed if complete(path, e)), listed[0])
        if round_ >= cfg.rounds:
            raise ConfigError(f"--resume: {path} is already at round {round_} of {cfg.rounds}")
        if server is not None:
            load_server_state(path, blobs, entries, server)  # the first entry of rank 0's: the server's
            position = [r for r, _ in listed].index(round_)
            self.kept = [{"round": r, "shards": e} for r, e in listed[position + 1:]][: self.keep - 1]
            self.latest = {"round": round_, "blobs": {SHARDS: _json_blob(entries), KEPT: _json_blob(self.kept)}}
        if runtime is not None:
            load_server_state(path, {}, [e for e in entries if e.get(RUNTIME)], runtime)
        if state is not None:
            load_client_states(path, dict(blobs), entries, state, clients)
        return round_, saved


def _json_blob(value: Any) -> np.ndarray:
    return np.frombuffer(json.dumps(value).encode(), dtype=np.uint8)
