"""A pass pair's replay run only when its first pass missed (config `pass_pair_replay_segment`).

Captured in a CUDA graph, the replay is cut into segments of `segment` MoE layers, each a conditional (IF) node
of the graph whose predicate the device computes after the first pass: whether it missed anything. A pair whose
first pass missed nothing then costs that pass, its plans and the segments' empty conditionals, not a second pass.

Why segments and not one IF node: a node inside a conditional body can depend on nothing outside it, and the
replay's layer `l` has to wait for the rows the first pass copied for `l`. Each segment's IF node therefore depends
on the copies of every layer of the segment, made outside it; the replay of a segment starts when they have all
landed rather than layer by layer. Longer segments cost fewer conditional nodes and wait longer for copies.

Eager (not captured), the same decision is made on the host: on a CPU by reading the count, on CUDA after a sync.
Where torch cannot capture IF nodes (before 2.12; the H200's torch is 2.11), the CUDA runtime makes them
(`kernels/cuda/graph_if.cu`) in captures made through `capturing`, as `tierstore generate` and the replay benchmark
make theirs.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger("tierstore.runtime")

_capturing: list[tuple] = []  # the memory pools of the captures this library makes (`capturing`), innermost last


@contextmanager
def capturing(pool: tuple):
    """Around a capture into memory pool `pool` (`torch.cuda.graph(graph, pool=pool)`, from
    `torch.cuda.graph_pool_handle()`; `runtime.graphs.capture_graphs`): lets a pass pair captured in it route its
    conditional bodies' allocations there where torch does not capture IF nodes (its `CUDAGraph.pool()` answers
    only after the capture)."""
    _capturing.append(pool)
    try:
        yield pool
    finally:
        _capturing.pop()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _torch_if_nodes() -> bool:
    graph = getattr(torch.cuda, "CUDAGraph", None)
    return all(hasattr(graph, name) for name in ("get_currently_capturing_graph", "begin_capture_to_if_node",
                                                  "end_capture_to_conditional_node"))


def _thread_pool_routing() -> bool:
    return all(hasattr(torch._C, name) for name in ("_cuda_beginAllocateCurrentThreadToPool",
                                                    "_cuda_endAllocateToPool", "_cuda_releasePool"))


# device index -> (the stream IF-node bodies capture on, None with torch's IF nodes; the stream the MoE layers' side
# work forks to inside them), made before any capture
_body_streams: dict[int, tuple[torch.cuda.Stream | None, torch.cuda.Stream]] = {}


def _new_stream(lib: ctypes.CDLL, index: int) -> torch.cuda.ExternalStream:
    handle = ctypes.c_void_p()
    with torch.cuda.device(index):
        error = lib.tierstore_new_stream(ctypes.byref(handle))
    if error:
        raise RuntimeError(f"cudaStreamCreateWithFlags failed (cudaError {error})")
    return torch.cuda.ExternalStream(handle.value, device=torch.device("cuda", index))


def prepare_if_nodes(device: torch.device) -> bool:
    """Before any capture on `device`: the streams a pair's conditional replay captures on (a stream that joined
    the capture outside a body, as the MoE layers' side stream does in the first pass, cannot join a body's), and
    where torch cannot capture IF nodes, the CUDA runtime's (`kernels/cuda/graph_if.cu`) built and loaded. False,
    logged, when that cannot be done (no nvcc, no thread routing of allocations in this torch)."""
    index = _index(device)
    if index in _body_streams:
        return True
    if _torch_if_nodes():
        _body_streams[index] = (None, torch.cuda.Stream(device))
        return True
    if not _thread_pool_routing():
        log.info("conditional graph nodes unavailable: this torch neither captures them nor routes a thread's "
                 "allocations to a pool")
        return False
    try:
        lib = _graph_if_library()
        error = lib.tierstore_load_if()
        if error:
            raise RuntimeError(f"the conditional kernel did not load (cudaError {error})")
        _body_streams[index] = (_new_stream(lib, index), _new_stream(lib, index))
    except (RuntimeError, OSError) as error:  # no nvcc, or a library that does not load
        log.info("conditional graph nodes by the CUDA runtime unavailable: %s", error)
        return False
    return True


def body_side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream side work inside a conditional body forks to (after `prepare_if_nodes`)."""
    return _body_streams[_index(device)][1]


