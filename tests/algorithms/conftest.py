"""Helpers for the algorithm tests: a small sorted-shards digits run, in process or under mpirun."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
import yaml

from mpifl.algorithms.base import ClientAlgorithm, RunContext, ServerAlgorithm, Stage, StepContext
from mpifl.algorithms.state import ClientState
from mpifl.comm.exactsum import exact_sum
from mpifl.comm.messages import LocalCompute
from mpifl.data import FederatedDataset, build_federated_dataset
from mpifl.registry import get_algorithm, parse_config
from mpifl.results import Results, read_results
from mpifl.runtime.store import ClientStore
from mpifl.training.device import host_numpy
from tests.conftest import _merge, assert_same, rank_dependent, run_config

SHARDS = {
    "rounds": 4,
    "clients_per_round": 6,
    "seed": 3,
    "eval_every": 2,
    "data": {"dataset": "digits", "num_clients": 6, "partition": "shards", "shards_per_client": 2},
    "model": {"name": "mlp", "hidden": [16]},
    "client": {"lr": 0.05, "batch_size": 16, "steps": 4, "momentum": 0.9, "weight_decay": 1e-4},
}

# Karula's ridge-regression run (tests/algorithms/test_karula.py): here rather than there, so that the table of
# every algorithm's config (tests/test_checkpoint.py) imports without POT, which only a Karula run needs.
N0, FEATURES, CLIENTS = 12, 5, 6
RIDGE = {
    "algorithm": "karula",
    "rounds": 4,
    "clients_per_round": 3,
    "seed": 2,
    "eval_every": 2,
    "data": {"dataset": "karula_ridge", "partition": "natural", "num_clients": CLIENTS,
             "synthetic": {"num_features": FEATURES, "ridge_min_samples": 8, "ridge_max_samples": 20}},
    "model": {"name": "linear"},
    "client": {"lr": 0.01, "weight_decay": 1e-6, "batch_size": 4},
}
KARULA = {"karula": {"t": 0.5, "lr": 0.05, "reference_size": N0}}


@pytest.fixture
def run_algo(tmp_path: Path):
    """``run_algo(name, overrides, ranks=0)``: run ``name`` on SHARDS (+ overrides) and read the results."""

    def run(algorithm: str, overrides: dict | None = None, ranks: int = 0, tag: str = "") -> Results:
        cfg = _merge(SHARDS, {"algorithm": algorithm, **(overrides or {})})
        stem = f"{algorithm}{tag}_p{ranks}"
        config = tmp_path / f"{stem}.yaml"
        config.write_text(yaml.safe_dump(cfg))
        out = tmp_path / f"{stem}.h5"
        run_config(config, out, ranks)
        return read_results(out)

    return run


def hosting_all(dataset: FederatedDataset, device: str = "cpu") -> ClientStore:
    """One process's client side hosting every client of ``dataset``, their data on ``device``."""
    return ClientStore(dataset, np.arange(dataset.layout.num_clients), torch.device(device))


def deterministic_tables(path: Path) -> dict[str, np.ndarray]:
    """Everything in a results file that must not depend on the rank count (no timings, no owners)."""
    out = {}
    with h5py.File(path) as f:
        out["model"] = f["model/global_model"][()]
        for table in ("eval", "clients", "ledger"):
            for key in f[table]:
                if not rank_dependent(key):
                    out[f"{table}/{key}"] = f[table][key][()]
        for key in f["rounds"]:
            if key.startswith("consensus") or key in ("train_loss", "logical_up_bytes", "logical_down_bytes"):
                out[f"rounds/{key}"] = f["rounds"][key][()]
    return out


def assert_rank_invariant(run_algo, tmp_path: Path, algorithm: str, overrides: dict) -> None:
    """A P = 3 job (server + 2 workers, each owning some clients and their state) reproduces P = 1 bitwise."""
    run_algo(algorithm, overrides, ranks=0)
    run_algo(algorithm, overrides, ranks=3)
    assert_same(deterministic_tables(tmp_path / f"{algorithm}_p0.h5"),
                deterministic_tables(tmp_path / f"{algorithm}_p3.h5"))


def both_sides(config: dict, device: str = "cpu", state: ClientState | None = None
               ) -> tuple[RunContext, ServerAlgorithm, ClientAlgorithm]:
    """An algorithm's server and a client side hosting every client, in one process, without the engine: the
    clients on ``device``, their state in ``state`` (a fresh unbounded one by default)."""
    cfg = parse_config(config)
    dataset = build_federated_dataset(cfg.data, cfg.seed)
    ctx = RunContext(cfg, dataset.layout, torch.device(device))
    entry = get_algorithm(cfg.algorithm)
    return ctx, entry.server(ctx), entry.client(ctx, hosting_all(dataset, device), state)


def walk(server: ServerAlgorithm, client: ClientAlgorithm, plan, round_: int, clients: np.ndarray,  # noqa: ANN001
         audience: np.ndarray | None = None, stage: Stage = "train") -> dict[str, np.ndarray]:
    """The engine's walk of a plan without MPI or faults (``everyone`` steps among ``audience``), then the
    round's end: every state edit committed. Returns every message's rows by name."""
    audience = clients if audience is None else audience
    context = StepContext(round_, stage, clients)
    seen = {}
    for step in plan:
        targets = audience if step.everyone else clients
        here = context.with_clients(targets)
        if isinstance(step, LocalCompute):
            for c in targets:
                client.compute(here, int(c))
            continue
        if step.direction == "down":
            payload = server.payload(step, here)
            rows = np.broadcast_to(payload, (len(targets), step.numel)) if step.broadcast else payload
            for c, row in zip(targets, rows):
                client.receive(step, here, int(c), row)
        else:
            rows = np.stack([_on_host(client.send(step, here, int(c))) for c in targets])
            if step.summed is not None:  # each client's row into its group's sum, as the runtime adds them
                group = np.array([client.sum_group(step, int(c)) for c in targets])
                weights = server.ctx.sum_weights(step.summed, targets)
                server.consume_sum(step, here, np.stack([
                    exact_sum(rows[group == g], weights[group == g]) if (group == g).any() else np.zeros(step.numel)
                    for g in range(step.groups)]))
            else:
                server.consume(step, here, rows)
        seen[step.name] = np.array(rows)
    client.state.commit(np.union1d(clients, audience))
    return seen


def _on_host(row: np.ndarray | torch.Tensor) -> np.ndarray:
    """A sent row as a host array (a tensor row, kept on the device by its client, copied out)."""
    return host_numpy(row) if isinstance(row, torch.Tensor) else np.array(row)
