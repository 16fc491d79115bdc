"""The size limits the code keeps (issue 58): no function over 50 lines, the Engine within 200, each module of the
exact-sum package within 400; and the import-linter setting that makes ``lint-imports`` refuse an import circle of
type-only imports too. Read from the source alone (``ast``), nothing imported."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.conftest import REPO

PACKAGE = REPO / "mpifl"

FUNCTION_LINES = 50
"""The most lines a function (or method) may have, counted from its ``def`` line to its last line: docstring,
comments and blank lines inside it included, decorators not (a nested function counts within its outer one, and
on its own)."""

MODULE_LINES = {"mpifl/runtime/engine.py": 200}
"""Modules with a limit of their own, in lines: the Engine decides what happens when, and nothing else."""

PACKAGE_MODULE_LINES = {"mpifl/comm/exactsum": 400}
"""Packages none of whose modules may be longer (lines); checked once the package exists."""


def modules(folder: Path = PACKAGE) -> list[Path]:
    return sorted(folder.rglob("*.py"))


def long_functions(path: Path, limit: int = FUNCTION_LINES, root: Path = REPO) -> list[str]:
    """``FILE:LINE QUALNAME: N lines`` (``FILE`` relative to ``root``) of each function in ``path`` longer than
    ``limit`` lines."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}."
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = child.end_lineno - child.lineno + 1  # lineno: the def line, after any decorator
                if lines > limit:
                    found.append(f"{path.relative_to(root)}:{child.lineno} {name[:-1]}: {lines} lines")
            visit(child, name)

    visit(ast.parse(path.read_text(), str(path)), "")
    return found


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_function_is_longer_than_50_lines():
    found = [line for path in modules() for line in long_functions(path)]
    assert not found, f"split into parts that read as its phases (at most {FUNCTION_LINES} lines each):\n" + \
        "\n".join(found)


def test_the_function_limit_counts_from_the_def_and_sees_methods_and_nested_functions(tmp_path):
    lines = [f"x{i} = {i}" for i in range(49)]
    source = ["class A:", "    @staticmethod", "    def fits():", *(" " * 8 + line for line in lines),  # 50 lines
              "def outer():", "    def inner():", *(" " * 8 + line for line in lines), "        y = 1",  # 51
              "    return inner"]  # 53
    (tmp_path / "sample.py").write_text("\n".join(source) + "\n")
    assert long_functions(tmp_path / "sample.py", 50, tmp_path) == ["sample.py:53 outer: 53 lines",
                                                                      "sample.py:54 outer.inner: 51 lines"]


def test_modules_with_a_limit_of_their_own_keep_it():
    over = {name: n for name, limit in MODULE_LINES.items() if (n := line_count(REPO / name)) > limit}
    assert not over, f"over their limit (lines): {over}; move what belongs elsewhere rather than squeeze lines"


def test_no_module_of_the_exact_sum_package_is_longer_than_400_lines():
    for folder, limit in PACKAGE_MODULE_LINES.items():
        if not (REPO / folder).is_dir():  # still one module (mpifl/comm/exactsum.py): nothing to check yet
            continue
        over = {str(p.relative_to(REPO)): n for p in modules(REPO / folder) if (n := line_count(p)) > limit}
        assert not over, f"over {limit} lines: {over}"


def test_lint_imports_refuses_import_circles_of_type_only_imports_too():
    """``lint-imports`` (scripts/test.sh) holds the import rules; its ``acyclic_siblings`` contract sees an import
    made only under ``if TYPE_CHECKING:`` only while ``exclude_type_checking_imports`` is false."""
    config = (REPO / "pyproject.toml").read_text()
    settings = config.split("[tool.importlinter]", 1)[1].split("[[tool.importlinter.contracts]]", 1)[0]
    assert re.search(r"^exclude_type_checking_imports\s*=\s*false\s*$", settings, re.M), \
        "pyproject.toml [tool.importlinter]: keep exclude_type_checking_imports = false"
    assert re.search(r'type\s*=\s*"acyclic_siblings"\s*\nancestors\s*=\s*\["mpifl"\]', config), \
        "pyproject.toml: the acyclic_siblings contract over mpifl is gone"
