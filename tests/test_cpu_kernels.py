"""The same bits on every node's CPU (issue 60): mpifl pins the CPU kernels of MKL, ATen and oneDNN when imported
(mpifl/cpukernels.py), whatever the environment says; ranks that compute differently are refused; and a run on an
emulated Intel AVX2 CPU (qemu's user-mode emulator, ``-cpu Haswell``) gives the bits of the same run on this machine's
CPU, which ``MPIFL_CPU_KERNELS=native`` does not (so the comparison can see another CPU)."""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys

import numpy as np
import pytest

from mpifl import cpukernels
from tests.conftest import HANG_S, REPO, assert_same, deterministic, mpi_env, mpirun_cmd, run_mpifl

X86 = pytest.mark.skipif(not cpukernels.is_x86(), reason="the pinned kernels are x86-64's (no MKL elsewhere)")
# what another node's environment might hold: each library told to take this CPU's widest path
WIDEST = {"MKL_CBWR": "AVX512", "ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
PROBE = ("import mpifl, torch; from mpifl.training.device import check_cpu_kernels, mkl_branch; "
         "print(check_cpu_kernels(), torch.backends.cpu.get_cpu_capability(), mkl_branch())")


def python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=HANG_S,
                          env={**mpi_env(), **env}, cwd=REPO)


@X86
def test_import_pins_the_kernels_over_what_the_environment_says():
    """A node whose environment asks for its widest paths computes with the portable ones all the same."""
    proc = python(PROBE, WIDEST)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[-2:] == ["AVX2", "3"]  # ATen's AVX2 kernels, MKL's COMPATIBLE branch
    assert proc.stdout.startswith("portable")