def conditional_capture_available(device: torch.device) -> bool:
    """Whether a pass pair captured now on `device` can put its replay in IF nodes: torch captures them
    (`CUDAGraph.begin_capture_to_if_node`, torch 2.12+), or, in a capture this library makes (`capturing`), the
    CUDA runtime does once `prepare_if_nodes` made them ready (torch routing the bodies' allocations to the
    graph's pool)."""
    if _index(device) not in _body_streams:
        return False
    return _torch_if_nodes() or bool(_capturing)


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
    wait for the rows copied for layer `l`; `missed` is the device's int32 count of the first pass's missing pairs
    ([1]), read before the replay's pass-log reset."""

    def __init__(self, missed: torch.Tensor, num_layers: int, segment: int, wait_copies: Callable[[int], None]):
        self.num_layers, self.segment, self.wait_copies = num_layers, segment, wait_copies
        self.predicate = torch.gt(missed[0], 0)  # [] bool, on the device, computed in the graph
        self._nodes = _TorchIfNodes() if _torch_if_nodes() else _RuntimeIfNodes(_capturing[-1], missed.device)
        self._open = False

    def _begin(self, first_layer: int) -> None:
        for layer in range(first_layer, min(first_layer + self.segment, self.num_layers)):  # each layer's rows
            self.wait_copies(layer)
        self._nodes.begin(self.predicate)
        self._open = True

    def open(self) -> None:
        self._begin(0)

    def layer(self, layer: int) -> None:
        if layer and layer % self.segment == 0:
            self._end()
            self._begin(layer)

    def _end(self) -> None:
        if self._open:
            self._open = False
            self._nodes.end()

    def close(self) -> None:
        """End the last segment (also after a failure inside one, so the capture can end)."""
        self._end()


class _TorchIfNodes:
    """IF nodes by torch's own capture of them."""

    def __init__(self) -> None:
        self._graph = torch.cuda.CUDAGraph.get_currently_capturing_graph()

    def begin(self, predicate: torch.Tensor) -> None:
        self._graph.begin_capture_to_if_node(predicate)

    def end(self) -> None:
        self._graph.end_capture_to_conditional_node()


@cache
def _graph_if_library() -> ctypes.CDLL:
    from tierstore.kernels.cuda import loader

    lib = loader.build_library(Path(loader.__file__).with_name("graph_if.cu"))
    for name, args in (("tierstore_begin_if", [ctypes.c_void_p] * 3), ("tierstore_end_if", [ctypes.c_void_p]),
                       ("tierstore_new_stream", [ctypes.c_void_p]), ("tierstore_load_if", [])):
        getattr(lib, name).argtypes, getattr(lib, name).restype = args, ctypes.c_int
    return lib


class _RuntimeIfNodes:
    """IF nodes by the CUDA runtime (`kernels/cuda/graph_if.cu`) for a torch that does not capture them: each body
    is captured on a stream of its own, this thread's allocations routed meanwhile to the graph's memory pool (the
    capture's own routing, by its capture id, does not cover another capture's stream), and after it for the rest
    of the capture."""

    def __init__(self, pool: tuple, device: torch.device):
        self._lib, self._pool = _graph_if_library(), pool
        self._device = _index(device)
        self._body = _body_streams[self._device][0]
        self._in_body = None

    def _route(self) -> None:
        """This thread's allocations to the pool, in place of the routing before (one routing per pool; the begin
        takes a reference on the pool, which the capture already holds: given back at once)."""
        torch._C._cuda_endAllocateToPool(self._device, self._pool)
        torch._C._cuda_beginAllocateCurrentThreadToPool(self._device, self._pool)
        torch._C._cuda_releasePool(self._device, self._pool)

    def begin(self, predicate: torch.Tensor) -> None:
        parent = torch.cuda.current_stream(self._device)
        error = self._lib.tierstore_begin_if(parent.cuda_stream, predicate.data_ptr(), self._body.cuda_stream)
        if error:
            raise RuntimeError(f"a conditional graph node could not be captured (cudaError {error})")
        self._route()
        self._in_body = torch.cuda.stream(self._body)
        self._in_body.__enter__()

    def end(self) -> None:
        self._in_body.__exit__(None, None, None)
        self._in_body = None
        error = self._lib.tierstore_end_if(self._body.cuda_stream)
        self._route()
        if error:
            raise RuntimeError(f"a conditional graph node's body could not be ended (cudaError {error})")
