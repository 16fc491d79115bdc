"""The generated config reference (docs/reference/config.md): the committed page is what ``python -m
mpifl.reference`` writes, every key a config takes is on it, and each field's doc is read from the comments
next to it in the source (a field without one stops the generator, naming it)."""

from __future__ import annotations

import dataclasses
import importlib
import textwrap
import typing

import pytest

from mpifl import reference
from mpifl.config import config_to_dict
from mpifl.registry import get_algorithm, known_algorithms, parse_config
from tests.conftest import REPO

PAGE = REPO / "docs" / "reference" / "config.md"


def test_the_committed_reference_is_what_the_generator_writes():
    assert PAGE.read_text() == reference.generate(), (
        "docs/reference/config.md is out of date: regenerate it with `python -m mpifl.reference` at the "
        "repository root and commit it")


def keys_of(value, prefix: str = "") -> list[str]:
    """The dotted keys of a resolved config, mappings that are values (plug-in options, codec overrides) kept
    whole."""
    if not isinstance(value, dict) or prefix.endswith((".options", ".messages")):
        return [prefix]
    return [key for name, sub in value.items() for key in keys_of(sub, f"{prefix}.{name}" if prefix else name)]


def test_every_key_a_config_takes_has_a_row():
    """Enumerated independently of the generator: the resolved config of a run that names every built-in
    algorithm's section, flattened."""
    raw = {"algorithm": "fedavg", "data": {"dataset": "digits"},
           **{name: {} for name in known_algorithms() if dataclasses.fields(get_algorithm(name).options_type)}}
    resolved = config_to_dict(parse_config(raw))
    for name in raw:
        if name not in resolved:  # the other algorithms' sections, resolved with their defaults
            resolved[name] = dataclasses.asdict(get_algorithm(name).options_type())
    keys = keys_of(resolved)
    assert "faults.deadline_s" in keys and "pefll.hyper_hidden" in keys and "compression.down.bits" in keys
    rows = {line.split(" | ")[0].strip("| `") for line in PAGE.read_text().splitlines() if line.startswith("| `")}
    assert sorted(set(keys) - rows) == []
    assert sorted(rows - set(keys)) == []


def test_a_key_reads_its_type_default_limits_and_doc():
    row = next(line for line in PAGE.read_text().splitlines() if line.startswith("| `faults.deadline_s` |"))
    assert row.startswith("| `faults.deadline_s` | number or `null` | `null` | > 0 | seconds: a client whose expected "
                          "round time exceeds it is dropped before the round.")
    row = next(line for line in PAGE.read_text().splitlines() if line.startswith("| `knnper.weights` |"))
    assert " | `[0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]` | ≥ 0, ≤ 1 (each entry) | " in row


SOURCE = '''
from __future__ import annotations
from dataclasses import dataclass, field
from typing import Literal
from mpifl.schema import limits


@dataclass(frozen=True)
class Base:
    """A base section."""

    # first line above
    # second line above
    shared: int = field(default=3, metadata=limits(ge=1))  # and on the line


@dataclass(frozen=True)
class Section(Base):
    """A section whose docstring
    spans two lines."""

    grid: tuple[float, ...] = field(default=(0.5, 1.0),  # a field over two lines
                                    metadata=limits(gt=0, le=1))
    mode: Literal["a", "b"] | None = None  # pick one
    x: int = 1  # a comment on the line above the next field does not belong to it...

    y: str = ""


@dataclass(frozen=True)
class Undocumented:
    z: int = 1  # documented
'''


@pytest.fixture
def section(tmp_path, monkeypatch):
    (tmp_path / "doc_sample.py").write_text(textwrap.dedent(SOURCE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module("doc_sample")


def test_field_docs_come_from_the_comments_on_and_right_above_the_field(section):
    cls = section.Section
    assert reference.field_doc(cls, "shared", "s.shared") == "first line above second line above and on the line"
    assert reference.field_doc(cls, "grid", "s.grid") == "a field over two lines"
    assert reference.field_doc(cls, "mode", "s.mode") == "pick one"
    assert reference.section_doc(cls, "s") == "A section whose docstring spans two lines."
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    assert reference.type_text(hints["mode"]) == "`a`, `b` or `null`"
    assert reference.type_text(hints["grid"]) == "list of numbers"
    assert reference.limits_text(fields["grid"], hints["grid"]) == "> 0, ≤ 1 (each entry)"
    assert reference.limits_text(fields["shared"], hints["shared"]) == "≥ 1"
    assert reference.yaml_text((0.5, 1.0)) == "[0.5, 1.0]"
    assert reference.yaml_text(None) == "null" and reference.yaml_text(False) == "false"


def test_a_field_without_a_doc_stops_the_generator_naming_it(section):
    line = textwrap.dedent(SOURCE).splitlines().index('    y: str = ""') + 1
    with pytest.raises(reference.UndocumentedError, match=rf"^s\.y: no doc \(Section\.y, .*doc_sample\.py:{line}\); "):
        list(reference.sections(section.Section, "s"))
    with pytest.raises(reference.UndocumentedError, match=r"^u: class doc_sample\.Undocumented has no docstring"):
        list(reference.sections(section.Undocumented, "u"))


def test_check_says_how_to_regenerate_a_stale_page(tmp_path, capsys):
    stale = tmp_path / "config.md"
    stale.write_text("# an old page\n")
    assert reference.main(["--check", "--out", str(stale)]) == 1
    assert capsys.readouterr().err == f"{stale} is out of date: regenerate it with `python -m mpifl.reference`\n"
    assert reference.main(["--out", str(stale)]) == 0
    assert reference.main(["--check", "--out", str(stale)]) == 0
    assert stale.read_text() == reference.generate()
