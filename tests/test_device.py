"""GPU-ready ranks: which device a rank picks (pure, testable without GPUs), the numeric settings, the GPU
memory check, host staging, and CPU runs unchanged. The tests marked ``needs_cuda`` run only where PyTorch sees
a GPU (docs/how-to/gpus.md)."""

import os
from collections import Counter

import numpy as np
import pytest
import torch
from mpi4py import MPI

from mpifl.models import FlatModel
from mpifl.registry import get_algorithm, parse_config
from mpifl.results import read_results
from mpifl.runtime.engine import Engine
from mpifl.schema import ConfigError
from mpifl.training.device import (
    RankDevices,
    check_data_fits,
    host_floats,
    host_numpy,
    make_deterministic,
    node_ranks,
    node_workers,
    pick_device,
    rank_devices,
    server_gpu,
    set_tf32,
    worker_gpu,
)
from tests.conftest import _merge, assert_same, deterministic, needs_cuda, run_engine, run_mpifl
from tests.test_checkpoint import CONFIGS

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible")
# how close a 2-round run on a GPU must be to the same run on the CPU (docs/how-to/gpus.md; scripts/gpu_check.sh
# holds its runs to the same): the final model, and the evaluation metrics named by METRICS
MODEL_TOLERANCE = {"rtol": 1e-3, "atol": 1e-3}
METRIC_TOLERANCE = {"rtol": 1e-2, "atol": 2e-2}
METRICS = ("loss", "acc_mean", "acc_pooled")


def test_cpu_is_cpu_whatever_the_node_has():
    assert pick_device("cpu", 0, 0) == "cpu"
    assert pick_device("cpu", 4, 3) == "cpu"


@pytest.mark.parametrize(("workers", "gpus", "mapping"), [
    (8, 4, [0, 0, 1, 1, 2, 2, 3, 3]), (3, 2, [0, 0, 1]), (2, 4, [0, 2]), (5, 4, [0, 0, 1, 2, 3]), (4, 1, [0] * 4),
    (1, 8, [0]), (7, 3, [0, 0, 0, 1, 1, 2, 2])])
def test_workers_share_the_node_gpus_in_blocks(workers, gpus, mapping):
    """Worked by hand: worker w of W on G GPUs uses GPU ⌊w·G/W⌋."""
    assert [worker_gpu(w, workers, gpus) for w in range(workers)] == mapping


