"""Typed, frozen config sections built from plain mappings.

Each config section is a frozen dataclass. ``build`` turns a YAML mapping into
it, rejecting unknown keys (with a did-you-mean), wrong types and values out of
range with one :class:`ConfigError` that names the dotted path. Range limits
live next to the field as ``field(metadata=limits(...))`` so the schema and its
checks cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from typing import Any, Literal, Union

_LINE_BREAK = re.compile(r"\s*\n\s*")
SYNONYMS = {
    "learning_rate": "lr", "step_size": "lr", "local_lr": "lr", "server_lr": "lr", "local_epochs": "epochs",
    "num_epochs": "epochs", "local_steps": "steps", "num_steps": "steps", "batchsize": "batch_size", "bs": "batch_size",
    "num_rounds": "rounds", "communication_rounds": "rounds", "total_rounds": "rounds",
    "clients_per_rounds": "clients_per_round", "num_clients_per_round": "clients_per_round",
    "cohort_size": "clients_per_round", "participants_per_round": "clients_per_round", "random_seed": "seed",
    "n_clients": "num_clients", "clients": "num_clients", "total_clients": "num_clients", "wd": "weight_decay",
    "model_name": "name", "arch": "name", "architecture": "name", "name_of_dataset": "dataset",
    "dataset_name": "dataset", "out": "output", "output_file": "output", "results": "output",
}
"""Other frameworks' names for common keys, each suggested for the key mpifl calls it, where that key is one of the
section's (``client.learning_rate`` -> ``lr``): close spelling alone would miss them."""

INT64_MAX = 2**63 - 1
"""Every integer of a config ends up in int64 storage (numpy arrays, HDF5 attributes, seeds mixed into 64-bit
keys), so none may lie beyond it; a field whose storage is smaller says so with its own ``limits``."""
INT32_MAX = 2**31 - 1
_YAML11_EXPONENT = re.compile(r"[-+]?[0-9]+(\.[0-9]*)?[eE][-+]?[0-9]+")


def physical_memory() -> int:
    """This machine's RAM in bytes (every rank on a node shares it; a bound, not what is free now): what a config
    that would allocate more is refused against, before anything is allocated."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:,.1f} GB"


class ConfigError(ValueError):
    """A user-facing configuration problem; the CLI exits with code 2.

    The message is folded onto one line: it often embeds a library's own error
    text (pickle, JSON, HDF5), and the CLI promises exactly one line per error.
    """

    def __init__(self, message: str) -> None:
        super().__init__(_LINE_BREAK.sub(" ", str(message)))


def limits(
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> dict[str, float | None]:
    """Field metadata for numeric bounds (``field(default=..., metadata=limits(ge=0))``)."""
    return {"ge": ge, "gt": gt, "le": le, "lt": lt}


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return _convert_union(value, args, path)
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(repr(a) for a in args)}{hint}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        return tuple(_convert(v, inner, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return build(tp, value, path)
    if tp is Any:
        return value
    if tp not in _SCALARS:
        raise TypeError(f"unsupported schema type {tp!r} at {path}")
    return _SCALARS[tp](value, path)


def _convert_union(value: Any, args: tuple[Any, ...], path: str) -> Any:
    """The first of ``args`` that takes ``value`` (``None`` for an optional field)."""
    if value is None and type(None) in args:
        return None
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return _convert(value, arg, path)
        except ConfigError as exc:
            if arg in _SCALARS and type(value) is arg:  # the value's own type refused it: that is the reason
                raise
            errors.append(str(exc))
    expected = " or ".join(_type_name(a) for a in args if a is not type(None))
    raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: expected {expected}, got {value!r}")


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    return value


def _int(value: Any, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if not -INT64_MAX - 1 <= value <= INT64_MAX:
        raise ConfigError(f"{path}: {value} does not fit in a 64-bit integer ({-INT64_MAX - 1} to {INT64_MAX})")
    return value


def _float(value: Any, path: str) -> float:
    if isinstance(value, str) and _YAML11_EXPONENT.fullmatch(value.strip()):
        value = float(value)  # YAML 1.1 reads "1e-4" (no dot) as a string; every user means a number
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if value != value or value in (float("inf"), float("-inf")):
        raise ConfigError(f"{path}: expected a finite number, got {value!r}")
    return float(value)


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    return value


_SCALARS: dict[Any, typing.Callable[[Any, str], Any]] = {bool: _bool, int: _int, float: _float, str: _str}
"""How each scalar type of a config field is checked and converted."""


def _check_limits(value: Any, meta: typing.Mapping[str, Any], path: str) -> None:
    if value is None:
        return
    values = value if isinstance(value, tuple) else (value,)
    for v in values:
        if not isinstance(v, (int, float)):
            continue
        if meta.get("ge") is not None and not v >= meta["ge"]:
            raise ConfigError(f"{path}: must be >= {meta['ge']}, got {v!r}")
        if meta.get("gt") is not None and not v > meta["gt"]:
            raise ConfigError(f"{path}: must be > {meta['gt']}, got {v!r}")
        if meta.get("le") is not None and not v <= meta["le"]:
            raise ConfigError(f"{path}: must be <= {meta['le']}, got {v!r}")
        if meta.get("lt") is not None and not v < meta["lt"]:
            raise ConfigError(f"{path}: must be < {meta['lt']}, got {v!r}")


def build(cls: type, mapping: Any, path: str = "") -> Any:
    """Build dataclass ``cls`` from ``mapping``, validating every key under ``path``."""
    where = path or "config"
    if mapping is None:
        mapping = {}
    if not isinstance(mapping, dict):
        raise ConfigError(f"{where}: expected a mapping, got {mapping!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    for key in mapping:
        if key not in fields:
            close = [SYNONYMS[key]] if SYNONYMS.get(key) in fields else difflib.get_close_matches(str(key),
                                                                                                  list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: unknown key {key!r}{hint}")
    kwargs = {}
    for name, f in fields.items():
        sub = f"{path}.{name}" if path else name
        if name in mapping:
            value = _convert(mapping[name], hints[name], sub)
            _check_limits(value, f.metadata, sub)
            kwargs[name] = value
    return cls(**kwargs)


def to_dict(obj: Any) -> Any:
    """Plain-Python (YAML-ready) view of a built config."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj
