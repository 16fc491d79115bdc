"""The CPU kernels every rank computes with: the same code paths on any x86-64 node, so a client's bits do not
depend on the node that trains it (docs/explanation/determinism.md, "Across nodes").

PyTorch's x86 wheels choose three code paths by the CPU they find, and each rounds its own way:

* MKL's matrix products (``nn.Linear``, the batch's ``bmm``) by instruction set *and vendor*: its AVX2 branch is
  honoured on Intel CPUs only (an AMD CPU asked for it runs MKL's automatic choice), and its automatic choice differs
  between AVX2 and AVX-512 nodes and between Intel and AMD;
* ATen's vectorized kernels (softmax, log-softmax, reductions) by vector width (8 floats with AVX2, 16 with AVX-512);
* oneDNN's convolutions by instruction set.

Measured on one AMD EPYC (AVX-512) and, under ``qemu-x86_64 -cpu Haswell / Skylake-Client / EPYC-Rome``, on
emulated Intel and AMD AVX2 CPUs (``python benchmarks/cpu_paths.py``): only MKL's ``COMPATIBLE`` branch, ATen at
``avx2`` and oneDNN capped at ``AVX2`` give the same bits for every probed operation on all four. So mpifl sets
them when it is imported, before torch computes anything (each library reads its variable at its first
operation), overriding what the environment says: a node's own ``MKL_CBWR`` must not make its ranks round
differently from the others'. ``MPIFL_CPU_KERNELS=native`` leaves the libraries to choose (the fastest path on each
node, bits that depend on the node); every rank of a run must use the same setting (checked at start-up).
"""

from __future__ import annotations

import os
import platform

SETTING = "MPIFL_CPU_KERNELS"
MODES = ("portable", "native")
PORTABLE = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
"""What ``portable`` sets: MKL's branch that every vendor honours, ATen's and oneDNN's AVX2 paths (every x86-64
server CPU since 2013 has AVX2)."""


def is_x86() -> bool:
    """Whether this is an x86-64 CPU, where the three libraries choose by CPU (on other CPUs torch has no MKL)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def mode() -> str:
    """This process's ``MPIFL_CPU_KERNELS`` (``portable`` unless set)."""
    return os.environ.get(SETTING, "portable").strip().lower() or "portable"


def has_avx2() -> bool:
    """Whether this x86 CPU has AVX2 and FMA (ATen told ``avx2`` on one without them would stop at its first vector
    instruction); where ``/proc/cpuinfo`` cannot tell, assumed."""
    try:
        with open("/proc/cpuinfo") as info:
            flags = next((line.split(":", 1)[1].split() for line in info if line.startswith("flags")), None)
    except OSError:
        return True
    return flags is None or {"avx2", "fma"} <= set(flags)


def pin() -> None:
    """Set :data:`PORTABLE` in this process's environment unless ``MPIFL_CPU_KERNELS`` says ``native`` (or the CPU
    lacks AVX2, which the check at start-up then refuses in one line): called on ``import mpifl``, before any of the
    three libraries has read its variable (``mpifl.training.device.check_cpu_kernels`` refuses a process where one
    had)."""
    if mode() == "portable" and is_x86() and has_avx2():
        os.environ.update(PORTABLE)
