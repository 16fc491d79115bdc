"""The documentation kept honest: every command in the README and docs/ that can run here is run, in a copy of
the repository, and every relative link points at a page (and heading) that exists.

How a page marks its commands (docs/README.md says the same for writers):

- shell commands live in ```console blocks: a line starting with ``$ `` is a command (a line ending in ``\\``
  continues it; ``<<'EOF'`` takes the lines up to ``EOF``), the lines under it are its output. A command whose
  shown output is one ``mpifl: error:`` line must print exactly that line and exit with code 2; every other
  command must exit with code 0. A comment after two spaces (``  # ...``) is not part of the command.
- ``<!-- not run: why -->`` on the line above a block: not run (it needs Slurm, a GPU, several nodes, or sets
  up the environment); the reason is required.
- ``<!-- file: PATH -->`` on the line above any fenced block: the block is written to PATH (in the copy)
  before the page's next commands run.
- ``<!-- requires: module.attribute -->`` anywhere: the page's commands run only where that name imports (a
  page written for an interface that is still being merged).

Runs are shortened: ``mpifl run`` and ``mpifl sweep`` get ``--set rounds=2`` unless the command sets
``rounds`` itself, and ``mpirun`` gets ``--oversubscribe`` (this machine may have fewer cores than ranks).
docs/papers/ is left out: its commands run for hours on datasets a test does not have (its sweep files are
validated and smoke-run by tests/test_evidence_sweeps.py).
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, mpi_env

DOCS = REPO / "docs"
EVIDENCE = DOCS / "papers"
MARKER = re.compile(r"^<!-- (not run|file|requires): ?(.*?) ?-->$")
FENCE = re.compile(r"^```(\S*)")
HEREDOC = re.compile(r"<<-?\s*'?(\w+)'?")
ROUNDS = re.compile(r"\bmpifl (run|sweep)\b")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# pages linked from the index that other branches write (GPUs, offline install, the architecture): a link to
# one is checked once it exists
PENDING = {DOCS / "how-to" / "gpus.md", DOCS / "how-to" / "install-offline.md",
           DOCS / "explanation" / "architecture.md"}


@dataclass
class Command:
    text: str
    output: list[str] = field(default_factory=list)


@dataclass
class Block:
    language: str
    lines: list[str]
    marker: tuple[str, str] | None  # ("not run" | "file", argument) from the line above the fence


def pages() -> list[Path]:
    """The README and every page of docs/ but the evidence pages."""
    found = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
    return [p for p in found if EVIDENCE not in p.parents]


def blocks(text: str) -> list[Block]:
    lines, out, i = text.splitlines(), [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        above = MARKER.match(lines[i - 1]) if i else None
        end = lines.index("```", i + 1)
        marker = (above.group(1), above.group(2)) if above and above.group(1) != "requires" else None
        out.append(Block(fence.group(1), lines[i + 1:end], marker))
        i = end + 1
    return out


def commands(block: Block) -> list[Command]:
    """A console block's commands, each with the output shown under it."""
    found: list[Command] = []
    lines = iter(block.lines)
    for line in lines:
        if not line.startswith("$ "):
            assert found, f"output before the first command: {line!r}"
            found[-1].output.append(line)
            continue
        text = line[2:]
        while text.endswith("\\"):
            text = text[:-1] + next(lines).strip()
        heredoc = HEREDOC.search(text)
        if heredoc:
            body = []
            for inner in lines:
                body.append(inner)
                if inner == heredoc.group(1):
                    break
            text = "\n".join([text, *body])
        found.append(Command(text))
    return found


def shortened(command: str) -> str:
    """The command as the test runs it: a short run, and room for more ranks than cores."""
    first, _, rest = command.partition("\n")
    first, _, _comment = first.partition("  # ")
    if ROUNDS.search(first) and "rounds=" not in first:
        first += " --set rounds=2"
    first = re.sub(r"\bmpirun (?!--oversubscribe)", "mpirun --oversubscribe ", first)
    return "\n".join([first, rest]) if rest else first


