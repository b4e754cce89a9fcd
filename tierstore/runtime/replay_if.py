"""A pass pair's replay run only when its first pass missed (config `pass_pair_replay_segment`).

Captured in a CUDA graph, the replay is cut into segments of `segment` MoE layers, each a conditional (IF) node
of the graph whose predicate the device computes after the first pass: whether it missed anything. A pair whose
first pass missed nothing then costs that pass, its plans and the segments' empty conditionals, not a second pass.

Why segments and not one IF node: a node inside a conditional body can depend on nothing outside it, and the
replay's layer `l` has to wait for the rows the first pass copied for `l` on the side stream. Each segment's IF
node therefore depends on the copies of the segment's last layer (the copies run in layer order on one stream, so
that covers every layer of the segment), recorded outside it; the replay of a segment starts when they have landed
rather than layer by layer. Longer segments cost fewer conditional nodes and wait longer for copies.

Eager (not captured), the same decision is made on the host: on a CPU by reading the count, on CUDA after a sync.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def conditional_capture_available() -> bool:
    """Whether this torch can capture IF nodes into a CUDA graph (`CUDAGraph.begin_capture_to_if_node`)."""
    graph = getattr(torch.cuda, "CUDAGraph", None)
    return all(hasattr(graph, name) for name in ("get_currently_capturing_graph", "begin_capture_to_if_node",
                                                  "end_capture_to_conditional_node"))


def copy_into(first, second):
    """The replay's result written over the first pass's (tensors, or tuples / lists of them), so a graph's output
    is the same tensors whether or not its replay ran; returns `first`."""
    if isinstance(first, torch.Tensor):
        if first.data_ptr() != second.data_ptr():
            first.copy_(second)
    elif isinstance(first, (tuple, list)):
        if len(first) != len(second):
            raise ValueError(f"the replay returned {len(second)} values, the first pass {len(first)}")
        for a, b in zip(first, second):
            copy_into(a, b)
    elif first is not None or second is not None:
        raise TypeError(f"a pass pair's skippable replay returns tensors or tuples of them, not {type(first)}")
    return first


class ConditionalReplay:
    """The segments of one replay being captured: `open()` before the replay (after the first pass and its plans),
    `layer(l)` before each of its MoE layers' experts, `close()` after it. `wait_copies(l)` makes the current stream
    wait for the rows copied for layers up to `l`; `missed` is the device's int32 count of the first pass's
    missing pairs ([1]), read before the replay's pass-log reset."""

    def __init__(self, missed: torch.Tensor, num_layers: int, segment: int, wait_copies: Callable[[int], None]):
        self.num_layers, self.segment, self.wait_copies = num_layers, segment, wait_copies
        self.predicate = torch.gt(missed[0], 0)  # [] bool, on the device, computed in the graph
        self._graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()
        self._open = False

    def _begin(self, first_layer: int) -> None:
        self.wait_copies(min(first_layer + self.segment, self.num_layers) - 1)
        self._graph.begin_capture_to_if_node(self.predicate)
        self._open = True

    def open(self) -> None:
        self._begin(0)

    def layer(self, layer: int) -> None:
        if layer and layer % self.segment == 0:
            self._end()
            self._begin(layer)

    def _end(self) -> None:
        if self._open:
            self._graph.end_capture_to_conditional_node()
            self._open = False

    def close(self) -> None:
        """End the last segment (also after a failure inside one, so the capture can end)."""
        self._end()
