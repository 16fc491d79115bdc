"""Where a test run's time went, from pytest's JUnit files: per file, and per kind (tests that start processes
or share a module-wide fixture, marked ``launches``; the Slurm and namespace-node tests; the rest, in process).

    python -m tests.durations RUN.xml [RUN.xml ...]

docs/how-to/tests.md records its output for the runs before and after issue 49.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from collections import Counter

from tests.conftest import SERIAL
from tests.test_tiers import every_test_and_its_marks


def durations(paths: list[str]) -> dict[str, float]:
    """Seconds per test (setup, call and teardown), by node id, over every file."""
    found: dict[str, float] = {}
    for path in paths:
        for case in ET.parse(path).iter("testcase"):
            classname, name = case.get("classname") or "", case.get("name") or ""
            if "@" in classname:  # an xdist group's test: "tests.mod.test_x[...]@tests/mod.py", the group as name
                dotted, file = classname.split("@", 1)
                name = dotted[len(file.removesuffix(".py").replace("/", ".")) + 1:]
            else:
                file = classname.replace(".", "/") + ".py"
            found[f"{file}::{name}"] = found.get(f"{file}::{name}", 0.0) + float(case.get("time") or 0)
    return found


def kind(test: str, marks: dict[str, set[str]]) -> str:
    if test.startswith(SERIAL):
        return "slurm and namespace nodes"
    return "starts processes / shared fixture" if "launches" in marks.get(test, set()) else "in process"


def main(argv: list[str]) -> int:
    seconds = durations(argv)
    marks = every_test_and_its_marks()
    files, kinds, counts = Counter(), Counter(), Counter()
    for test, spent in seconds.items():
        files[test.split("::")[0]] += spent
        kinds[kind(test, marks)] += spent
        counts[kind(test, marks)] += 1
    total = sum(seconds.values())
    print(f"{total:8.0f} s  {len(seconds)} tests")
    for name, spent in kinds.most_common():
        print(f"{spent:8.0f} s  {spent / total:4.0%}  {counts[name]:5d} tests  {name}")
    print()
    for name, spent in files.most_common(25):
        print(f"{spent:8.0f} s  {spent / total:4.0%}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
