"""The quick tier (``scripts/test_quick.sh``) stays a subset of the full single-process suite (``scripts/test.sh``):
both scripts' pytest selections are collected as written and compared test by test."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

from tests.conftest import HANG_S, REPO

VALUED = ("-n", "--dist", "-p")
"""pytest options whose value is the next word and that change how tests run, not which."""


def selections(script: str) -> list[tuple[str, list[str]]]:
    """The ``-m`` expression and the paths of each single-process ``python -m pytest`` line in ``script`` (the
    pytest-mpi lines, under mpirun, are not one)."""
    lines = [line for line in (REPO / script).read_text().splitlines()
             if "python -m pytest" in line and "mpirun" not in line and "--with-mpi" not in line]
    assert lines, f"{script}: no single-process pytest line"
    found = []
    for line in lines:
        words = iter(shlex.split(line.split("python -m pytest", 1)[1].replace('"$@"', "")))
        marks, paths = "", []
        for word in words:
            if word == "-m":
                marks = next(words)
            elif word in VALUED:
                next(words)
            elif not word.startswith("-"):
                paths.append(word)
        found.append((marks, paths))
    return found


MARKS = """
import sys, pytest
class Marks:
    def pytest_collection_finish(self, session):
        for item in session.items:
            print("MARKS", item.nodeid, " ".join(sorted({mark.name for mark in item.iter_markers()})), sep="\t")
sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider"], plugins=[Marks()]))
"""


def every_test_and_its_marks() -> dict[str, set[str]]:
    """The whole suite as collected, once, with each test's marks (what ``-m`` selects on)."""
    proc = subprocess.run([sys.executable, "-c", MARKS], cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    fields = [line.split("\t") for line in proc.stdout.splitlines() if line.startswith("MARKS\t")]
    suite = {test: set(marks.split()) for _, test, marks in fields}
    assert f"\n{len(suite)} tests collected" in proc.stdout, proc.stdout[-500:]  # each once, whatever its id holds
    return suite


def selected(suite: dict[str, set[str]], marks: str, paths: list[str] | None = None) -> set[str]:
    """The tests ``pytest -m MARKS [PATHS]`` runs, by pytest's own reading of the expression."""
    from _pytest.mark.expression import Expression

    expression = Expression.compile(marks)
    def marked(names: set[str]):  # noqa: ANN202
        return lambda name, /, **_: name in names

    return {test for test, names in suite.items() if expression.evaluate(marked(names))
            and (not paths or any(test == path or test.startswith((f"{path}::", f"{path.rstrip('/')}/"))
                                  for path in paths))}


def test_the_quick_tier_is_a_part_of_the_full_suite():
    full, [(quick, quick_paths)] = selections("scripts/test.sh"), selections("scripts/test_quick.sh")
    assert quick == "not slow and not launches and not runs" and quick_paths == []
    suite = every_test_and_its_marks()
    runs = [selected(suite, marks, paths) for marks, paths in full]
    # a run that names paths (the wall-time tests, whose files alone it collects) leaves out no test its marks take
    assert all(selected(suite, marks) == run for (marks, _), run in zip(full, runs))
    everything, fast = set().union(*runs), selected(suite, quick)
    assert fast and fast < everything, sorted(fast - everything)[:20]
    # the full runs together are every test but the slow ones (left to local runs), once each
    assert everything == selected(suite, "not slow") and sum(map(len, runs)) == len(everything)
    # what the quick tier leaves out: the tests that start processes, share a module-wide fixture or run a whole
    # job, and only those
    assert selected(suite, "not slow and (launches or runs)") == everything - fast
    assert "launches" in suite["tests/test_mpi_jobs.py::test_validate_command"]  # run_mpifl in its source
    assert "runs" in suite["tests/test_checkpoint.py::test_checkpoints_hold_no_pickle"]  # main(["run", ...])


GROUPED = '''
import os
import pytest

@pytest.fixture(scope="module")
def built(tmp_path_factory):
    (tmp_path_factory.getbasetemp().parent.parent / f"built.{os.getpid()}").touch()

@pytest.mark.parametrize("case", range(6))
def test_case(built, case):
    open(os.environ["RAN"], "a").write(f"{os.getpid()}\\n")
'''


def test_the_tests_sharing_a_module_fixture_run_on_one_worker(tmp_path):
    """What scripts/test.sh's ``-n 2 --dist loadgroup`` relies on: the tests that share a fixture built once per
    module run on one worker, which builds it once (pytest 9.2 with pytest-xdist 3.8 spread them silently)."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_collection_modifyitems  # noqa: F401\n")
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    ran = tmp_path / "ran"
    (tmp_path / "base").mkdir()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadgroup", "--basetemp", str(tmp_path / "base" / "t"), str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=HANG_S,
                          env={**os.environ, "RAN": str(ran), "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0 and "6 passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert len(set(ran.read_text().split())) == 1  # one worker ran all six
    assert len(list((tmp_path / "base").glob("built.*"))) == 1  # and built the fixture once
