"""PeFLL / pFedHN networks (pefll spec §3): the hypernetwork h and the client embedding networks φ.

h maps a descriptor v ∈ R^l to a whole client model, flat and in :class:`~mpifl.models.FlatModel`
order, so the server can send its rows as they are. φ maps one labelled sample (x, y) to R^l; a
client's descriptor is the mean of φ over a set of its samples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mpifl.models.memory import check_fits
from mpifl.models.zoo import ConvNet


def default_embed_dim(num_clients: int) -> int:
    """l = int(1 + n/4) with n all clients, seen and unseen (the authors' code; the paper says n/4)."""
    return int(1 + num_clients / 4)


M = TypeVar("M", bound=nn.Module)


def seeded(factory: Callable[[], M], seed: int, stream: int) -> M:
    """``factory()`` with its initial weights drawn from (seed, stream) alone, never the global RNG state;
    a config error if it cannot fit in memory (a hypernetwork is about ``hidden`` times its client model)."""
    state = np.random.SeedSequence([seed, stream]).generate_state(1, dtype=np.uint64)[0]
    with torch.random.fork_rng(devices=[]):
        check_fits(factory, "model", "the hypernetwork or embedding this model needs")
        torch.manual_seed(int(state >> np.uint64(1)))
        return factory()


class HyperNetwork(nn.Module):
    """FC l→hidden, ``n_hidden`` × [ReLU, FC hidden→hidden], then one linear head per client-model
    tensor (the authors' ``CNNHyper``: no ReLU before the heads). The heads' outputs are concatenated,
    so a batch of descriptors [B, l] gives a batch of flat client models [B, Σ sizes]."""

    def __init__(self, embed_dim: int, target_sizes: Sequence[int], hidden: int = 100, n_hidden: int = 3):
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(embed_dim, hidden)]
        for _ in range(n_hidden):
            layers += [nn.ReLU(), nn.Linear(hidden, hidden)]
        self.trunk = nn.Sequential(*layers)
        self.heads = nn.ModuleList(nn.Linear(hidden, size) for size in target_sizes)

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        z = self.trunk(v)
        return torch.cat([head(z) for head in self.heads], dim=1)


class ConvEmbedding(nn.Module):
    """The LeNet-type embedding net: the image, plus (``labels``) C constant planes one-hot encoding
    its label, through conv blocks and FC layers to R^l with no final nonlinearity (``CNNEmbed``).
    Without labels it only sees images, so clients with unlabelled data can describe themselves."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int, out: int, labels: bool,
                 channels: tuple[int, ...], hidden: tuple[int, ...], kernel: int):
        super().__init__()
        in_ch, height, width = input_shape
        self.num_classes = num_classes if labels else 0
        self.net = ConvNet((in_ch + self.num_classes, height, width), channels, hidden, out, kernel)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.num_classes:
            planes = F.one_hot(y, self.num_classes).to(x.dtype)[:, :, None, None]
            x = torch.cat([x, planes.expand(-1, -1, *x.shape[2:])], dim=1)
        return self.net(x)


class LabelEmbedding(nn.Module):
    """A single linear map of the one-hot label (``MLPEmbed``): it ignores x, so the descriptor is a
    linear function of the label histogram (the reported choice for CIFAR-100)."""

    def __init__(self, num_classes: int, out: int):
        super().__init__()
        self.num_classes = num_classes
        self.linear = nn.Linear(num_classes, out)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.linear(F.one_hot(y, self.num_classes).to(torch.float32))
