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
    name: str = "mlp"  # one of MODELS, or a plug-in (mpifl.plugins): entry point of group mpifl.models, module:callable
    hidden: tuple[int, ...] = field(default=(64,), metadata=limits(ge=1))  # each layer's width
    channels: tuple[int, ...] = field(default=(16, 32), metadata=limits(ge=1))
    kernel_size: int = field(default=5, metadata=limits(ge=1))  # convnet
    batch_norm: bool = False  # resnet20
    fc_hidden: int = field(default=128, metadata=limits(ge=1))
    embed_dim: int = field(default=8, metadata=limits(ge=1))
    lstm_hidden: int = field(default=128, metadata=limits(ge=1))
    options: dict[str, Any] = field(default_factory=dict)  # a plug-in's own settings, handed to it as they are

    def __post_init__(self) -> None:
        """A plug-in is imported and checked with the config, so a wrong name never reaches training."""
        if self.name in MODELS:
            if self.options:
                raise ConfigError(f"model.options: only plug-in models take options; {self.name!r} is built in")
            return
        builder = plugins.resolve(plugins.MODELS, self.name, MODELS)
        plugins.require_callable(plugins.MODELS, self.name, builder, PLUGIN_CONTRACT)