@X86
def test_native_leaves_the_libraries_to_choose():
    proc = python(PROBE, {**WIDEST, "MPIFL_CPU_KERNELS": "native", "MKL_CBWR": "AUTO"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("native") and proc.stdout.split()[-1] != "3"


@X86
def test_kernels_chosen_before_the_import_are_refused_in_one_line():
    """torch computing before ``import mpifl`` fixes the paths before mpifl can pin them: a run would then round as
    this node does, so it is refused, naming the cure."""
    env = {key: value for key, value in mpi_env().items() if key not in cpukernels.PORTABLE}
    proc = subprocess.run([sys.executable, "-c", "import torch; torch.ones(8) @ torch.ones(8); " + PROBE],
                          capture_output=True, text=True, timeout=HANG_S, env=env, cwd=REPO)
    assert proc.returncode != 0
    assert "the CPU kernels were chosen before mpifl could pin them" in proc.stderr
    assert "import mpifl before torch computes anything" in proc.stderr


def test_an_unknown_setting_is_one_line(write_config, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mpifl", "run", str(write_config()), "--out", str(tmp_path / "o.h5")],
                          capture_output=True, text=True, timeout=HANG_S, cwd=REPO,
                          env={**mpi_env(), "MPIFL_CPU_KERNELS": "fastest"})
    assert proc.returncode == 2
    assert proc.stderr.strip() == "mpifl: error: MPIFL_CPU_KERNELS='fastest': expected one of portable, native"
    assert not (tmp_path / "o.h5").exists()


def mpmd(config, out, ranks_env: list[dict[str, str]]) -> subprocess.CompletedProcess:  # noqa: ANN001
    """``mpirun -n 1 -x K=V python -m mpifl run CONFIG : -n 1 -x ...``: one rank per environment (Open MPI's MPMD
    form, as on a cluster whose nodes differ)."""
    cmd = mpirun_cmd(len(ranks_env))[:1] + ["--oversubscribe"]
    for k, env in enumerate(ranks_env):
        cmd += [":"] if k else []
        cmd += ["-n", "1"] + [arg for key, value in env.items() for arg in ("-x", f"{key}={value}")]
        cmd += [sys.executable, "-m", "mpifl", "run", str(config), "--out", str(out), "--quiet"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=HANG_S, env=mpi_env(), cwd=REPO)


@X86
def test_a_mixed_cluster_gives_the_bits_of_one_rank(write_config, tmp_path):
    """Three ranks, each told by its environment to take another MKL path (and the workers their CPU's widest ATen
    and oneDNN paths), give the bits of the run on one rank."""
    config = write_config({"model": {"name": "mlp", "hidden": [32]}, "client": {"momentum": 0.9}})
    one = tmp_path / "one.h5"
    assert run_mpifl(["run", str(config), "--out", str(one), "--quiet"]).returncode == 0
    mixed = tmp_path / "mixed.h5"
    proc = mpmd(config, mixed, [{"MKL_CBWR": "AVX2"}, {"MKL_CBWR": "AVX512", **WIDEST}, {"MKL_CBWR": "COMPATIBLE"}])
    assert proc.returncode == 0, proc.stderr
    assert_same(deterministic(one), deterministic(mixed))


@X86
def test_ranks_with_different_kernels_are_refused_before_training(write_config, tmp_path):
    out = tmp_path / "o.h5"
    proc = mpmd(write_config(), out, [{}, {"MPIFL_CPU_KERNELS": "native"}])
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("mpifl: error")]
    assert lines == [lines[0]] and "ranks compute with different CPU kernels" in lines[0]
    assert "rank(s) 0: portable" in lines[0] and "rank(s) 1: native" in lines[0]
    assert not out.exists()
    # native on every rank is what the opt-out is for, even where the nodes' own paths differ
    both = mpmd(write_config({"rounds": 1}), tmp_path / "both.h5", [{"MPIFL_CPU_KERNELS": "native"},
                                                                    {"MPIFL_CPU_KERNELS": "native", **WIDEST}])
    assert both.returncode == 0, both.stderr


QEMU = shutil.which("qemu-x86_64")


def other_vendors_cpu() -> str:
    """A qemu CPU model of the other x86 vendor than this machine's (MKL chooses its path by vendor too), with AVX2
    and without AVX-512 (qemu emulates neither AVX-512 nor the host's model)."""
    vendor = next((line.split(":")[1].strip() for line in open("/proc/cpuinfo") if line.startswith("vendor_id")), "")
    return "EPYC-Rome" if vendor == "GenuineIntel" else "Haswell"


@X86
@pytest.mark.skipif(QEMU is None, reason="qemu-x86_64 (Debian's qemu-user) is missing: scripts/test.sh installs it")
def test_an_emulated_cpu_of_the_other_vendor_gives_this_cpus_bits(write_config, tmp_path):
    """The same run natively and under qemu's user-mode emulator as a CPU of the other vendor with AVX2 and without
    AVX-512 (Haswell on an AMD machine, EPYC-Rome on an Intel one): MKL, ATen and oneDNN then see another vendor
    and, on an AVX-512 machine, another instruction set. Portable kernels give one set of bits; the libraries' own
    choice does not (MKL's depends on the vendor), which shows the comparison sees the CPU. The CNN's convolution,
    its linear layers and the loss cover the three libraries."""
    config = write_config({"rounds": 1, "model": {"name": "cnn", "channels": [8], "fc_hidden": 32},
                           "client": {"momentum": 0.9, "batch_size": 32}})
    runs = {}
    for kernels in ("portable", "native"):
        for cpu in ("host", other_vendors_cpu()):
            out = tmp_path / f"{kernels}-{cpu}.h5"
            env = {key: value for key, value in mpi_env().items() if key not in cpukernels.PORTABLE}
            emulate = [] if cpu == "host" else [QEMU, "-cpu", cpu]
            proc = subprocess.run([*emulate, sys.executable, "-m", "mpifl", "run", str(config), "--out", str(out),
                                   "--quiet"], capture_output=True, text=True, timeout=HANG_S, cwd=REPO,
                                  env={**env, "MPIFL_CPU_KERNELS": kernels})
            assert proc.returncode == 0, proc.stderr
            runs[kernels, cpu] = deterministic(out)
    other = other_vendors_cpu()
    assert_same(runs["portable", "host"], runs["portable", other])
    native = runs["native", "host"], runs["native", other]
    assert not all(np.array_equal(a, b) for a, b in zip(native[0].values(), native[1].values())), (
        f"{platform.processor() or 'this CPU'}: natively chosen kernels gave {other}'s bits too")

