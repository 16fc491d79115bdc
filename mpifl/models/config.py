"""The ``model:`` section of a run config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mpifl.schema import limits


@dataclass(frozen=True)
class ModelConfig:
    name: Literal["lenet", "mlp", "cnn", "convnet", "resnet20", "linear", "logistic", "char_lstm"] = "mlp"
    hidden: tuple[int, ...] = (64,)
    channels: tuple[int, ...] = (16, 32)
    kernel_size: int = field(default=5, metadata=limits(ge=1))  # convnet
    batch_norm: bool = False  # resnet20
    fc_hidden: int = field(default=128, metadata=limits(ge=1))
    embed_dim: int = field(default=8, metadata=limits(ge=1))
    lstm_hidden: int = field(default=128, metadata=limits(ge=1))
