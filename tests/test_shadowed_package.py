"""``python -m mpifl`` from a folder that holds a folder named ``mpifl`` that is not the package (issue 57): one line
that names the folder and the cure, exit code 2, never ``ImportError: cannot import name 'Results' from
'mpifl.results'``.

``-m`` puts the folder it is started from first on the import path, and an editable install (``scripts/setup.sh``'s
``pip install -e``) finds the package through a finder consulted after that path: a plain folder ``mpifl`` there
becomes the package, and each module the folder lacks comes from the checkout, one by one. Each test starts Python
with such a finder for this checkout (a ``sitecustomize`` on its path, as setuptools' ``.pth`` installs one), so
the checkout is found as a user's editable install finds it, whichever checkout this environment was installed
from. (A file ``mpifl.py`` there runs instead of the package, and nothing of mpifl's with it: not caught.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, mpi_env, mpirun_cmd

EDITABLE_FINDER = f"""import sys
from importlib.machinery import PathFinder
from importlib.util import spec_from_file_location

PACKAGE = {str(REPO / "mpifl")!r}


class EditableFinder:  # setuptools' editable install's, reduced: after the path, mpifl from the checkout
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname == "mpifl":
            return spec_from_file_location(fullname, PACKAGE + "/__init__.py", submodule_search_locations=[PACKAGE])
        parent = fullname.rpartition(".")[0].split(".")
        if parent[0] == "mpifl":
            return PathFinder.find_spec(fullname, ["/".join([PACKAGE, *parent[1:]])])
        return None


sys.meta_path.insert(sys.meta_path.index(PathFinder) + 1, EditableFinder)
"""


def python_m_mpifl(cwd: Path, site: Path, *python: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    return subprocess.run([sys.executable, *python, "-m", "mpifl", "report", "nothing.h5"], cwd=cwd, text=True,
                          capture_output=True, env={**env, "PYTHONPATH": str(site)}, timeout=120)


@pytest.fixture
def site(tmp_path: Path) -> Path:
    folder = tmp_path / "site"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(EDITABLE_FINDER)
    return folder


@pytest.mark.parametrize("layout", [
    ["mpifl/"],  # an empty folder
    ["mpifl/results/", "mpifl/plugins/"],  # one whose folders are named as the package's modules
    ["mpifl/mpifl/__init__.py", "mpifl/results/run.h5", "mpifl/README.md"],  # the clone's parent
    ["mpifl/__init__.py"],  # a package of the user's own
], ids=["empty", "results-plugins", "clone-parent", "own-package"])
def test_a_folder_named_mpifl_where_python_m_starts_is_named_with_the_cure(tmp_path, site, layout):
    """Each shadow is named in one line with the cure, exit 2; from elsewhere, or with ``python -P`` (Python 3.11
    and later), the same command reaches mpifl."""
    here = tmp_path / "here"
    for entry in layout:
        path = here / entry
        if entry.endswith("/"):
            path.mkdir(parents=True, exist_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("")
    proc = python_m_mpifl(here, site)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    cure = "run it from another folder"
    if sys.version_info >= (3, 11):
        cure += ", or with python -P -m mpifl (or PYTHONSAFEPATH=1), which leaves that folder off the path"
    assert proc.stderr == (f"mpifl: error: the folder {here / 'mpifl'} is not the mpifl package but shadows it: "
                           "Python imports it as mpifl because it lies in the folder python was started from, which "
                           f"-m puts first on the import path; {cure}\n")
    if sys.version_info >= (3, 11):
        assert python_m_mpifl(here, site, "-P").stderr == REACHED


REACHED = "mpifl: error: results file nothing.h5 does not exist\n"
"""What the command says once it reaches mpifl."""


def test_a_folder_named_mpifl_on_pythonpath_before_the_package_is_named(tmp_path, site):
    """The same shadow reached through PYTHONPATH: the cure is to take it off. (Without a shadow, the command
    reaches mpifl: the finder finds the checkout.)"""
    assert python_m_mpifl(tmp_path, site).stderr == REACHED
    (tmp_path / "other" / "mpifl" / "results").mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-m", "mpifl", "report", "nothing.h5"], cwd=tmp_path, text=True,
                          capture_output=True, env={**env, "PYTHONPATH": f"{tmp_path / 'other'}:{site}"}, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr == (f"mpifl: error: the folder {tmp_path / 'other' / 'mpifl'} is not the mpifl package but "
                           f"shadows it: Python imports it as mpifl because it lies in {tmp_path / 'other'}, which "
                           "comes before the package on Python's import path (sys.path: PYTHONPATH?); take "
                           f"{tmp_path / 'other'} off PYTHONPATH, or rename the folder\n")


def test_under_mpirun_the_line_is_said_once(tmp_path, site):
    """Every rank finds the shadow; rank 0 says it, and the others wait for the launcher to end them after it, so
    that its line is out before the job ends."""
    (tmp_path / "mpifl" / "results").mkdir(parents=True)
    env = {k: v for k, v in mpi_env().items() if k != "PYTHONPATH"}
    proc = subprocess.run([*mpirun_cmd(3), sys.executable, "-m", "mpifl", "report", "nothing.h5"], cwd=tmp_path,
                          text=True, capture_output=True, env={**env, "PYTHONPATH": str(site)}, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if "mpifl: error" in line]
    assert len(lines) == 1 and f"the folder {tmp_path / 'mpifl'} is not the mpifl package" in lines[0], proc.stderr
