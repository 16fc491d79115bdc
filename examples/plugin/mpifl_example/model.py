"""An MLP of `depth` tanh layers, `width` units each (`model.options`)."""

import math
from dataclasses import dataclass, field

from torch import nn

from mpifl import schema


@dataclass(frozen=True)
class TanhOptions:
    width: int = field(default=32, metadata=schema.limits(ge=1))
    depth: int = field(default=2, metadata=schema.limits(ge=1))


def build(cfg, layout):
    opts = schema.build(TanhOptions, cfg.options, "model.options")  # unknown keys, bad values: one-line errors
    layers, inputs = [nn.Flatten()], math.prod(layout.input_shape)
    for _ in range(opts.depth):
        layers += [nn.Linear(inputs, opts.width), nn.Tanh()]
        inputs = opts.width
    layers.append(nn.Linear(inputs, layout.num_classes))
    return nn.Sequential(*layers)
