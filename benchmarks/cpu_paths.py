"""Which CPU code paths change a float32 result's bits (docs/explanation/determinism.md, "Across nodes").

Hashes a dozen operations mpifl's training uses (a sum, a dot product, log-softmax and cross-entropy, linear layers
and their weight gradients, batched products, convolutions and their gradients, a norm), one thread, fixed inputs,
under each setting of MKL's, ATen's and oneDNN's path variables, natively and under qemu's user-mode emulator as
other CPUs (``qemu-x86_64 -cpu MODEL``: Debian's qemu-user; qemu emulates AVX2 but not AVX-512)::

    python benchmarks/cpu_paths.py                       # this CPU and qemu's Haswell, Skylake-Client, EPYC-Rome
    python benchmarks/cpu_paths.py --cpus host Haswell

Each row is one (CPU, setting); each column an operation's hash (6 hex digits). The settings are run without
mpifl's pin (this script does not import mpifl), so "unset" is what each library chooses by itself. The last lines
say, per setting, whether every CPU gave one set of bits.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys

SETTINGS = {
    "unset": {},
    "MKL AVX2": {"MKL_CBWR": "AVX2"},
    "MKL COMPATIBLE": {"MKL_CBWR": "COMPATIBLE"},
    "MKL AVX2 + ATen avx2 + oneDNN AVX2": {"MKL_CBWR": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
                                           "ONEDNN_MAX_CPU_ISA": "AVX2"},
    "mpifl portable": {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"},
}
PATH_VARIABLES = ("MKL_CBWR", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MPIFL_CPU_KERNELS")


def probe() -> dict[str, str]:
    """Each operation's hash on this process's paths."""
    import torch

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    f = torch.nn.functional

    def h(t: torch.Tensor) -> str:
        return hashlib.md5(t.detach().contiguous().numpy().tobytes()).hexdigest()[:6]

    out = {}
    v = torch.randn(100003, generator=g)
    out["sum"], out["dot"], out["norm"] = h(v.sum()), h(v @ v), h(torch.linalg.vector_norm(v))
    x, y = torch.randn(64, 10, generator=g), torch.randint(0, 10, (64,), generator=g)
    out["xent"], out["logsm"] = h(f.cross_entropy(x, y)), h(f.log_softmax(x, 1))
    a = torch.randn(64, 300, generator=g)
    w = torch.randn(50, 300, generator=g, requires_grad=True)
    b = torch.randn(50, generator=g)
    o = f.linear(a, w, b)
    out["linear"], out["linear_bw"] = h(o), h(torch.autograd.grad(o.square().sum(), w)[0])
    out["bmm_small"] = h(torch.bmm(torch.randn(7, 8, 16, generator=g), torch.randn(7, 16, 10, generator=g)))
    out["bmm"] = h(torch.bmm(torch.randn(7, 64, 300, generator=g), torch.randn(7, 300, 50, generator=g)))
    for name, (images, kernel, pad) in {"conv5x5": ((16, 3, 32, 32), (16, 3, 5, 5), 0),
                                        "conv3x3": ((16, 32, 16, 16), (64, 32, 3, 3), 1)}.items():
        k = torch.randn(*kernel, generator=g, requires_grad=True)
        c = f.conv2d(torch.randn(*images, generator=g), k, padding=pad)
        out[name], out[f"{name}_bw"] = h(c), h(torch.autograd.grad(c.square().sum(), k)[0])
    return out


def run(cpu: str, setting: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PATH_VARIABLES}
    emulate = [] if cpu == "host" else [shutil.which("qemu-x86_64") or "qemu-x86_64", "-cpu", cpu]
    proc = subprocess.run([*emulate, sys.executable, __file__, "--probe"], capture_output=True, text=True,
                          env={**env, **setting}, check=True)
    return json.loads(proc.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpus", nargs="+", default=["host", "Haswell", "Skylake-Client", "EPYC-Rome"])
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        print(json.dumps(probe()))
        return
    rows = {(cpu, name): run(cpu, setting) for name, setting in SETTINGS.items() for cpu in args.cpus}
    ops = list(next(iter(rows.values())))
    print(f"| CPU | setting | {' | '.join(ops)} |")
    print("|---|---|" + "---|" * len(ops))
    for (cpu, name), hashes in rows.items():
        print(f"| {cpu} | {name} | {' | '.join(hashes[op] for op in ops)} |")
    for name in SETTINGS:
        differ = [op for op in ops if len({rows[cpu, name][op] for cpu in args.cpus}) > 1]
        print(f"{name}: " + ("one set of bits on every CPU" if not differ else f"CPUs differ in {', '.join(differ)}"))


if __name__ == "__main__":
    main()
