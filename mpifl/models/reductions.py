"""Reductions of flat parameter vectors whose value decides what an algorithm does (a clip factor, a recorded
update norm): accumulated in float64, so they do not drift with the vector's length.

A float32 ``torch.linalg.vector_norm`` of a 12 M-entry vector came out 0.1% low on the CPU (issue 37), and a
few large entries among many small ones make it worse. Here every square is exact (a float32 squared fits a
float64) and the sum is rounded at float64 precision, chunk by chunk, so no float64 copy of the whole vector
is made; tests/test_norms.py holds it to float64's value within 1e-7 relative.
"""

from __future__ import annotations

import torch

CPU_CHUNK = 1 << 16
"""Entries per float64 chunk on the CPU: its 512 KB copy stays in cache (larger chunks measured slower)."""
DEVICE_CHUNK = 1 << 22
"""Entries per float64 chunk on a GPU: each chunk costs kernel launches, so few and large (a 32 MB copy)."""


def l2_norm(x: torch.Tensor) -> torch.Tensor:
    """‖x‖₂ as a 0-d float64 tensor on ``x``'s device (no host read, so a clip can stay on the device); inf or
    NaN when ``x`` holds one."""
    chunk = CPU_CHUNK if x.device.type == "cpu" else DEVICE_CHUNK
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for part in x.detach().reshape(-1).split(chunk):
        wide = part.to(torch.float64, copy=True)  # a copy of its own even from float64: squared in place below
        total += wide.square_().sum()  # torch's own sum (threads_per_rank fixes its order), not BLAS's dot
    return total.sqrt()