def requirement(text: str) -> str | None:
    """The name a page requires, if it names one."""
    found = re.search(r"^<!-- requires: (\S+) -->$", text, re.M)
    return found.group(1) if found else None


def importable(name: str) -> bool:
    module, _, attribute = name.rpartition(".")
    try:
        return hasattr(importlib.import_module(module), attribute)
    except ImportError:
        return False


def runnable(page: Path) -> bool:
    return any(b.language == "console" and b.marker is None for b in blocks(page.read_text()))


def repository_copy(root: Path) -> Path:
    """The files git would commit (tracked, and new ones it does not ignore), copied under ``root``."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            target = root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return root


@pytest.mark.parametrize("page", [p for p in pages() if runnable(p)], ids=lambda p: str(p.relative_to(REPO)))
def test_the_commands_of_a_page_run(page, tmp_path):
    text = page.read_text()
    needed = requirement(text)
    if needed and not importable(needed):
        pytest.skip(f"{page.relative_to(REPO)} is written for {needed}, which this checkout does not have yet")
    root = repository_copy(tmp_path / "repo")
    env = {**mpi_env(), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH")  # commands see the copy as a user's checkout does (and set PYTHONPATH themselves)
    for block in blocks(text):
        if block.marker and block.marker[0] == "file":
            (root / block.marker[1]).write_text("\n".join(block.lines) + "\n")
        if block.language != "console" or block.marker:
            continue
        for command in commands(block):
            run = shortened(command.text)
            proc = subprocess.run(["bash", "-c", run], cwd=root, env=env, capture_output=True, text=True, timeout=600)
            said = f"$ {run}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
            if len(command.output) == 1 and command.output[0].startswith("mpifl: error:"):
                assert (proc.returncode, proc.stderr) == (2, command.output[0] + "\n"), said
            else:
                assert proc.returncode == 0, said


def test_every_page_says_who_it_is_for_and_marks_its_commands():
    """Under each docs page's title, one line saying who it is for; shell commands only in console blocks (so
    the test above sees them), each block run or marked with a reason; markers well formed."""
    for page in [*pages(), *sorted(EVIDENCE.glob("*.md"))]:
        text, name = page.read_text(), page.relative_to(REPO)
        lines = [line for line in text.splitlines() if line.strip()]
        if page.parent != REPO and len(lines) > 1:  # one-line pages point to where a page moved
            assert lines[0].startswith("# ") and lines[1].startswith("For "), f"{name}: title, then 'For ...'"
        if EVIDENCE in page.parents:
            continue
        for block in blocks(text):
            assert block.language not in ("bash", "sh", "shell", "shell-session"), (
                f"{name}: shell commands go in ```console blocks with '$ ' lines")
            if block.language == "console":
                assert commands(block), f"{name}: a console block without a '$ ' command"
            if block.marker:
                assert block.marker[1], f"{name}: <!-- {block.marker[0]}: ... --> needs its argument"
        for line in text.splitlines():
            if line.startswith("<!--"):
                assert MARKER.match(line), f"{name}: unknown marker {line!r}"


def test_the_pages_show_the_quickstart_config_as_it_is():
    """The README and the first-run tutorial print configs/quickstart.yaml; what they print is the file."""
    config = yaml.safe_load((REPO / "configs" / "quickstart.yaml").read_text())
    for page in (REPO / "README.md", DOCS / "tutorials" / "first-run.md"):
        shown = [yaml.safe_load("\n".join(b.lines)) for b in blocks(page.read_text()) if b.language == "yaml"]
        assert config in shown, f"{page.relative_to(REPO)} does not show configs/quickstart.yaml as it is"


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    found = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            found.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return found


def test_relative_links_point_at_pages_and_headings_that_exist():
    for page in [*pages(), *sorted(EVIDENCE.glob("*.md"))]:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if resolved in PENDING and not resolved.exists():
                continue
            assert resolved.exists(), f"{page.relative_to(REPO)}: broken link {target}"
            if anchor and resolved.suffix == ".md":
                assert anchor in anchors(resolved), f"{page.relative_to(REPO)}: no heading for {target}"
