import re

import numpy as np
import pytest
import torch

from mpifl.data import FederatedLayout
from mpifl.models import FlatModel, build_model, loss_function
from mpifl.models.config import ModelConfig
from mpifl.schema import ConfigError
from mpifl.training.config import ClientConfig
from mpifl.training.sgd import sgd_update
from tests.conftest import HANG_S, run_mpifl


def layout(shape, classes=10, task="classification", dtype="float32"):
    n = 2
    return FederatedLayout(n, np.ones(n, dtype=np.int64), np.zeros(n, dtype=bool), shape, classes, task, dtype,
                           np.zeros((n, classes), dtype=np.int64))


@pytest.mark.parametrize(
    ("shape", "classes", "expected"),
    [((3, 32, 32), 10, 121_182), ((3, 32, 32), 100, 128_832), ((1, 32, 32), 62, 124_802)],
)
def test_lenet_parameter_counts_match_pefll_spec(shape, classes, expected):
    model = build_model(ModelConfig(name="lenet"), layout(shape, classes), seed=0)
    assert sum(p.numel() for p in model.parameters()) == expected


def test_b1_cnn_shape():
    model = build_model(ModelConfig(name="cnn", channels=(16, 32), fc_hidden=128), layout((1, 28, 28)), seed=0)
    assert model.head[0].in_features == 512
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_simple_cnn_matches_pfl_research_shapes():
    """pfl-research's simple_cnn on CIFAR-10: 896 + 18,496 (convs) + 1,605,760 (12,544 → 128) + 1,290 parameters;
    Glorot-uniform weights, bound sqrt(6 / (fan_in + fan_out))."""
    model = build_model(ModelConfig(name="simple_cnn"), layout((3, 32, 32)), seed=0)
    assert [p.numel() for p in model.parameters()] == [864, 32, 18_432, 64, 1_605_632, 128, 1_280, 10]
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)
    fc = model.head[0].weight
    bound = (6 / (12_544 + 128)) ** 0.5
    assert fc.abs().max() <= bound and fc.abs().max() > 0.99 * bound
    with pytest.raises(ConfigError, match="too small for simple_cnn"):
        build_model(ModelConfig(name="simple_cnn"), layout((3, 5, 5)), seed=0)


def test_init_depends_only_on_seed():
    cfg = ModelConfig(name="mlp", hidden=(8,))
    a = FlatModel(build_model(cfg, layout((4,)), seed=3)).numpy()
    torch.manual_seed(123)  # global RNG state must not matter
    b = FlatModel(build_model(cfg, layout((4,)), seed=3)).numpy()
    c = FlatModel(build_model(cfg, layout((4,)), seed=4)).numpy()
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_flat_gradient_equals_autograd():
    lay = layout((1, 12, 12))
    cfg = ModelConfig(name="cnn", channels=(3,), fc_hidden=5)
    flat = FlatModel(build_model(cfg, lay, seed=1))
    ref = build_model(cfg, lay, seed=1)
    x, y = torch.randn(6, 1, 12, 12), torch.randint(0, 10, (6,))
    loss_fn = loss_function(lay)
    for _ in range(2):  # the second pass checks the buffer is overwritten, not accumulated
        flat.compute_gradient(loss_fn(flat.module(x), y))
    ref.zero_grad()
    loss_fn(ref(x), y).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
    assert torch.equal(flat.grads, expected)


class _Unreached(torch.nn.Module):
    """simple_cnn beside a parameter the loss never reaches."""

    def __init__(self):
        super().__init__()
        self.net = build_model(ModelConfig(name="simple_cnn"), layout((3, 32, 32)), seed=2)
        self.unused = torch.nn.Parameter(torch.tensor([1.5, -0.25]))

    def forward(self, x):
        return self.net(x)


