"""The floor's precision settings (benchmarks/bare_w2.py) and how the speed command notes them, without running a
round."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bare_w2  # noqa: E402
import gpu_side_by_side  # noqa: E402


@pytest.fixture
def torch_precision():
    saved = (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
             torch.backends.cudnn.allow_tf32)
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[1:]


def test_the_floor_computes_with_mpifls_precision_unless_told(torch_precision):
    cfg = bare_w2.load_config(bare_w2.CONFIG, [])
    torch.backends.cudnn.allow_tf32 = True  # PyTorch's default
    assert bare_w2.precision(cfg, torch.device("cpu")) == "mpifl's: float32 (TF32 off)"
    assert not torch.backends.cudnn.allow_tf32 and not torch.backends.cuda.matmul.allow_tf32
    assert torch.get_float32_matmul_precision() == "highest"
    tf32 = bare_w2.load_config(bare_w2.CONFIG, ["allow_tf32=true"])
    assert bare_w2.precision(tf32, torch.device("cpu")) == "mpifl's: TF32 allowed"
    assert torch.backends.cudnn.allow_tf32 and torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    assert bare_w2.precision(cfg, torch.device("cpu"), torch_defaults=True).startswith("PyTorch's defaults")
    assert not torch.backends.cudnn.allow_tf32  # left as it was


def test_the_side_by_side_notes_the_floors_precision(tmp_path):
    floor = gpu_side_by_side.SETTINGS[1]
    line = ("bare batched: 0.100 s/round (median), 0.200 s/round for the whole run, load average 1.0, final weights "
            "0123456789ab; precision mpifl's: float32 (TF32 off), deterministic kernels; graph not captured: why")
    median, note = gpu_side_by_side.outcome(floor, line, tmp_path, 50)
    assert median == 0.1
    assert note == ("final weights 0123456789ab; precision mpifl's: float32 (TF32 off), deterministic kernels; "
                    "not captured: why")
