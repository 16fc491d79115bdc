"""The config reference, generated from the schema: every key a run config takes, with its type, default,
limits and the field's own doc, written to docs/reference/config.md by ``python -m mpifl.reference``.

A field's doc is the comment on its line in the source (or on the lines of a field written over several), and
the comment lines right above it; a section's doc is its dataclass's docstring. So a field documented where it is
declared is documented here with nothing else to edit, and a field or section without a doc stops the generator
with a line naming it. ``tests/test_reference.py`` keeps the committed page equal to what this writes.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import sys
import tokenize
import types
import typing
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any, Literal, Union

from mpifl.config import REQUIRED, RunConfig
from mpifl.registry import get_algorithm, known_algorithms

OUTPUT = Path("docs/reference/config.md")
COMMAND = "python -m mpifl.reference"
INTERNAL = {"algorithm_options"}  # RunConfig's slot for the options built from the algorithm's own section
LIMIT_SIGNS = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
TYPE_NAMES = {int: "integer", float: "number", bool: "true or false", str: "string", Any: "any value"}
PLURALS = {int: "integers", float: "numbers", str: "strings"}

HEADER = f"""\
# Config reference

For everyone who writes or reads a run config: every key, its type, default and limits, and what it does.

Generated from the schema by `{COMMAND}` (at the repository root): the sections are the
config dataclasses in `mpifl/`, each key's text is the comment next to its field in the source. Do not edit
this page by hand; `tests/test_reference.py` fails when it differs from what the command writes.

A config is a YAML file. Every key but `algorithm` and `data.dataset` is optional (a file that lacks either
is refused, naming it; `data.prepared` stands in for `data.dataset`). `--set a.b=value` overrides any key
on the command line, the value read as YAML (`--set model.hidden=[128,64]`). Unknown keys (with a
did-you-mean), wrong types and values outside the limits are refused with one line and exit code 2 before
anything runs. `null` is YAML's "none". An algorithm's own options go in a section named after it; a config
may hold several algorithms' sections (each is validated, `algorithm` picks the one that applies), so a
paper's config can carry every compared method's settings. A plug-in algorithm's section is named like the
plug-in; a model or dataset plug-in's settings go in `model.options` / `data.options`
([writing an algorithm](../tutorials/own-algorithm.md), [bringing your own data](../tutorials/own-data.md)).
"""


class UndocumentedError(ValueError):
    """A config field or section whose source carries no doc."""


@dataclasses.dataclass(frozen=True)
class Section:
    path: str  # dotted, "" for the top level
    cls: type
    doc: str
    keys: list[tuple[str, str, str, str, str]]  # rows: key, type, default, limits, doc
    subsections: list[str]


@cache
def _parsed(filename: str) -> tuple[ast.Module, dict[int, tuple[str, bool]]]:
    """A source file's syntax tree, and its comments by line: (text, whether the comment is alone on its line)."""
    text = Path(filename).read_text()
    comments = {}
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            alone = not token.line[:token.start[1]].strip()
            comments[token.start[0]] = (token.string.lstrip("#").strip(), alone)
    return ast.parse(text), comments


def _class_source(cls: type) -> tuple[ast.ClassDef, dict[int, tuple[str, bool]]]:
    tree, comments = _parsed(inspect.getsourcefile(cls) or "")
    node: ast.AST = tree
    for name in cls.__qualname__.split("."):
        node = next(n for n in ast.iter_child_nodes(node) if isinstance(n, ast.ClassDef) and n.name == name)
    assert isinstance(node, ast.ClassDef)
    return node, comments


def section_doc(cls: type, path: str) -> str:
    """The docstring of ``cls`` as one paragraph (a dataclass without one gets a generated ``__doc__``: not a doc)."""
    doc = ast.get_docstring(_class_source(cls)[0])
    if not doc:
        raise UndocumentedError(f"{path or 'top level'}: class {cls.__module__}.{cls.__qualname__} has no docstring; "
                                f"add one saying what the section is for")
    return " ".join(doc.split())


def field_doc(cls: type, name: str, path: str) -> str:
    """The comments of field ``name``: those on its own line(s), after the ones right above it."""
    owner = next(c for c in cls.__mro__ if name in c.__dict__.get("__annotations__", {}))
    node, comments = _class_source(owner)
    field = next(n for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                 and n.target.id == name)
    above: list[str] = []
    line = field.lineno - 1
    while comments.get(line, ("", False))[1]:
        above.insert(0, comments[line][0])
        line -= 1
    inline = [comments[n][0] for n in range(field.lineno, (field.end_lineno or field.lineno) + 1) if n in comments]
    doc = " ".join(" ".join([*above, *inline]).split())
    if not doc:
        where = f"{inspect.getsourcefile(owner)}:{field.lineno}"
        raise UndocumentedError(f"{path}: no doc ({owner.__qualname__}.{name}, {where}); write a comment on the "
                                "field's line or right above it saying what it does")
    return doc