def test_the_update_on_fresh_gradients_is_the_flat_update_bit_for_bit():
    """The plain SGD update parameter by parameter on autograd's own gradients (FlatModel.fresh_gradients, the
    executor's loop) lands on the bits of the update on compute_gradient's vector, step after step; an unreached
    parameter keeps its value, and the flat gradient buffer works again afterwards."""
    flat, ref = FlatModel(_Unreached()), FlatModel(_Unreached())
    loss_fn = torch.nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        x, y = torch.randn(10, 3, 32, 32, generator=gen), torch.randint(0, 10, (10,), generator=gen)
        for param, grad in flat.fresh_gradients(loss_fn(flat.module(x), y)):
            sgd_update(param[None], grad[None], None, 0.1, ClientConfig())
        ref.compute_gradient(loss_fn(ref.module(x), y))
        sgd_update(ref.params[None], ref.grads[None], None, 0.1, ClientConfig())
        assert torch.equal(flat.params.view(torch.int32), ref.params.view(torch.int32))
    assert flat.module.unused.tolist() == [1.5, -0.25]
    flat.compute_gradient(loss_fn(flat.module(x), y))
    ref.compute_gradient(loss_fn(ref.module(x), y))
    assert torch.equal(flat.grads, ref.grads)


@pytest.mark.parametrize("name", ["linear", "mlp"])
def test_regression_model_outputs_one_value_per_sample(name):
    model = build_model(ModelConfig(name=name), layout((5,), 0, "regression"), seed=0)
    assert model(torch.zeros(3, 5)).shape == (3,)


def test_model_task_mismatch_is_a_config_error():
    with pytest.raises(ConfigError, match="linear"):
        build_model(ModelConfig(name="logistic"), layout((5,), 0, "regression"), seed=0)
    with pytest.raises(ConfigError, match="regression"):
        build_model(ModelConfig(name="linear"), layout((5,)), seed=0)
    with pytest.raises(ConfigError, match="image"):
        build_model(ModelConfig(name="lenet"), layout((64,)), seed=0)


def test_a_model_too_large_for_the_machine_is_one_error_line_before_any_allocation(write_config):
    # digits (64 inputs, 10 classes): 64·2²⁰ + 2²⁰ + 2⁴⁰ + 2²⁰ + 10·2²⁰ + 10 weights, 4.4 TB, counted on
    # torch's meta device; allocating them would be a torch traceback
    config = write_config({"model": {"name": "mlp", "hidden": [2**20, 2**20]}})
    proc = run_mpifl(["validate", str(config)], timeout=HANG_S)
    assert proc.returncode == 2, proc.stderr
    assert re.fullmatch(r"mpifl: error: model: 1,099,591,319,562 parameters \(4,398\.4 GB as float32, twice that "
                        r"with their gradients\) do not fit in this machine's memory \([\d,]+\.\d GB\)\n", proc.stderr)


def test_layer_sizes_past_64_bits_are_a_config_error():
    with pytest.raises(ConfigError, match="^model: a layer of 'mlp' has more weights than torch's 64-bit sizes"):
        build_model(ModelConfig(name="mlp", hidden=(2**40, 2**40)), layout((4,)), seed=0)


def unallocatable(cfg: ModelConfig, data: FederatedLayout) -> torch.nn.Module:
    """A plug-in model of 2**50 weights (4.5 PB): its allocation really fails, with torch's RuntimeError."""
    return torch.nn.Linear(2**25, 2**25)


def test_a_plugin_model_that_cannot_be_allocated_is_a_config_error():
    cfg = ModelConfig(name="tests.test_models:unallocatable")
    with pytest.raises(ConfigError, match=r"^model: building 'tests.test_models:unallocatable' ran out of this "
                                          r"machine's memory \([\d,.]+ GB\): .*can't allocate memory"):
        build_model(cfg, layout((4,)), seed=0)


def test_a_server_network_too_large_for_the_machine_is_one_error_line(write_config):
    # PeFLL's hypernetwork with hidden layers of 10⁷ units: 3·10¹⁴ weights, however small the client model
    config = write_config({"algorithm": "pefll", "rounds": 1, "model": {"name": "logistic"},
                           "pefll": {"hyper_hidden": 10**7, "embedding": "linear"}})
    proc = run_mpifl(["run", str(config), "--quiet", "--out", str(config.with_suffix(".h5"))], timeout=HANG_S)
    assert proc.returncode == 2, proc.stderr
    assert re.fullmatch(r"mpifl: error: model: the hypernetwork or embedding this model needs: [\d,]+ parameters "
                        r"\([\d,.]+ GB as float32, twice that with their gradients\) do not fit in this machine's "
                        r"memory \([\d,.]+ GB\)\n", proc.stderr), proc.stderr
    assert not config.with_suffix(".h5").exists()
