"""The quick tier (``scripts/test_quick.sh``) stays a subset of the full single-process suite (``scripts/test.sh``):
both scripts' pytest selections are collected as written and compared test by test."""

from __future__ import annotations

import shlex
import subprocess
import sys

from tests.conftest import HANG_S, REPO

VALUED = ("-n", "--dist", "-p")
"""pytest options whose value is the next word and that change how tests run, not which."""


def selection(script: str) -> tuple[str, list[str]]:
    """The ``-m`` expression and the paths of the one ``python -m pytest`` line of the single-process suite in
    ``script`` (the pytest-mpi lines, under mpirun, are not it)."""
    lines = [line for line in (REPO / script).read_text().splitlines()
             if "python -m pytest" in line and "mpirun" not in line and "--with-mpi" not in line]
    assert len(lines) == 1, f"{script}: one single-process pytest line, found {lines}"
    words = iter(shlex.split(lines[0].split("python -m pytest", 1)[1].replace('"$@"', "")))
    marks, paths = "", []
    for word in words:
        if word == "-m":
            marks = next(words)
        elif word in VALUED:
            next(words)
        elif not word.startswith("-"):
            paths.append(word)
    return marks, paths


def collected(args: list[str]) -> set[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {line for line in proc.stdout.splitlines() if "::" in line}


def test_the_quick_tier_is_a_part_of_the_full_suite():
    (full, full_paths), (quick, quick_paths) = selection("scripts/test.sh"), selection("scripts/test_quick.sh")
    assert quick == f"{full} and not launches" and quick_paths == full_paths == []
    everything, fast = collected(["-m", full]), collected(["-m", quick])
    assert fast and fast < everything, sorted(fast - everything)[:20]
    # what it leaves out: the tests that start processes or share a module-wide fixture, and only those
    assert collected(["-m", f"({full}) and launches"]) == everything - fast
