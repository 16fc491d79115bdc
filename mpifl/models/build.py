"""Building the configured architecture for a dataset's input shape and task, its weights drawn from the seed."""

from __future__ import annotations

import torch
from torch import nn

from mpifl import plugins
from mpifl.data import FederatedLayout
from mpifl.models.config import MODELS, ModelConfig
from mpifl.models.flat import FlatModel
from mpifl.models.memory import check_fits, first_line
from mpifl.models.zoo import MLP, CharLSTM, ConvNet, ResNet20, SimpleCNN
from mpifl.schema import ConfigError, gb, physical_memory

__all__ = ["FlatModel", "build_model", "loss_function"]


def build_model(cfg: ModelConfig, layout: FederatedLayout, seed: int) -> nn.Module:
    """Construct ``cfg.name`` for ``layout`` with weights drawn from ``seed`` alone (never global RNG state).

    A built-in model is first built on the ``meta`` device (shapes only, no memory) so one too large for
    this machine is a ConfigError, not an allocator traceback; a plug-in (which may not support ``meta``)
    is covered by turning a real allocation failure into the same kind of error."""
    with torch.random.fork_rng(devices=[]):
        if cfg.name in MODELS:
            check_fits(lambda: _builtin(cfg, layout), "model", repr(cfg.name))
        torch.manual_seed(seed)  # after the meta build, so the weights are the same as without it
        try:
            return _builtin(cfg, layout) if cfg.name in MODELS else _plugin(cfg, layout)
        except (RuntimeError, MemoryError) as exc:
            if isinstance(exc, RuntimeError) and "allocate" not in str(exc):
                raise
            raise ConfigError(f"model: building {cfg.name!r} ran out of this machine's memory "
                              f"({gb(physical_memory())}): {first_line(exc)}") from None


def _plugin(cfg: ModelConfig, layout: FederatedLayout) -> nn.Module:
    """A plug-in's model: its builder called with the config (``options`` included) and the data's layout."""
    builder = plugins.resolve(plugins.MODELS, cfg.name, MODELS)
    model = builder(cfg, layout)
    where = f"model.name: plug-in {cfg.name!r}"
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{where} returned {type(model).__name__}, not a torch.nn.Module")
    # what travels is the flat float32 parameter vector: state kept elsewhere would differ between ranks
    if any(True for _ in model.buffers()):
        raise ConfigError(f"{where}: the model has buffers; keep all its state in parameters (e.g. "
                          "BatchNorm with track_running_stats=False)")
    if any(p.dtype != torch.float32 for p in model.parameters()):
        raise ConfigError(f"{where}: every parameter must be float32")
    return model


def _builtin(cfg: ModelConfig, layout: FederatedLayout) -> nn.Module:
    regression = layout.task == "regression"
    out = 0 if regression else layout.num_classes
    shape = tuple(layout.input_shape)
    if (cfg.name == "linear" and not regression) or (regression and cfg.name not in ("linear", "mlp")):
        raise ConfigError(
            f"model.name: {cfg.name!r} does not fit a {layout.task} dataset"
            + (" (use 'linear' or 'mlp')" if regression else " ('linear' is for regression; use 'logistic')")
        )
    if cfg.name in ("lenet", "cnn", "convnet", "resnet20", "simple_cnn") and len(shape) != 3:
        raise ConfigError(f"model.name: {cfg.name!r} needs image inputs (C, H, W), got shape {shape}")
    if cfg.name == "resnet20":
        return ResNet20(shape, out, cfg.batch_norm)
    if cfg.name == "simple_cnn":
        try:
            return SimpleCNN(shape, out)
        except ValueError as exc:
            raise ConfigError(f"model: {exc}") from None
    if cfg.name in ("lenet", "cnn", "convnet"):
        channels, hidden, kernel = {
            "lenet": ((16, 32), (120, 84), 5),
            "cnn": (cfg.channels, (cfg.fc_hidden,), 5),
            "convnet": (cfg.channels, cfg.hidden, cfg.kernel_size),
        }[cfg.name]
        try:
            return ConvNet(shape, channels, hidden, out, kernel)
        except ValueError as exc:
            raise ConfigError(f"model: {exc}") from None
    if cfg.name == "char_lstm":
        if layout.input_dtype != "int64":
            raise ConfigError("model.name: 'char_lstm' needs token inputs (shakespeare)")
        return CharLSTM(layout.num_classes + 1, cfg.embed_dim, cfg.lstm_hidden, out)
    if layout.input_dtype != "float32":
        raise ConfigError(f"model.name: {cfg.name!r} needs real-valued inputs; use 'char_lstm' for tokens")
    hidden = cfg.hidden if cfg.name == "mlp" else ()
    return MLP(shape, hidden, out)


def loss_function(layout: FederatedLayout) -> nn.Module:
    """Mean squared error for regression, cross-entropy on logits for classification (both mean-reduced)."""
    return nn.MSELoss() if layout.task == "regression" else nn.CrossEntropyLoss()
