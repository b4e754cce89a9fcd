"""Per-layer copy waits (config `layer_waits`, CUDA): a replay launched while a fetch's rows are still
on the bus must read each layer only after that layer's rows landed, eager and inside a CUDA graph.

The rows of every install are held back on the copy stream by a sleep placed after the table copy and
before the rows (the window in which a reader that does not wait sees the new mapping over stale
bytes). With the waits, every step equals the all-resident run bit for bit; the negative control
(the waits switched off, the whole-install wait too) must differ, so the test can fail.
With two copy streams (config copy_streams 2) the same holds. The CPU part checks the knobs and that a CPU
pool has nothing to wait on."""

from __future__ import annotations

import pytest
import torch
from test_runtime_fixtures import ToyMoE, cuda_toy_model, graph_replayer, memory_source, on_copy_stream, toy_geometry

from tierstore.errors import ConfigError
from tierstore.runtime import RuntimeConfig, TieredRuntime
from tierstore.runtime.pools import DevicePool
from tierstore.runtime.step import ReplayLimitError

STEPS = 12
HOLD_CYCLES = 20_000_000  # ~10 ms at the H200's clock: far longer than a toy forward


def test_layer_waits_is_a_config_knob_on_by_default():
    assert RuntimeConfig().layer_waits is True
    assert RuntimeConfig.from_env({"TIERSTORE_LAYER_WAITS": "0"}).layer_waits is False
    assert RuntimeConfig().copy_streams == 1 and RuntimeConfig.from_env({"TIERSTORE_COPY_STREAMS": "2"}).copy_streams == 2
    with pytest.raises(ConfigError, match="copy_streams must be 1 or 2, got 3"):
        RuntimeConfig(copy_streams=3)


def test_a_cpu_pool_has_no_layer_events():
    g = toy_geometry()
    rt = TieredRuntime(g, memory_source(g), pool_slots=g.total_routed_experts, device="cpu",
                       config=RuntimeConfig(kpi_every=0))
    with rt:
        assert not rt.pool.layer_waits
        rt.pool.wait_layer(0)  # nothing to wait on: returns at once


def _runtime(g, fraction, layer_waits, copy_streams=1, arena_slots=16):
    """arena_slots "all": an arena preloaded with every row, so the step's fetches go by located rows (streaming off:
    these steps miss and replay)."""
    every = [(layer, expert) for layer in range(g.num_moe_layers) for expert in range(g.num_experts)]
    rt = TieredRuntime(g, memory_source(g, 0), pool_slots=round(fraction * g.total_routed_experts),
                       arena_slots=len(every) if arena_slots == "all" else arena_slots, device="cuda", backend="triton",
                       config=RuntimeConfig(kpi_every=0, layer_waits=layer_waits, copy_streams=copy_streams,
                                            stream_arena=False))
    if arena_slots == "all":
        rt.arena.fetch(every, scan=True)
    return rt


def _hold_rows(pool: DevicePool) -> None:
    """Delay every install's row copies (not its table copy) by a device sleep on the copy stream."""
    issue = pool._issue

    def held(runs, stream):
        with on_copy_stream(stream):  # the pool's copy stream
            torch.cuda._sleep(HOLD_CYCLES)
        issue(runs, stream)

    pool._issue = held


def _steps(small: TieredRuntime, model: ToyMoE, g, graph: bool) -> list[torch.Tensor]:
    x = torch.zeros(1, g.hidden, device="cuda")
    forward = lambda: model.forward(small, x)  # noqa: E731
    if graph:
        forward = graph_replayer(forward)
    outputs = []
    for step in range(STEPS):
        x.copy_(torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(step)).cuda())
        got, _ = small.step(forward, lambda: None)
        outputs.append(got.clone())
    return outputs


def _resident_outputs(g, model) -> list[torch.Tensor]:
    with _runtime(g, 1.0, True) as resident:
        resident.preload()
        return _steps(resident, model, g, graph=False)


@pytest.fixture
def case():
    g, model = cuda_toy_model()
    return g, model, _resident_outputs(g, model)


@pytest.mark.gpu
@pytest.mark.parametrize("copy_streams,arena", [(1, 16), (2, 16), (1, "all")])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_replay_with_rows_held_back_equals_the_resident_run(case, graph, copy_streams, arena):
    g, model, want = case
    with _runtime(g, 0.25, True, copy_streams, arena) as small:
        _hold_rows(small.pool)
        got = _steps(small, model, g, graph)
        assert small.stats().replayed_steps > 0
        small.pool.check_coherent()
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step} differs from the all-resident run"


@pytest.mark.gpu
@pytest.mark.parametrize("arena", [16, "all"])
def test_negative_control_without_any_wait_reads_stale_rows(case, arena):
    g, model, want = case
    with _runtime(g, 0.25, True, arena_slots=arena) as small:
        _hold_rows(small.pool)
        small.pool.wait_layer = lambda layer: None  # with layer_waits nothing else makes the compute stream wait
        try:
            got = _steps(small, model, g, graph=True)
            stale = any(not torch.equal(a, b) for a, b in zip(got, want))
        except ReplayLimitError:  # replays read a table whose copy had not landed yet: they kept missing
            stale = True
        torch.cuda.synchronize()
    assert stale, "no step read a stale row or table: the test cannot fail"
