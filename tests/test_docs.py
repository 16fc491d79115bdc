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
- ``<!-- output: why -->`` on the line above a console block: its commands run as written (not shortened) and
  must print what the block shows, line by line (``...`` stands for any lines), but for the figures that
  measure this machine (:data:`MEASURED`): a page's accuracies, bytes and traffic are this code's, not a
  stale run's.

Runs are shortened: ``mpifl run`` and ``mpifl sweep`` get ``--set rounds=2`` unless the command sets
``rounds`` itself, and ``mpirun`` gets ``--oversubscribe`` (this machine may have fewer cores than ranks).
A plain ``python -m mpifl ARGS`` (no shell syntax: no pipe, redirect, variable or second command) runs as that
command's own entry point, ``mpifl.cli.main(ARGS)``, in the test's process, in the copy, its file descriptors 1
and 2 captured (``tests/batch.py``, as the suite's batched jobs), and a plain ``mpirun -n N python -m mpifl ARGS``
in the copy on the N ranks of the launch this pytest process keeps (``tests/conftest.py``'s ``Launch``): new
interpreters' start-up, most of such a command's time, is all they leave out. Every other command runs in bash, a
process of its own.
docs/papers/ is left out: its commands run for hours on datasets a test does not have (its sweep files are
validated and smoke-run by tests/test_evidence_sweeps.py).
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from benchmarks.gpu_runs import output_to
from tests.batch import run as run_in_this_process
from tests.conftest import REPO, Launch, mpi_env, sweep_runs_in_this_process

DOCS = REPO / "docs"
EVIDENCE = DOCS / "papers"
MARKER = re.compile(r"^<!-- (not run|file|requires|output): ?(.*?) ?-->$")
FENCE = re.compile(r"^```(\S*)")
HEREDOC = re.compile(r"<<-?\s*'?(\w+)'?")
ROUNDS = re.compile(r"\bmpifl (run|sweep)\b")
OPERATORS = set("();<>|&")
"""The shell's operator characters (a word made of them: a pipe, a redirect, a second command, a subshell)."""
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
MEASURED = (
    re.compile(r"(?<=\bwall )\d+(\.\d+)? s"),  # how long this machine took
    re.compile(r"(?<=\bsimulated )\d+(\.\d+)? s"),  # a deployment's time, with the compute this machine measured
    re.compile(r"\d+(\.\d+)? s/round"),
    re.compile(r"\d+(\.\d+)? rounds/s"),  # the progress line's pace, elapsed time and ETA
    re.compile(r"(?<=\belapsed )\S+"),
    re.compile(r"(?<=\bETA )\S+"),
)
"""Figures in a command's output that measure the machine it ran on, not the code: left out of the comparison
of a page's shown output with the printed one; so are the seconds of a report's time-by-rank table
(:data:`TIME_ROW`)."""
TIME_ROW = re.compile(r"^\s+\d+\s+\d+(\s+\d+\.\d+)+$")  # rank, clients, then seconds
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
    marker: tuple[str, str] | None  # ("not run" | "file" | "output", argument) from the line above the fence

    @property
    def runs(self) -> bool:
        return self.language == "console" and (self.marker is None or self.marker[0] == "output")

    @property
    def compared(self) -> bool:
        """Its commands run as written and must print the output it shows."""
        return self.marker is not None and self.marker[0] == "output"


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


def unmeasured(line: str) -> str:
    """An output line without the figures that measure the machine (see :data:`MEASURED`)."""
    if TIME_ROW.match(line):  # its columns widen with a slow machine's seconds (10.21 where the page has 4.10)
        return " ".join(re.sub(r"\d+\.\d+", "#", line).split())
    for figure in MEASURED:
        line = figure.sub("#", line)
    return line.rstrip()


def output_difference(shown: list[str], printed: list[str]) -> str | None:
    """Where ``printed`` differs from the output a page shows (``...``: any lines, none included), measured
    figures aside; ``None`` where it does not."""
    printed = [unmeasured(line) for line in printed]
    at, skipping = 0, False
    for line in shown:
        if line.strip() == "...":
            skipping = True
            continue
        want = unmeasured(line)
        while skipping and at < len(printed) and printed[at] != want:
            at += 1
        if at >= len(printed) or printed[at] != want:
            return f"the page shows {line!r}, the command printed {printed[at] if at < len(printed) else 'no more'!r}"
        at, skipping = at + 1, False
    if not skipping and at < len(printed):
        return f"the command printed {printed[at]!r} after the page's last line"
    return None


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
    return any(b.runs for b in blocks(page.read_text()))


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


def mpifl_arguments(command: str) -> tuple[int, list[str]] | None:
    """(RANKS, ARGS) of a plain ``python -m mpifl ARGS`` (RANKS 0) or ``mpirun -n RANKS [--oversubscribe] python -m
    mpifl ARGS``, or None for a command that needs a shell (an operator, a variable, a substitution, a second line,
    a variable set before it) or other launcher options."""
    if any(char in command for char in "$`\n"):
        return None
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = list(lexer)
    if any(set(word) <= OPERATORS for word in words):
        return None
    ranks = 0
    if words[:1] == ["mpirun"]:
        launcher = words[1:words.index("python")] if "python" in words else []
        options = [word for word in launcher if word != "--oversubscribe"]
        if len(options) != 2 or options[0] != "-n" or not options[1].isdigit():
            return None
        ranks, words = int(options[1]), words[len(launcher) + 1:]
    return (ranks, words[3:]) if words[:3] == ["python", "-m", "mpifl"] else None


def run_command(command: str, root: Path, env: dict[str, str], logs: Path) -> subprocess.CompletedProcess:
    """``command`` in ``root``: ``mpifl.cli.main`` in this process for a plain mpifl command (its output caught in
    ``logs``, outside the copy; a sweep's runs in this process too), in this process's kept launch of as many
    ranks for a plain ``mpirun -n N`` of one (tests/conftest.py's Launch), else bash."""
    launched = mpifl_arguments(command)
    if launched is None:
        return subprocess.run(["bash", "-c", command], cwd=root, env=env, capture_output=True, text=True,
                              timeout=600)
    ranks, args = launched
    if ranks:
        return Launch.run(args, ranks, cwd=root)
    out, err = logs / "command.out", logs / "command.err"
    with output_to(out, err), open(out, "a", buffering=1) as stdout, open(err, "a", buffering=1) as stderr, \
            pytest.MonkeyPatch.context() as patch, sweep_runs_in_this_process():
        patch.chdir(root)
        patch.setattr(sys, "stdout", stdout)  # pytest's capture holds sys.stdout and sys.stderr, not only 1 and 2
        patch.setattr(sys, "stderr", stderr)
        code = run_in_this_process(args, {})
    proc = subprocess.CompletedProcess(command, code, out.read_text(), err.read_text())
    out.unlink()
    err.unlink()
    return proc


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
        if not block.runs:
            continue
        for command in commands(block):
            run = command.text if block.compared else shortened(command.text)
            proc = run_command(run, root, env, tmp_path)
            said = f"$ {run}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
            if len(command.output) == 1 and command.output[0].startswith("mpifl: error:"):
                assert (proc.returncode, proc.stderr) == (2, command.output[0] + "\n"), said
            else:
                assert proc.returncode == 0, said
            if block.compared:
                stale = output_difference(command.output, proc.stdout.splitlines())
                assert stale is None, f"{page.relative_to(REPO)}: stale output: {stale}\n{said}"


def test_every_page_says_who_it_is_for_and_marks_its_commands():
    """Under each docs page's title, one line saying who it is for; shell commands only in console blocks (so
    the test above sees them), each block run or marked with a reason; markers well formed."""
    for page in [*pages(), *sorted(EVIDENCE.glob("*.md"))]:
        text, name = page.read_text(), page.relative_to(REPO)
        lines = [line for line in text.splitlines() if line.strip()]
        if page.parent != REPO:
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


def test_a_stale_figure_in_shown_output_is_caught_and_a_measured_one_is_not():
    """What ``<!-- output: ... -->`` blocks are held to: the first-run page once showed 14.32 MB of physical
    traffic after the code had come to move 10.56 MB; wall and simulated seconds, seconds per round and the
    time-by-rank table's seconds are this machine's."""
    shown = ["results/q.h5: fedavg, completed, 30 rounds on 3 rank(s), wall 3.8 s, simulated 8.1 s",
             "round  5/30 | seen acc 0.1638 | logical 1.25 MB | 0.134 s/round", "...",
             "physical MPI traffic         14.32 MB",
             "      rank  clients  compute     wall",
             "         1       10     3.43     4.21"]
    printed = ["results/q.h5: fedavg, completed, 30 rounds on 3 rank(s), wall 7.1 s, simulated 9.1 s",
               "round  5/30 | seen acc 0.1638 | logical 1.25 MB | 0.286 s/round",
               "round 10/30 | seen acc 0.6039 | logical 2.51 MB | 0.214 s/round",
               "physical MPI traffic         10.56 MB",
               "      rank  clients  compute     wall",
               "         1       10     5.10     6.85"]
    assert output_difference(shown, printed) == ("the page shows 'physical MPI traffic         14.32 MB', the "
                                                 "command printed 'no more'")
    fixed = [line.replace("14.32", "10.56") for line in shown]
    assert output_difference(fixed, printed) is None
    assert output_difference(fixed, [*printed, "one more line"]) == (
        "the command printed 'one more line' after the page's last line")
    assert output_difference(fixed[:2] + fixed[3:], printed) is not None  # without "...", no line is skipped
    assert output_difference(fixed, [line.replace("0.1638", "0.1639") for line in printed]) is not None
    assert output_difference(fixed, [*printed[:-1], "         1       11     5.10     6.85"]) is not None  # clients
    assert output_difference(fixed, [*printed[:-1], "         1       10    15.10     6.85"]) is None  # a slow machine


def test_every_mpirun_a_page_shows_starts_on_two_cores_and_as_root():
    """Issue 45 row 12: a command run as shown on a 2-core machine needs --oversubscribe beyond 2 ranks, and the
    README says the root variables no later than its first mpirun command."""
    short = [f"{page.name}: {line}" for page in pages() for line in page.read_text().splitlines()
             if line.startswith("$ ") and (m := re.search(r"mpirun -n (\d+) ", line)) and int(m.group(1)) > 2
             and "--oversubscribe" not in line]
    assert short == []
    readme = (REPO / "README.md").read_text()
    first = re.search(r"^\$ .*mpirun ", readme, re.M)
    assert first is not None and "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1" in readme[:first.start()]
