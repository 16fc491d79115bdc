"""A client's splits as tensors on the device its rank computes on."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from mpifl.data import ClientSplit


@dataclass(frozen=True)
class TensorSplit:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def as_tensors(split: ClientSplit, device: torch.device | str = "cpu") -> TensorSplit:
    fields = TensorSplit.__dataclass_fields__
    return TensorSplit(*(torch.from_numpy(np.ascontiguousarray(getattr(split, f))).to(device) for f in fields))