def type_text(tp: Any) -> str:
    """How a field's type reads to someone writing YAML."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        text = " or ".join(type_text(a) for a in args if a is not type(None))
        return f"{text} or `null`" if type(None) in args else text
    if origin is Literal:
        return ", ".join(f"`{a}`" for a in args)
    if origin in (tuple, list):
        return f"list of {PLURALS.get(args[0], type_text(args[0]))}"
    if origin is dict:
        return "mapping"
    if dataclasses.is_dataclass(tp):
        return "section"
    return TYPE_NAMES.get(tp, getattr(tp, "__name__", str(tp)))


def yaml_text(value: Any) -> str:
    """A default as it would be written in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(yaml_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {yaml_text(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return value or '""'
    return repr(value)


def limits_text(field: dataclasses.Field, tp: Any) -> str:
    bounds = ", ".join(f"{LIMIT_SIGNS[k]} {v:g}" for k, v in field.metadata.items()
                       if k in LIMIT_SIGNS and v is not None)
    return f"{bounds} (each entry)" if bounds and typing.get_origin(tp) in (tuple, list) else bounds


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    return field.default_factory()  # type: ignore[operator]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def sections(cls: type, path: str = "") -> Iterator[Section]:
    """``cls`` as a section of the reference, then its nested sections, depth first."""
    hints = typing.get_type_hints(cls)
    keys: list[tuple[str, str, str, str, str]] = []
    subsections: list[str] = []
    for field in dataclasses.fields(cls):
        if not field.init or field.name in INTERNAL and cls is RunConfig:
            continue
        key = f"{path}.{field.name}" if path else field.name
        tp = hints[field.name]
        if dataclasses.is_dataclass(tp):
            subsections.append(key)
            continue
        default = "required" if key in REQUIRED else f"`{yaml_text(_default(field))}`"
        keys.append((f"`{key}`", type_text(tp), default, limits_text(field, tp), field_doc(cls, field.name, key)))
    yield Section(path, cls, section_doc(cls, path), keys, subsections)
    for key in subsections:
        yield from sections(hints[key.rsplit(".", 1)[-1]], key)


def algorithm_sections() -> tuple[list[Section], list[str]]:
    """Every built-in algorithm's options section, and the algorithms that have none."""
    found: list[Section] = []
    without: list[str] = []
    for name in known_algorithms():
        options = get_algorithm(name).options_type
        if dataclasses.fields(options):
            found.extend(sections(options, name))
        else:
            without.append(name)
    return found, without


def _anchor(path: str) -> str:
    """GitHub's anchor of the heading ``## `path` `` (lower case; dots and backticks dropped)."""
    return path.replace(".", "").lower() if path else "top-level"


def _render(section: Section) -> list[str]:
    title = f"`{section.path}`" if section.path else "Top level"
    lines = [f"### {title}" if "." in section.path else f"## {title}", "", section.doc, ""]
    if section.keys:
        lines += ["| key | type | default | limits | what it does |", "|---|---|---|---|---|"]
        lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in section.keys]
        lines.append("")
    if section.subsections:
        links = ", ".join(f"[`{s}`](#{_anchor(s)})" for s in section.subsections)
        lines += [f"Sections: {links}.", ""]
    return lines


def generate() -> str:
    """The whole reference page."""
    run = list(sections(RunConfig))
    algorithms, without = algorithm_sections()
    lines = [HEADER, "## Contents", ""]
    lines += [f"- [{'`' + s.path + '`' if s.path else 'top level'}](#{_anchor(s.path)})" for s in run
              if "." not in s.path]
    lines += ["- algorithms' own sections: " + ", ".join(f"[`{s.path}`](#{_anchor(s.path)})" for s in algorithms
                                                        if "." not in s.path), ""]
    for section in run:
        lines += _render(section)
    lines += ["# Algorithms' own sections", "",
              "Each built-in algorithm ([the algorithms](algorithms.md)) reads the section named after it. "
              f"{', '.join(f'`{n}`' for n in without)} take no options of their own "
              "(FedAvg-style ones use the `client` and `server` sections).", ""]
    for section in algorithms:
        lines += _render(section)
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=OUTPUT, help=f"the page to write (default: {OUTPUT})")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the page is out of date")
    args = parser.parse_args(argv)
    try:
        text = generate()
    except UndocumentedError as exc:
        sys.stderr.write(f"{COMMAND}: error: {exc}\n")
        return 1
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            sys.stderr.write(f"{args.out} is out of date: regenerate it with `{COMMAND}`\n")
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