@pytest.mark.parametrize("workers", range(1, 13))
@pytest.mark.parametrize("gpus", range(1, 9))
def test_the_mapping_is_even_and_keeps_neighbours_together(workers, gpus):
    mapping = [worker_gpu(w, workers, gpus) for w in range(workers)]
    load = Counter(mapping)
    assert mapping == sorted(mapping)  # consecutive workers on one GPU (a socket's ranks near its GPUs)
    assert len(load) == min(workers, gpus)  # no GPU idle while two workers share one
    assert max(load.values()) - min(load.values()) <= 1 and max(load.values()) == -(-workers // gpus)


def test_out_of_range_workers_are_a_bug():
    for args in ((3, 3, 2), (-1, 3, 2), (0, 1, 0)):
        with pytest.raises(ValueError):
            worker_gpu(*args)


def test_the_server_takes_the_gpu_fewest_workers_share():
    assert server_gpu(8, 4) == 0  # all equal: the first
    assert server_gpu(3, 4) == 3  # GPU 3 serves no worker
    assert server_gpu(5, 4) == 1  # 0 0 1 2 3: GPUs 1-3 serve one each
    assert server_gpu(2, 4) == 1  # 0 2: GPU 1 is free
    assert server_gpu(0, 2) == 0  # the server alone on its node


def test_auto_uses_a_gpu_when_there_is_one():
    assert pick_device("auto", 2, 1) == "cuda:1"
    assert pick_device("auto", 0, 0) == "cpu"


def test_cuda_without_a_gpu_is_a_one_line_config_error():
    for key in ("device", "server.device"):
        with pytest.raises(ConfigError) as exc:
            pick_device("cuda", 0, 0, where="rank 3 (host n1)", key=key)
        message = str(exc.value)
        assert "\n" not in message
        assert message.startswith(f"{key}: 'cuda'") and "rank 3 (host n1)" in message and "'auto' or 'cpu'" in message


def test_one_process_is_its_own_only_worker():
    assert node_workers(None) == (0, 1)
    assert node_workers(MPI.COMM_SELF) == (0, 1)
    assert node_ranks(MPI.COMM_SELF) == [0]


def test_cpu_settings_touch_no_gpu_and_no_communicator():
    assert rank_devices("cpu", "cpu", comm=None) == RankDevices(torch.device("cpu"), torch.device("cpu"))


@no_cuda
def test_auto_falls_back_to_the_cpu_for_clients_and_server():
    assert rank_devices("auto", "auto", MPI.COMM_SELF) == RankDevices()


@no_cuda
def test_server_device_cuda_without_a_gpu_names_its_key():
    with pytest.raises(ConfigError, match="^server.device: 'cuda', but PyTorch sees no CUDA GPU on rank 0"):
        rank_devices("cpu", "cuda", MPI.COMM_SELF)


def test_server_device_is_for_server_networks_only():
    parse_config({**CONFIGS["pefll"], "server": {"device": "auto"}})
    parse_config({**CONFIGS["pfedhn"], "server": {"device": "cuda"}})  # found missing at set-up, not here
    with pytest.raises(ConfigError, match="^server.device: fedavg's server has no networks"):
        parse_config({**CONFIGS["fedavg"], "server": {"device": "cuda"}})


@pytest.mark.parametrize(("free", "sharing", "fits"), [(10, 2, True), (10, 3, False), (4, 1, True), (3.9, 1, False)])
def test_client_data_must_fit_the_free_memory_of_the_gpu_beside_its_neighbours(free, sharing, fits):
    """``data_memory_gb`` = 4 GiB per worker rank, ``sharing`` ranks on a GPU with ``free`` GiB free."""
    gib = 2**30
    if fits:
        check_data_fits(int(free * gib), 80 * gib, 4 * gib, sharing, "cuda:1 of rank 2 (host n1)")
        return
    with pytest.raises(ConfigError) as exc:
        check_data_fits(int(free * gib), 80 * gib, 4 * gib, sharing, "cuda:1 of rank 2 (host n1)")
    message = str(exc.value)
    assert "\n" not in message and message.startswith("data_memory_gb: ")
    assert f"{4 * sharing:.2f} GB in all" in message and f"{free:.2f} GB free of 80.00 GB" in message
    assert "cuda:1 of rank 2 (host n1)" in message


@pytest.fixture
def torch_flags(monkeypatch):
    """Restore PyTorch's global numeric settings after a test changes them."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision(), torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark,
             torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    yield
    torch.set_float32_matmul_precision(saved[2])
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[:2]
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[3:5]
    torch.use_deterministic_algorithms(saved[5], warn_only=saved[6])


def test_tf32_is_off_unless_allowed(torch_flags):
    torch.backends.cudnn.allow_tf32 = True  # PyTorch's default for convolutions
    set_tf32(False)
    assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest"
    set_tf32(True)
    assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
    assert torch.backends.mkldnn.matmul.fp32_precision != "tf32"  # CPU products keep float32's rounding


def test_every_rank_sets_tf32_even_on_the_cpu(torch_flags):
    torch.backends.cudnn.allow_tf32 = True
    rank_devices("cpu", "cpu")
    assert not torch.backends.cudnn.allow_tf32
    rank_devices("cpu", "cpu", allow_tf32=True)
    assert torch.backends.cudnn.allow_tf32


def test_deterministic_settings(torch_flags):
    make_deterministic()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()


def test_a_workspace_setting_of_the_user_is_kept(torch_flags, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # also deterministic, smaller
    make_deterministic()
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


@pytest.mark.parametrize("algorithm", ["pefll", "pfedhn", "knnper", "scaffold"])
def test_the_deterministic_settings_change_no_cpu_bit(algorithm, tmp_path, torch_flags):
    """A one-rank job whose server networks are on a GPU is in deterministic mode, its clients on the CPU: their
    arithmetic must be what it is without the mode."""
    raw = _merge(CONFIGS[algorithm], {"rounds": 2, "eval_every": 1})
    plain = run_engine(raw, MPI.COMM_SELF, tmp_path / "plain.h5")
    make_deterministic()
    assert_same(deterministic(plain), deterministic(run_engine(raw, MPI.COMM_SELF, tmp_path / "mode.h5")))


def test_host_floats_reads_device_scalars_as_one_float64_array():
    values = [torch.tensor(0.1, dtype=torch.float32), torch.tensor(2, dtype=torch.int64), torch.tensor(0.3).double()]
    out = host_floats(values)
    assert out.dtype == np.float64 and out.tolist() == [float(v) for v in values]
    assert host_floats([]).shape == (0,)


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
        np.testing.assert_allclose(gpu_state[name], value, **MODEL_TOLERANCE, err_msg=name)
    for key in cpu_eval:
        if key.endswith(METRICS):
            np.testing.assert_allclose(gpu_eval[key], cpu_eval[key], **METRIC_TOLERANCE, err_msg=key)


@needs_cuda
@pytest.mark.parametrize("algorithm", sorted(CONFIGS))
def test_every_algorithm_on_a_gpu_is_the_same_run_to_run(algorithm, tmp_path):
    """Deterministic kernels (cuDNN, cuBLAS's workspace, kNN-Per's accumulation): two runs, the same bits;
    PeFLL's and pFedHN's server networks on the GPU too."""
    raw = _merge(CONFIGS[algorithm], {"rounds": 2, "eval_every": 1, "device": "cuda"})
    if get_algorithm(algorithm).server.networks:
        raw = _merge(raw, {"server": {"device": "cuda"}})
    first, second = (run_engine(raw, MPI.COMM_SELF, tmp_path / f"{tag}.h5") for tag in ("first", "second"))
    assert_same(deterministic(first), deterministic(second))


@needs_cuda
@pytest.mark.parametrize("algorithm", ["pefll", "pfedhn"])
def test_server_networks_on_a_gpu_match_the_cpu_and_resume(algorithm, tmp_path):
    """server.device: cuda with clients on the CPU; a checkpoint of the GPU state resumes bitwise."""
    cpu_state, cpu_eval = _final(algorithm, "cpu", tmp_path)
    raw = _merge(CONFIGS[algorithm], {"rounds": 2, "eval_every": 1, "checkpoint_every": 1,
                                      "server": {"device": "cuda"}})
    straight = run_engine(raw, MPI.COMM_SELF, tmp_path / "straight.h5")
    gpu = read_results(straight)
    for name, value in cpu_state.items():
        np.testing.assert_allclose(gpu.table("model")[name], value, **MODEL_TOLERANCE, err_msg=name)
    run_engine(_merge(raw, {"rounds": 1}), MPI.COMM_SELF, tmp_path / "part.h5")
    resumed = run_engine(raw, MPI.COMM_SELF, tmp_path / "part.h5", resume=True)
    assert_same(deterministic(straight), deterministic(resumed))


@needs_cuda
def test_float32_products_on_a_gpu_are_not_tf32(tmp_path):
    """After a rank's set-up, a matrix product and a convolution on the GPU are within float32's rounding of
    a float64 reference, relative to its largest entry (TF32's 10-bit mantissa would be off by about 3e-4)."""
    rank_devices("cuda", "cpu", MPI.COMM_SELF)
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 512, generator=gen), torch.randn(512, 256, generator=gen)
    x, w = torch.randn(8, 16, 32, 32, generator=gen), torch.randn(32, 16, 5, 5, generator=gen)
    for gpu, exact in ((a.cuda() @ b.cuda(), a.double() @ b.double()),
                       (torch.nn.functional.conv2d(x.cuda(), w.cuda()), torch.nn.functional.conv2d(x.double(),
                                                                                                  w.double()))):
        error = (gpu.cpu().double() - exact).abs().max() / exact.abs().max()
        assert error < 5e-5, float(error)  # TF32: about 3e-4 here; float32, FFT or Winograd kernels: 1e-6 or less


@needs_cuda
def test_client_data_beyond_the_gpu_is_refused_at_set_up(tmp_path):
    free, _ = torch.cuda.mem_get_info()
    cfg = parse_config({**CONFIGS["fedavg"], "device": "cuda", "data_memory_gb": 2 * free / 2**30})
    with pytest.raises(ConfigError, match="^data_memory_gb: 1 worker rank keeps up to"):
        Engine(cfg, MPI.COMM_SELF, tmp_path / "r.h5").prepare()
