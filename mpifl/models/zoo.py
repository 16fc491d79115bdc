"""Model architectures. Every model maps a batch to logits (classification) or one value (regression)."""

from __future__ import annotations

import math

import torch
from torch import nn


class ConvNet(nn.Module):
    """Conv(5×5, no padding)-ReLU-MaxPool2 blocks, then fully connected ReLU layers, then the output.

    With channels (16, 32) and hidden (120, 84) this is PeFLL's LeNet (spec §3.1): on 3×32×32 it
    has 32·5·5 = 800 features after the convolutions and 121,182 parameters for 10 classes.
    """

    def __init__(self, input_shape: tuple[int, ...], channels: tuple[int, ...], hidden: tuple[int, ...], out: int):
        super().__init__()
        in_ch, height, width = input_shape
        blocks: list[nn.Module] = []
        for ch in channels:
            blocks += [nn.Conv2d(in_ch, ch, 5), nn.ReLU(), nn.MaxPool2d(2)]
            in_ch, height, width = ch, (height - 4) // 2, (width - 4) // 2
            if height < 1 or width < 1:
                raise ValueError(f"input {input_shape} is too small for {len(channels)} conv blocks")
        self.features = nn.Sequential(*blocks, nn.Flatten())
        self.head = mlp_layers(in_ch * height * width, hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def mlp_layers(inputs: int, hidden: tuple[int, ...], out: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for width in hidden:
        layers += [nn.Linear(inputs, width), nn.ReLU()]
        inputs = width
    layers.append(nn.Linear(inputs, out))
    return nn.Sequential(*layers)


class MLP(nn.Module):
    """Fully connected ReLU network; with no hidden layers it is linear or logistic regression.

    ``out=0`` means a scalar regression output of shape [batch], matching the targets.
    """

    def __init__(self, input_shape: tuple[int, ...], hidden: tuple[int, ...], out: int):
        super().__init__()
        layers = [nn.Flatten(), mlp_layers(math.prod(input_shape), hidden, max(out, 1))]
        if out == 0:
            layers.append(nn.Flatten(0))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CharLSTM(nn.Module):
    """LEAF's Shakespeare model: character embedding, two LSTM layers, next-character logits."""

    def __init__(self, vocab: int, embed_dim: int, hidden: int, out: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden, num_layers=2, batch_first=True)
        self.out = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        states, _ = self.lstm(self.embed(x))
        return self.out(states[:, -1])
