"""The ``nodes`` fixture: namespace nodes (tests/multinode/netns.py) shared by a test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.multinode.netns import Nodes, make_nodes


@pytest.fixture(scope="module")
def nodes(tmp_path_factory) -> Iterator[Nodes]:
    """Three namespace nodes for the tests of a module, removed afterwards whatever the tests did."""
    yield from make_nodes(3, tmp_path_factory.mktemp("nodes"))
