"""The install story: every package mpifl imports is declared, and scripts/setup.sh refuses a machine
that cannot work with one line and exit code 2 before it creates anything."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

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
                          capture_output=True, text=True, timeout=60)


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
    torch = {"bad-torch": "cuda", "no-system-torch": "system"}.get(case, "cpu")
    before = sorted(p.name for p in ROOT.iterdir())
    _refused(_setup({"PYTHON": python, "MPIFL_TORCH": torch}), expected.format(python=python))
    assert sorted(p.name for p in ROOT.iterdir()) == before


def test_setup_asks_for_mpicc_when_building_against_the_system_mpi(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "env", "sh", "bash"):
        if (found := shutil.which(tool)) is not None:
            (bin_dir / tool).symlink_to(found)
    result = _setup({"PYTHON": sys.executable, "MPIFL_SYSTEM_MPI": "1", "PATH": str(bin_dir)})
    _refused(result, "needs the cluster's mpicc")
