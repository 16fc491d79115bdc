"""Rank 0's tables in memory, as rows arrive: the rounds and evaluations of a run before each write appends them."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Table:
    """Append-only columns of numbers; a row may add a column that earlier rows lack (NaN-filled)."""

    columns: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    length: int = 0

    def append(self, row: dict[str, float]) -> None:
        for key in row:
            if key not in self.columns:
                self.columns[key] = [np.nan] * self.length
        for key, values in self.columns.items():
            values.append(row.get(key, np.nan))
        self.length += 1

    def since(self, start: int) -> dict[str, np.ndarray]:
        """The rows from ``start`` on (what a write appends), without converting the older ones."""
        return {k: np.asarray(v[start:]) for k, v in self.columns.items()}

    def extend(self, columns: dict[str, np.ndarray]) -> None:
        """Append the rows of a table read back from a results file."""
        rows = len(next(iter(columns.values()))) if columns else 0
        for i in range(rows):
            self.append({k: v[i].item() for k, v in columns.items()})


def flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as one level of dotted keys (``{"client": {"lr": 0.1}}`` → ``{"client.lr": 0.1}``)."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out
