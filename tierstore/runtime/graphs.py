"""CUDA graphs of a step's launches (the forward, and with config pass_pair the pass pair), captured together."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from tierstore.runtime.replay_if import capturing

log = logging.getLogger("tierstore.runtime")


def capture_graphs(launches: Sequence[Callable[[], object]], device: torch.device, what: str,
                   prepare: Callable[[], None] = lambda: None) -> list[tuple[torch.cuda.CUDAGraph, object]] | None:
    """Each launch captured as a CUDA graph, with what it returned, after two eager calls of each on a side stream
    (allocations and kernel compilation outside the captures); `prepare()` runs before every call and capture (e.g.
    a cache's rewind). None, with a warning naming `what`, when a capture fails: the caller runs eagerly."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for launch in launches:
            for _ in range(2):
                prepare()
                launch()
    torch.cuda.current_stream(device).wait_stream(side)
    captured = []
    for launch in launches:
        graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
        prepare()
        try:
            with capturing(pool), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                out = launch()
        except RuntimeError as exc:
            log.warning("CUDA graph capture of %s failed, running eagerly: %s", what, exc)
            return None
        captured.append((graph, out))
    return captured
