"""A module whose parameters and gradients are views into two contiguous flat tensors.

Messages are flat buffers, so loading a received model is one copy and reading a model to send
is free; optimizer steps are a handful of vector operations instead of one per tensor.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn


class FlatModel:
    checkpoint_derived = ("params", "grads")  # views of the module's parameters: restored with the module

    def __init__(self, module: nn.Module):
        self.module = module
        params = [p for p in module.parameters() if p.requires_grad]
        self.shapes = [tuple(p.shape) for p in params]
        self.names = [n for n, p in module.named_parameters() if p.requires_grad]
        self.params = torch.cat([p.detach().reshape(-1) for p in params]).contiguous()
        self.grads = torch.zeros_like(self.params)
        offset = 0
        for p in params:
            n = p.numel()
            p.data = self.params[offset : offset + n].view_as(p)
            p.grad = self.grads[offset : offset + n].view_as(p)
            offset += n

    @property
    def numel(self) -> int:
        return self.params.numel()

    def load(self, flat: np.ndarray | torch.Tensor) -> None:
        if isinstance(flat, np.ndarray):
            self.params.numpy()[:] = flat  # also accepts read-only views of received buffers
        else:
            self.params.copy_(flat)

    def numpy(self) -> np.ndarray:
        """The parameters as a numpy view (no copy): callers copy before the next step if they keep it."""
        return self.params.numpy()

    def compute_gradient(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` into the flat gradient buffer (overwriting the previous gradient)."""
        self.grads.zero_()
        loss.backward()

    def segment_sizes(self) -> list[int]:
        return [int(np.prod(s)) for s in self.shapes]
