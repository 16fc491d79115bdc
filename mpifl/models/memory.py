"""Refusing a network too large for this machine before allocating it: one config-error line where torch
would print an allocator traceback (or ask the kernel for terabytes)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mpifl.schema import ConfigError, gb, physical_memory


def first_line(exc: BaseException) -> str:
    """torch's own words, on the one line an error gets (the rest of its message is a C++ stack)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def check_fits(factory: Callable[[], nn.Module], key: str, what: str) -> None:
    """Refuse the network ``factory`` builds if its float32 weights and gradients (the least training
    needs) exceed physical memory. It is built on the ``meta`` device: shapes only, nothing allocated,
    no RNG drawn. ``key`` names the config key to blame, ``what`` the network."""
    try:
        with torch.device("meta"):
            params = sum(p.numel() for p in factory().parameters())
    except (RuntimeError, TypeError) as exc:  # a size, or a product of sizes, past 2**63
        if "overflow" not in str(exc).lower():
            raise
        raise ConfigError(f"{key}: a layer of {what} has more weights than torch's 64-bit sizes can count") from None
    weights, memory = 4 * params, physical_memory()
    if 2 * weights > memory:
        subject = "" if what.startswith("'") else f"{what}: "  # a model is named by the key already
        raise ConfigError(f"{key}: {subject}{params:,} parameters ({gb(weights)} as float32, twice that with their "
                          f"gradients) do not fit in this machine's memory ({gb(memory)})")
