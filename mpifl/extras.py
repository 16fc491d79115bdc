"""Optional dependencies (the package's extras): imported when a feature needs them, else one line that says
which extra to install."""

from __future__ import annotations

from typing import Any

from mpifl.schema import ConfigError


class MissingExtra(ConfigError, ImportError):
    """An optional dependency is not installed: one line that names the extra to install (the CLI exits
    with code 2; code that imports mpifl sees an ImportError)."""


def optional_import(module: str, extra: str, purpose: str) -> Any:
    """``module``, imported, or :class:`MissingExtra` saying how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtra(f"{purpose} needs {exc.name or module}: pip install 'mpifl[{extra}]'") from None
