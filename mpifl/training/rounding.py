"""The batch's linear layers rounded as the loop's: each row's products computed as the loop computes them.

One client at a time, a linear layer is ``addmm(b, x, Wᵀ)`` (the bias inside the product) and its weight gradient
``gᵀ·x`` ([out, N] times [N, in]: ``mm_mat2_backward`` follows the layout of the transposed weight). Over a
``vmap``-ped forward pass the same layer becomes ``bmm(x, Wᵀ) + b`` (the bias added after) and autograd's batched
backward computes ``(xᵀ·g)ᵀ``: the same sums in another order and with the operands swapped, which MKL rounds
differently depending on its code path and the sizes (on an AMD AVX-512 CPU under any ``MKL_CBWR``; under
``COMPATIBLE`` from about 120 summed samples, and for a bias beside 256 or more inputs). So the batch and the loop
ended an ulp apart there (issue 60). Here the batch's ``F.linear`` on 2-D samples runs as :class:`_RowsLinear`:
``baddbmm`` forward, and backward products in the loop's order, each row's bits those of the loop's ``mm``
(``python -m pytest tests/test_vectorized.py -k rounds_as_the_loop``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional
from torch.overrides import TorchFunctionMode


def _keep_inputs(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    """What a linear layer's backward reads: its input and weight, and whether it has a bias."""
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


class _RowsLinear(torch.autograd.Function):
    """A block of rows' linear layers, ``x`` [rows, N, in], ``weight`` [rows, out, in], ``bias`` [rows, out] or
    None, with the loop's products (see the module's docstring)."""

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        if bias is None:
            return torch.bmm(x, weight.transpose(1, 2))
        return torch.baddbmm(bias[:, None, :], x, weight.transpose(1, 2))

    setup_context = staticmethod(_keep_inputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        wanted = ctx.needs_input_grad  # the data's own gradient is needed by no one
        return (grad.bmm(weight) if wanted[0] else None, grad.transpose(1, 2).bmm(x) if wanted[1] else None,
                grad.sum(1) if ctx.has_bias and wanted[2] else None)


class _LoopLinear(torch.autograd.Function):
    """``F.linear`` of one row, 2-D samples; under ``vmap`` a block's :class:`_RowsLinear`."""

    @staticmethod
    def forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:  # type: ignore[override]
        return functional.linear(x, weight, bias)

    setup_context = staticmethod(_keep_inputs)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        wanted = ctx.needs_input_grad
        return (grad.mm(weight) if wanted[0] else None, grad.t().mm(x) if wanted[1] else None,
                grad.sum(0) if ctx.has_bias and wanted[2] else None)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, *args: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        rows = [None if t is None else t.movedim(d, 0) if d is not None else t.expand(info.batch_size, *t.shape)
                for t, d in zip(args, in_dims)]
        return _RowsLinear.apply(*rows), 0


class LoopRounding(TorchFunctionMode):
    """While active, ``F.linear`` (every ``nn.Linear``) on 2-D samples runs as :class:`_LoopLinear`: the batch's
    forward pass enters it so that its linear layers round as the loop's."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is functional.linear and args[0].dim() == 2:
            x, weight, *rest = args
            return _LoopLinear.apply(x, weight, rest[0] if rest else kwargs.get("bias"))
        return func(*args, **kwargs)
