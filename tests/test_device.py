"""GPU-ready ranks: which device a rank picks (pure, testable without GPUs), host staging, and CPU runs
unchanged. The tests marked ``needs_cuda`` run only where PyTorch sees a GPU."""

from collections import Counter

import numpy as np
import pytest
import torch
from mpi4py import MPI

from mpifl.models import FlatModel
from mpifl.registry import parse_config
from mpifl.results import read_results
from mpifl.runtime.engine import Engine
from mpifl.schema import ConfigError
from mpifl.training.device import LOCAL_RANK_VARIABLES, host_numpy, local_rank, pick_device
from tests.conftest import _merge, run_engine, run_mpifl
from tests.test_checkpoint import CONFIGS

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible")


def test_cpu_is_cpu_whatever_the_node_has():
    assert pick_device("cpu", 0, 0) == "cpu"
    assert pick_device("cpu", 5, 4) == "cpu"


def test_local_ranks_share_the_node_gpus_round_robin():
    """4 GPUs, 8 ranks on the node: local rank r uses GPU r mod 4, so every GPU serves 2 ranks; the
    server (local rank 0) shares GPU 0."""
    devices = [pick_device("cuda", r, 4) for r in range(8)]
    assert devices == [f"cuda:{r % 4}" for r in range(8)]
    assert Counter(devices) == {f"cuda:{g}": 2 for g in range(4)}
    assert pick_device("cuda", 0, 4) == "cuda:0"
    assert pick_device("cuda", 3, 1) == "cuda:0"


def test_auto_uses_a_gpu_when_there_is_one():
    assert pick_device("auto", 5, 2) == "cuda:1"
    assert pick_device("auto", 5, 0) == "cpu"


def test_cuda_without_a_gpu_is_a_one_line_config_error():
    with pytest.raises(ConfigError) as exc:
        pick_device("cuda", 0, 0, where="rank 3 (host n1)")
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith("device: 'cuda'") and "rank 3 (host n1)" in message and "'auto' or 'cpu'" in message


def test_local_rank_from_mpi_then_launcher_variables(monkeypatch):
    assert local_rank(MPI.COMM_SELF) == 0
    for name in LOCAL_RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert local_rank() == 0
    for value, name in enumerate(reversed(LOCAL_RANK_VARIABLES), start=1):
        monkeypatch.setenv(name, str(value))
        assert local_rank() == value  # the first variable in LOCAL_RANK_VARIABLES that is set wins


def test_cpu_host_views_are_the_tensors_own_memory():
    """On the CPU nothing is staged: the numpy views of a FlatModel and of a tensor share their memory."""
    model = FlatModel(torch.nn.Linear(3, 2))
    assert model.device == torch.device("cpu") and model._host is None
    assert np.shares_memory(model.numpy(), model.params.numpy())
    t = torch.arange(4.0)
    assert np.shares_memory(host_numpy(t), t.numpy())


@no_cuda
def test_engine_refuses_cuda_without_a_gpu(tmp_path):
    engine = Engine(parse_config({**CONFIGS["fedavg"], "device": "cuda"}), MPI.COMM_SELF, tmp_path / "r.h5")
    with pytest.raises(ConfigError, match="sees no CUDA GPU on rank 0"):
        engine.prepare()


@no_cuda
def test_job_with_cuda_but_no_gpu_fails_with_one_line(write_config, tmp_path):
    proc = run_mpifl(["run", str(write_config()), "--out", str(tmp_path / "r.h5"), "--set", "device=cuda"], ranks=2)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mpifl")]
    assert len(lines) == 1 and lines[0].startswith("mpifl: error: device: 'cuda', but PyTorch sees no CUDA GPU")
    assert not (tmp_path / "r.h5").exists()


def _final(algorithm: str, device: str, tmp_path, **overrides) -> tuple[dict, dict]:
    raw = _merge(CONFIGS[algorithm], {"rounds": 2, "eval_every": 1, "device": device, **overrides})
    res = read_results(run_engine(raw, MPI.COMM_SELF, tmp_path / f"{algorithm}_{device}.h5"))
    return res.table("model"), res.table("eval")


@no_cuda
def test_auto_without_a_gpu_is_the_cpu_run_bitwise(tmp_path):
    (cpu_state, cpu_eval), (auto_state, auto_eval) = (_final("fedavg", d, tmp_path) for d in ("cpu", "auto"))
    assert np.array_equal(auto_state["global_model"], cpu_state["global_model"])
    for key, values in cpu_eval.items():
        assert np.array_equal(auto_eval[key], values, equal_nan=True), key


@needs_cuda
def test_flat_model_on_a_gpu_stages_through_pinned_memory():
    model = FlatModel(torch.nn.Linear(3, 2).to("cuda"))
    row = np.arange(model.numel, dtype=np.float32)
    row.setflags(write=False)  # like a received buffer
    model.load(row)
    assert model.params.is_cuda and np.array_equal(model.numpy(), row)
    assert model._host.is_pinned() and np.shares_memory(model.numpy(), model._host.numpy())
    assert np.array_equal(host_numpy(model.params * 2), 2 * row)


@needs_cuda
@pytest.mark.parametrize("algorithm", sorted(CONFIGS))
def test_every_algorithm_on_a_gpu_matches_the_cpu(algorithm, tmp_path):
    """Same run on cuda and on the CPU (up to float rounding); checkpoints of GPU state work."""
    cpu_state, cpu_eval = _final(algorithm, "cpu", tmp_path)
    gpu_state, gpu_eval = _final(algorithm, "cuda", tmp_path, checkpoint_every=1)
    for name, value in cpu_state.items():
        np.testing.assert_allclose(gpu_state[name], value, rtol=1e-3, atol=1e-3, err_msg=name)
    for key in cpu_eval:
        if key.endswith(("loss", "acc_mean", "acc_pooled")):
            np.testing.assert_allclose(gpu_eval[key], cpu_eval[key], rtol=1e-2, atol=2e-2, err_msg=key)
