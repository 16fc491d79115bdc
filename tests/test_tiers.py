"""The quick tier (``scripts/test_quick.sh``) stays a subset of the full single-process suite (``scripts/test.sh``):
both scripts' pytest selections are collected as written and compared test by test."""

from __future__ import annotations

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


def collected(args: list[str]) -> set[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=HANG_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {line for line in proc.stdout.splitlines() if "::" in line}


def test_the_quick_tier_is_a_part_of_the_full_suite():
    full, [(quick, quick_paths)] = selections("scripts/test.sh"), selections("scripts/test_quick.sh")
    assert quick == "not slow and not launches" and quick_paths == [] and all(paths == [] for _, paths in full)
    runs = [collected(["-m", marks]) for marks, _ in full]
    everything, fast = set().union(*runs), collected(["-m", quick])
    assert fast and fast < everything, sorted(fast - everything)[:20]
    # the full runs together are every test but the slow ones (left to local runs), once each
    assert everything == collected(["-m", "not slow"]) and sum(map(len, runs)) == len(everything)
    # what the quick tier leaves out: the tests that start processes or share a module-wide fixture, only those
    assert collected(["-m", "not slow and launches"]) == everything - fast
