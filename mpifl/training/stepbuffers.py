"""The vectorized path's step on fixed storage: buffers reused across steps and rounds, and CUDA graphs of the step
(``client.cuda_graph``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


class StepBuffers:
    """The vectorized path's step tensors (the block's parameters and momentum; each call's sample indices, inputs
    and targets), allocated once per name and shape and reused across steps and rounds: fixed storage, which a
    captured CUDA graph reads and writes, and no allocation per step. A few shapes a name are kept (a full and a
    last partial batch; groups of other sizes), the oldest dropped beyond that."""

    KEPT = 4

    def __init__(self, device: torch.device):
        self.device = device
        self.held: dict[str, dict[tuple, torch.Tensor]] = {}

    def get(self, name: str, shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The buffer ``name`` of ``shape`` and ``dtype`` (its contents are what the last user left)."""
        shapes = self.held.setdefault(name, {})
        key = (tuple(shape), dtype)
        if key not in shapes:
            if len(shapes) == self.KEPT:
                del shapes[next(iter(shapes))]
            shapes[key] = torch.empty(key[0], dtype=dtype, device=self.device)
        return shapes[key]


class StepGraphs:
    """A group's steps as CUDA graphs (``client.cuda_graph``), one per call and batch size: the first such step
    runs eagerly on a side stream (the warm-up capture needs), the second is captured and every one from then on
    is a replay, one launch for the whole step. Graphs live for one group: its block, values and accumulators are
    its own tensors; the inputs are :class:`StepBuffers`, written before each replay."""

    def __init__(self) -> None:
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.warm: set[tuple] = set()
        self.pool = torch.cuda.graph_pool_handle()

    def run(self, key: tuple, step: Callable[[], None]) -> None:
        graph = self.graphs.get(key)
        if graph is None:
            if key not in self.warm:
                self.warm.add(key)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    step()
                torch.cuda.current_stream().wait_stream(side)
                return
            graph = self.graphs[key] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                step()  # recorded, not run: the replay below runs it
        graph.replay()
