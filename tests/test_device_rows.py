"""A client's summed rows may leave it as torch tensors (a GPU worker's deltas stay on its device, where the exact
sum folds them: ``PlanWalker._client_rows``): such rows are screened and folded as tensors, any other (a codec, local
privacy) comes to the host first, and every result is bitwise FedAvg's with numpy rows, on 1 and 3 ranks. On the
CPU a plug-in stands in for the GPU's FedAvgClient, which hands over ``params - start`` as a CUDA tensor; another
takes IFCA's GPU branch (``ClientToolkit.sent_rows``), whose rows go into their clusters' sums."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mpifl.cli import main
from tests.conftest import HANG_S, REPO, assert_same, deterministic, mpi_env, mpirun_cmd

TENSOR_ROWS = """import torch
from mpifl.algorithms.fedavg import FedAvgClient, FedAvgServer


class TensorDeltaClient(FedAvgClient):
    def send_delta(self, step, client):  # still tied to autograd: numpy cannot read it, the walker must take tensors
        return torch.from_numpy(super().send_delta(step, client).copy()).requires_grad_()


ALGORITHM = (None, FedAvgServer, TensorDeltaClient)
"""

BASE = {"algorithm": "fedavg", "rounds": 3, "clients_per_round": 5, "seed": 4, "eval_every": 3,
        "data": {"dataset": "digits", "num_clients": 8}, "model": {"name": "mlp", "hidden": [16]},
        "client": {"lr": 0.05, "steps": 3, "batch_size": 16}}
WIRES = {  # name: (config, rank counts)
    "on the device": ({"faults": {"corrupt": 0.3}}, (1, 3)),  # broken uploads: host NaN rows, screened out
    "through a codec": ({"compression": {"up": {"codec": "topk", "fraction": 0.2}}}, (1,)),
    "with local privacy": ({"privacy": {"mode": "local", "clip": 0.5, "noise_multiplier": 0.3}}, (1,)),
}


def run(config: dict, out: Path, ranks: int, plugins: Path) -> Path:
    """``config`` on 1 rank in this process (the plug-in's folder on sys.path), or as a job on ``ranks``."""
    path = out.with_suffix(".yaml")
    path.write_text(yaml.safe_dump(config))
    args = ["run", str(path), "--out", str(out), "--quiet"]
    if ranks == 1:
        assert main(args) == 0
        return out
    env = {**mpi_env(), "PYTHONPATH": f"{plugins}{os.pathsep}{REPO}"}
    proc = subprocess.run([*mpirun_cmd(ranks), sys.executable, "-m", "mpifl", *args], capture_output=True, text=True,
                          timeout=HANG_S, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.mark.parametrize("wire", WIRES)
def test_tensor_rows_give_fedavgs_bits_on_1_and_3_ranks(tmp_path, wire, monkeypatch):
    (tmp_path / "tensor_rows.py").write_text(TENSOR_ROWS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "tensor_rows", raising=False)  # each test's own copy of the plug-in
    change, rank_counts = WIRES[wire]
    config = {**BASE, **change}
    expected = deterministic(run(config, tmp_path / "numpy.h5", 1, tmp_path))
    for ranks in rank_counts:
        got = run({**config, "algorithm": "tensor_rows:ALGORITHM"}, tmp_path / f"tensor{ranks}.h5", ranks, tmp_path)
        assert_same(deterministic(got), expected)


IFCA_ROWS = """import torch
from mpifl.algorithms.ifca import IFCAClient, IFCAOptions, IFCAServer


class DeviceRowsClient(IFCAClient):
    def sent_rows(self, trained):  # the GPU's branch of ClientToolkit.sent_rows, taken on the CPU
        return trained.params

    def send_delta(self, step, client):
        row = super().send_delta(step, client)
        assert isinstance(row, torch.Tensor), f"IFCA sent a {type(row).__name__}, not a device row"
        return row


ALGORITHM = (IFCAOptions, IFCAServer, DeviceRowsClient)
"""


@pytest.mark.parametrize(("vectorize", "rank_counts"), [(False, (1, 3)), (True, (1,))])
def test_ifcas_deltas_leave_as_device_rows_and_give_its_bits_on_1_and_3_ranks(tmp_path, vectorize, rank_counts,
                                                                             monkeypatch):
    """IFCA's clients hand over each delta as a row of the kernel's tensor where the GPU's branch is taken (as
    FedAvg's do), each folded into its cluster's exact sum, broken uploads screened there: IFCA's bits with numpy
    rows, in the loop and the batch, on 1 and 3 ranks."""
    (tmp_path / "ifca_rows.py").write_text(IFCA_ROWS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "ifca_rows", raising=False)
    config = {**BASE, "algorithm": "ifca", "faults": {"corrupt": 0.3},
              "client": {**BASE["client"], "vectorize": vectorize}}
    expected = deterministic(run(config, tmp_path / "numpy.h5", 1, tmp_path))
    for ranks in rank_counts:
        got = run({**config, "algorithm": "ifca_rows:ALGORITHM"}, tmp_path / f"rows{ranks}.h5", ranks, tmp_path)
        assert_same(deterministic(got), expected)


def test_a_client_that_reuses_its_tensor_for_each_clients_row_sends_each_clients_row(tmp_path, monkeypatch):
    """The walker reads a step's device rows together after every client of the step has sent: a row handed
    over as a tensor the client then reuses for the next client (a plug-in's workspace buffer) is copied where it
    is as it is sent, so each client's row arrives, bitwise the run that hands over fresh rows."""
    import numpy as np
    import torch

    from mpifl.algorithms.fedbuff import FedBuffClient
    from tests.conftest import _merge, run_config
    from tests.test_checkpoint import CONFIGS

    config = tmp_path / "fedbuff.yaml"
    config.write_text(yaml.safe_dump(_merge(CONFIGS["fedbuff"], {"rounds": 3})))
    run_config(config, tmp_path / "fresh.h5")
    sent = FedBuffClient.send_delta

    def reused(client, step, c):  # noqa: ANN001, ANN202
        row = torch.as_tensor(np.asarray(sent(client, step, c)))
        buffer = client.__dict__.setdefault("buffer", torch.empty_like(row))
        return buffer.copy_(row)

    monkeypatch.setattr(FedBuffClient, "send_delta", reused)
    run_config(config, tmp_path / "reused.h5")
    assert_same(deterministic(tmp_path / "fresh.h5"), deterministic(tmp_path / "reused.h5"))
