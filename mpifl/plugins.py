"""Plug-ins: algorithms, models and datasets from the user's own package, so nobody has to fork mpifl.

A config names a plug-in in one of two ways:

* an installed entry point, by its name: ``algorithm: damped_fedavg`` finds the entry point
  ``damped_fedavg`` in the group ``mpifl.algorithms`` (likewise ``mpifl.models``, ``mpifl.datasets``);
* a ``module:attribute`` path, importable on every rank: ``model: {name: "mypkg.nets:build"}``.

Built-in names come first (a plug-in cannot replace one). Only the named plug-in is imported; other
installed ones are known by their metadata alone. What a plug-in must be is checked by its caller
(the algorithm registry, the model builder, the pooled-data loader), which knows the contract.
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from mpifl.schema import ConfigError

_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


@dataclass(frozen=True)
class Kind:
    """One kind of plug-in: its entry-point group, the config key that names it, and what to call it."""

    group: str
    key: str
    noun: str


ALGORITHMS = Kind("mpifl.algorithms", "algorithm", "algorithm")
MODELS = Kind("mpifl.models", "model.name", "model")
DATASETS = Kind("mpifl.datasets", "data.dataset", "dataset")


def installed(kind: Kind) -> list[str]:
    """Names of the installed entry points of ``kind`` (package metadata only: nothing is imported)."""
    return sorted({ep.name for ep in entry_points(group=kind.group)})


@cache
def resolve(kind: Kind, name: str, builtins: tuple[str, ...]) -> Any:
    """The object a plug-in name stands for (``name`` is not one of ``builtins``), imported once per process."""
    if ":" in name:
        if not _PATH.fullmatch(name):
            raise ConfigError(f"{kind.key}: {name!r} is not a 'module:callable' path (e.g. 'mypkg.module:build')")
        return _import(kind, name, name)
    found = [ep for ep in entry_points(group=kind.group) if ep.name == name]
    if not found:
        raise ConfigError(_unknown(kind, name, builtins))
    entry: EntryPoint = found[0]
    return _import(kind, name, f"{entry.module}:{entry.attr}" if entry.attr else entry.module)


def _import(kind: Kind, name: str, path: str) -> Any:
    """``module:attribute`` imported; any failure (the plug-in's own imports too) is a config error naming it."""
    module_name, _, attribute = path.partition(":")
    where = f"{kind.key}: {kind.noun} plug-in {name!r}" + (f" ({path})" if path != name else "")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - a broken plug-in may raise anything while importing
        missing = isinstance(exc, ModuleNotFoundError) and module_name.split(".")[0] == (exc.name or "").split(".")[0]
        hint = ("; every rank imports it: install it, or put its folder on PYTHONPATH, which mpirun passes on with "
                "'mpirun -x PYTHONPATH ...' (Open MPI; MPICH's mpiexec and srun pass the environment)"
                if missing else "")
        raise ConfigError(f"{where}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}{hint}") from None
    for part in attribute.split(".") if attribute else ():
        if not hasattr(obj, part):
            raise ConfigError(f"{where}: module {module_name!r} has no attribute {attribute!r}")
        obj = getattr(obj, part)
    return obj


def _unknown(kind: Kind, name: str, builtins: Sequence[str]) -> str:
    plugins = installed(kind)
    close = difflib.get_close_matches(name, [*builtins, *plugins], n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return (f"{kind.key}: unknown {kind.noun} {name!r}{hint}; built-in: {', '.join(builtins)}; installed plug-ins: "
            f"{', '.join(plugins) or 'none'}; add your own as an entry point in group {kind.group!r} or name it "
            "as 'module:callable' (docs/tutorials/own-algorithm.md)")


def require_callable(kind: Kind, name: str, obj: Any, contract: str) -> Any:
    """``obj`` if it can be called, else a config error saying what the plug-in must be."""
    if not callable(obj):
        raise ConfigError(f"{kind.key}: {kind.noun} plug-in {name!r} must be {contract}, got {type(obj).__name__}")
    return obj
