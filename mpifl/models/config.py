"""The ``model:`` section of a run config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mpifl import plugins
from mpifl.schema import ConfigError, limits

MODELS = ("lenet", "mlp", "cnn", "convnet", "resnet20", "simple_cnn", "linear", "logistic", "char_lstm")
PLUGIN_CONTRACT = "a callable (model config, data layout) -> torch.nn.Module"


@dataclass(frozen=True)
class ModelConfig:
    """The client model. BatchNorm keeps no running statistics in training; at evaluation a model normalizes with
    statistics estimated on training data (the client's own by default; FedALS averages all clients'), never with
    its test batch. A plug-in's weights are all float32 parameters (no buffers)."""

    # lenet (PeFLL's LeNet, any input size, channels and classes), cnn (conv blocks of channels + one FC of
    # fc_hidden), convnet (channels, kernel_size, hidden), resnet20 (the FedALS authors' variant), simple_cnn
    # (pfl-research's CIFAR-10 benchmark model: two 3x3 convolutions, one 128-unit hidden layer, no dropout), mlp
    # (hidden; classification or regression), logistic, linear (regression), char_lstm (token inputs:
    # shakespeare); or a plug-in: an entry point of group mpifl.models, or module:callable
    name: str = "mlp"
    hidden: tuple[int, ...] = field(default=(64,), metadata=limits(ge=1))  # mlp, convnet: each hidden layer's width
    channels: tuple[int, ...] = field(default=(16, 32), metadata=limits(ge=1))  # cnn, convnet: each conv block's
    kernel_size: int = field(default=5, metadata=limits(ge=1))  # convnet
    batch_norm: bool = False  # resnet20
    fc_hidden: int = field(default=128, metadata=limits(ge=1))  # cnn: the width of its fully connected layer
    embed_dim: int = field(default=8, metadata=limits(ge=1))  # char_lstm: the character embedding's width
    lstm_hidden: int = field(default=128, metadata=limits(ge=1))  # char_lstm: the LSTM's hidden size
    # a model plug-in's own settings, handed to it as they are (built-in models take none)
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """A plug-in is imported and checked with the config, so a wrong name never reaches training."""
        if self.name in MODELS:
            if self.options:
                raise ConfigError(f"model.options: only plug-in models take options; {self.name!r} is built in")
            return
        builder = plugins.resolve(plugins.MODELS, self.name, MODELS)
        plugins.require_callable(plugins.MODELS, self.name, builder, PLUGIN_CONTRACT)
