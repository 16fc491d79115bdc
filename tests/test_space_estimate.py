"""The estimate of what a run writes (mpifl/runtime/footprint.py), which ``run`` compares with the free space before
round 1, against the real files of finished runs of different shapes: within 25% (benchmarks/space_estimate.py
measures every algorithm and a longer run; docs/reference/results.md#space-before-round-1 gives the numbers)."""

from __future__ import annotations

import pytest

from benchmarks.space_estimate import SHAPES, measure


@pytest.mark.parametrize("shape", ["eval_every_10", "keep_4", "scaffold_keep_3"])
def test_the_estimate_is_within_a_quarter_of_the_real_files(shape, tmp_path):
    """Evaluated every round or every 10th, 1 to 4 checkpoints kept, with and without client state."""
    assert abs(measure(shape, SHAPES[shape], tmp_path)) <= 0.25
