"""The pass log's copy staged in a captured forward (`PassLog.stage`, `arm`, `read`).

GPU (marker gpu): an armed read after a replay takes the graph's staged copy and launches none (the device buffer is
poisoned after the staged copy inside the same graph: a read that copied again would see the poison); an eager pass,
a graph that staged nothing and an unarmed read all copy the buffer themselves. CPU: arming and staging leave the
CPU read (always a copy) unchanged, and the runtime arms every pass of a step.
"""

from __future__ import annotations

import pytest
import torch
from test_runtime_fixtures import memory_source, toy_geometry

from tierstore.runtime import RuntimeConfig, TieredRuntime
from tierstore.runtime.passlog import STALE, PassLog

POISON = 12345  # a missing-pairs count no pass of these tests logs

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _pass(log: PassLog, ids: torch.Tensor, stage: bool, poison_after: bool) -> None:
    """One pass over two layers: reset, record, optionally stage, optionally poison the device counts after it."""
    log.reset()
    log.record(0, ids)
    log.record(1, ids + 1)
    if stage:
        log.stage()
    if poison_after:
        log.counts[0] = POISON


def _graph(log: PassLog, ids: torch.Tensor, stage: bool, poison_after: bool) -> torch.cuda.CUDAGraph:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up outside the capture, as callers do
        _pass(log, ids, stage, poison_after)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        _pass(log, ids, stage, poison_after)
    torch.cuda.synchronize()
    return graph


def _log() -> PassLog:
    return PassLog(2, 8, top_k=2, capacity=4, device="cuda")


@pytest.mark.gpu
@needs_cuda
def test_an_armed_read_after_a_replay_takes_the_staged_copy():
    log, ids = _log(), torch.tensor([[1, 4]], device="cuda")
    graph = _graph(log, ids, stage=True, poison_after=True)
    log.arm()
    graph.replay()
    report = log.read()
    assert report.missing_pairs == 0 and report.routed_ids.tolist() == [1, 4, 10, 13]  # the staged bytes, not POISON
    assert int(log.counts[0]) == POISON  # the device buffer itself was poisoned after the staged copy


@pytest.mark.gpu
@needs_cuda
def test_an_unarmed_read_copies_the_buffer_itself():
    log, ids = _log(), torch.tensor([[1, 4]], device="cuda")
    graph = _graph(log, ids, stage=True, poison_after=True)
    graph.replay()
    assert log.read().missing_pairs == POISON  # negative control: the read's own copy sees the poisoned buffer


@pytest.mark.gpu
@needs_cuda
def test_a_graph_that_staged_nothing_leaves_the_stale_mark_and_the_read_copies():
    log, ids = _log(), torch.tensor([[2, 5]], device="cuda")
    graph = _graph(log, ids, stage=False, poison_after=False)
    log.arm()
    graph.replay()
    report = log.read()
    assert report.missing_pairs == 0 and report.routed_ids.tolist() == [2, 5, 11, 14]


@pytest.mark.gpu
@needs_cuda
def test_an_eager_pass_is_copied_by_the_read():
    log, ids = _log(), torch.tensor([[0, 7]], device="cuda")
    _graph(log, ids, stage=True, poison_after=False)  # a graph exists, but this pass runs eagerly
    log.arm()
    _pass(log, torch.tensor([[3, 6]], device="cuda"), stage=True, poison_after=False)  # stage: no-op outside capture
    report = log.read()
    assert report.routed_ids.tolist() == [3, 6, 12, 15]


def test_on_the_cpu_arm_and_stage_leave_the_read_a_copy():
    log = PassLog(2, 8, top_k=2, capacity=4, device="cpu")
    log.arm()
    assert log.host_seen().shape == (2, 8) and log._host_counts[0] == STALE
    _pass(log, torch.tensor([[1, 2]]), stage=True, poison_after=False)
    report = log.read()
    assert report.missing_pairs == 0 and report.routed_ids.tolist() == [1, 2, 10, 11]


def test_the_runtime_arms_every_pass_of_a_step():
    g = toy_geometry()
    runtime = TieredRuntime(g, memory_source(g), pool_slots=g.total_routed_experts, device="cpu",
                            config=RuntimeConfig(kpi_every=0))
    arms = []
    arm = runtime.log.arm
    runtime.log.arm = lambda: (arms.append(1), arm())[1]
    with runtime:
        runtime.preload()

        def forward():
            runtime.log.reset()
            runtime.log.record(0, torch.tensor([[0, 1]]))

        for _ in range(3):
            runtime.step(forward, lambda: None)
    assert len(arms) == 3
