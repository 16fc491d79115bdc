"""Model architectures. Every model maps a batch to logits (classification) or one value (regression)."""

from __future__ import annotations

import math

import torch
from torch import nn


class ConvNet(nn.Module):
    """Conv(k×k, no padding)-ReLU-MaxPool2 blocks, then fully connected ReLU layers, then the output.

    With channels (16, 32), k = 5 and hidden (120, 84) this is PeFLL's LeNet (spec §3.1): on 3×32×32
    it has 32·5·5 = 800 features after the convolutions and 121,182 parameters for 10 classes.
    FedDeper's CNNs (depersonalized spec §2.2) are channels (32, 64), k = 3, hidden (1024, 512) for
    MNIST and channels (64, 128), k = 5, hidden (1024, 512, 256) for CIFAR-10.
    """

    def __init__(self, input_shape: tuple[int, ...], channels: tuple[int, ...], hidden: tuple[int, ...], out: int,
                 kernel: int = 5):
        super().__init__()
        in_ch, height, width = input_shape
        blocks: list[nn.Module] = []
        for ch in channels:
            blocks += [nn.Conv2d(in_ch, ch, kernel), nn.ReLU(), nn.MaxPool2d(2)]
            in_ch, height, width = ch, (height - kernel + 1) // 2, (width - kernel + 1) // 2
            if height < 1 or width < 1:
                raise ValueError(f"input {input_shape} is too small for {len(channels)} conv blocks")
        self.features = nn.Sequential(*blocks, nn.Flatten())
        self.head = mlp_layers(in_ch * height * width, hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


class SimpleCNN(nn.Module):
    """pfl-research's ``simple_cnn``, the model of its CIFAR-10 benchmark: conv3×3(32)-ReLU-conv3×3(64)-ReLU-
    MaxPool2 (no padding), then a fully connected ReLU layer of 128 and the output, weights Glorot-uniform as
    there (biases PyTorch's default). On 3×32×32 and 10 classes: 64·14·14 = 12,544 features after the pooling
    and 1,626,442 parameters. Its two dropout layers (0.25 after the pooling, 0.5 before the output) are left
    out: mpifl's models draw no randomness in the forward pass (dropout would draw from torch's global generator,
    not from the client's (seed, round, client) stream), and they change no timing that matters.
    """

    def __init__(self, input_shape: tuple[int, ...], out: int):
        super().__init__()
        in_ch, height, width = input_shape
        height, width = (height - 4) // 2, (width - 4) // 2
        if height < 1 or width < 1:
            raise ValueError(f"input {input_shape} is too small for simple_cnn (at least 6×6)")
        self.features = nn.Sequential(nn.Conv2d(in_ch, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(),
                                      nn.MaxPool2d(2), nn.Flatten())
        self.head = mlp_layers(64 * height * width, (128,), out)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.xavier_uniform_(m.weight)

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


class ResidualBlock(nn.Module):
    """conv3×3-norm-ReLU-conv3×3-norm, plus the shortcut, then ReLU (FedALS's BasicBlock).

    The downsampling shortcut is a 3×3 stride-2 convolution with its norm, as in the FedALS code
    (spec §2.1), not the usual 1×1 convolution; it is registered last, so in parameter order it
    follows conv2 and joins conv2's layer group.
    """

    def __init__(self, in_ch: int, out_ch: int, stride: int, batch_norm: bool):
        super().__init__()
        self.conv1, self.bn1 = conv3x3(in_ch, out_ch, stride, batch_norm), norm_layer(out_ch, batch_norm)
        self.conv2, self.bn2 = conv3x3(out_ch, out_ch, 1, batch_norm), norm_layer(out_ch, batch_norm)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(conv3x3(in_ch, out_ch, stride, batch_norm), norm_layer(out_ch, batch_norm))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def conv3x3(in_ch: int, out_ch: int, stride: int, batch_norm: bool) -> nn.Conv2d:
    """A bias would duplicate BatchNorm's shift, so convolutions carry one only without BatchNorm."""
    return nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=not batch_norm)


def norm_layer(channels: int, batch_norm: bool) -> nn.Module:
    """BatchNorm that always normalises with the current batch's statistics (no running buffers), so
    the model's whole state is its parameters (FlatModel's contract) and a client's forward pass never
    depends on which clients ran before it on the same rank; γ and β are parameters of their layer group."""
    return nn.BatchNorm2d(channels, track_running_stats=False) if batch_norm else nn.Identity()


class ResNet20(nn.Module):
    """The FedALS authors' ResNet-20 (spec §2.1): stem conv3×3(16)-norm-ReLU, three stages of three
    residual blocks (16, 32, 64 channels; stride 2 at the start of stages 2 and 3), global average
    pooling, Linear(64, classes). With BatchNorm on 3×32×32 and 10 classes it has 292,954 parameters
    (fc 650), the count behind the paper's Table 2. The pooling is adaptive, so 28×28 inputs work too.
    """

    def __init__(self, input_shape: tuple[int, ...], out: int, batch_norm: bool):
        super().__init__()
        in_ch = input_shape[0]
        layers: list[nn.Module] = [conv3x3(in_ch, 16, 1, batch_norm), norm_layer(16, batch_norm), nn.ReLU()]
        in_ch = 16
        for width, stride in ((16, 1), (32, 2), (64, 2)):
            for block in range(3):
                layers.append(ResidualBlock(in_ch, width, stride if block == 0 else 1, batch_norm))
                in_ch = width
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(64, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))
