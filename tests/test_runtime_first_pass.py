"""A decode step's first pass without the pool's per-layer waits (config `unwaited_first_pass`).

The caller gives the step `runtime.first_pass(forward)` (captured as its own graph on CUDA) as `forward_first`: the
first pass of a decode step runs it, replays run `forward`, which waits per layer for a fetch's rows. Before the
unwaited launch the compute stream waits once for any install still in flight. CPU: which launch runs when, the
replay count, prefill, refusals, every step equal to the all-resident run. GPU: rows held back on the copy stream
behind a device sleep after the install's table copy, installed by a fetch right before each step, so its first pass
maps them while they may still be on the bus; with the wait before the launch every step equals the all-resident run
bit for bit, and the negative control (that wait removed) differs, so the test can fail."""

from __future__ import annotations

import pytest
import torch
from test_runtime_fixtures import ToyMoE, arena_runtime, cuda_toy_model, graph_replayer, on_copy_stream, toy_geometry

from tierstore.errors import ConfigError
from tierstore.runtime import RuntimeConfig, TieredRuntime
from tierstore.runtime.step import ReplayLimitError

STEPS = 12
HOLD_CYCLES = 20_000_000  # ~10 ms at the H200's clock: far longer than a toy forward


def _runtime(g, fraction: float, device: str = "cpu", **config) -> TieredRuntime:
    """A pool of `fraction` of the experts over an arena holding every row (streaming off unless asked: these
    passes miss)."""
    return arena_runtime(g, round(fraction * g.total_routed_experts), "all", device=device,
                         backend="triton" if device == "cuda" else "auto", **{"stream_arena": False, **config})[0]


def _inputs(g, step: int, device: str) -> torch.Tensor:
    return torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(step)).to(device) * 3  # [1, H]


def _resident(g, model, device: str) -> tuple[list[torch.Tensor], list[list]]:
    """The all-resident run: each step's output and routed keys."""
    outputs, routed = [], []
    with _runtime(g, 1.0, device, full_pool_reads=True) as rt:
        rt.preload()
        x = torch.zeros(1, g.hidden, device=device)
        for step in range(STEPS):
            x.copy_(_inputs(g, step, device))
            got, outcome = rt.step(lambda: model.forward(rt, x), lambda: None)
            outputs.append(got.clone())
            routed.append(sorted(outcome.last_pass.routed_keys))
    return outputs, routed


def test_the_knob_is_on_by_default_and_read_from_the_environment():
    assert RuntimeConfig().unwaited_first_pass is True
    assert RuntimeConfig.from_env({"TIERSTORE_UNWAITED_FIRST_PASS": "0"}).unwaited_first_pass is False


@pytest.mark.parametrize("fraction,config,why", [(0.25, {"unwaited_first_pass": False}, "unwaited_first_pass is off"),
                                                 (1.0, {}, "holds every expert"),
                                                 (0.25, {"early_fetch": True}, "early_fetch")])
def test_a_runtime_without_first_passes_refuses_to_make_one(fraction, config, why):
    g = toy_geometry()
    with _runtime(g, fraction, **config) as rt:
        assert not rt.first_passes
        with pytest.raises(ConfigError, match=why):
            rt.first_pass(lambda: None)


def test_the_first_pass_runs_forward_first_and_replays_run_forward():
    g = toy_geometry()
    model = ToyMoE(g)
    want, _ = _resident(g, model, "cpu")
    with _runtime(g, 0.25) as rt:
        assert rt.first_passes
        x = torch.zeros(1, g.hidden)
        launches = []

        def forward():
            launches.append("forward")
            return model.forward(rt, x)

        def opening():
            launches.append("first")
            assert rt.pool._waits_off
            return model.forward(rt, x)
        first = rt.first_pass(opening)
        replayed = 0
        for step in range(STEPS):
            x.copy_(_inputs(g, step, "cpu"))
            launches.clear()
            got, outcome = rt.step(forward, lambda: None, forward_first=first)
            assert launches == ["first"] + ["forward"] * outcome.replays, f"step {step}: {launches}"
            assert not rt.pool._waits_off
            assert torch.equal(got, want[step]), f"step {step} differs from the all-resident run"
            rt.pool.check_coherent()
            replayed += outcome.replays > 0
        assert replayed > 0  # some first pass missed, so replays ran


def test_prefill_launches_forward_not_the_first_pass():
    g = toy_geometry()
    model = ToyMoE(g)
    with _runtime(g, 0.25) as rt:
        x = _inputs(g, 0, "cpu")

        def refused():
            raise AssertionError("prefill launched the first pass")
        rt.step(lambda: model.forward(rt, x), lambda: None, prefill=True, forward_first=rt.first_pass(refused))


def test_unwaited_restores_the_waits_when_the_launch_raises():
    g = toy_geometry()
    with _runtime(g, 0.25) as rt:
        with pytest.raises(RuntimeError, match="boom"):
            with rt.pool.unwaited():
                assert rt.pool._waits_off
                raise RuntimeError("boom")
        assert not rt.pool._waits_off
        rt.pool.before_unwaited_launch()  # a CPU pool has nothing in flight: returns at once


@pytest.fixture
def cuda_case():
    g, model = cuda_toy_model()
    return g, model, *_resident(g, model, "cuda")


def _hold_rows(pool) -> None:
    """Delay the row copies an install issues after its table copy (its first layer's rows go before the table) by a
    device sleep on the copy stream: a pass launched right after the install, not waiting, maps those rows' slots and
    reads their stale bytes (holding the first layer's too would keep the old table, whose misses a replay fixes)."""
    issue, copy_table, take_buffers = pool._issue, pool._copy_table, pool._take_install_buffers
    table_sent = [False]

    def taken():  # an install starts
        table_sent[0] = False
        return take_buffers()

    def table(staged, stream):
        table_sent[0] = True
        copy_table(staged, stream)

    def held(runs, stream):
        if table_sent[0]:
            with on_copy_stream(stream):
                torch.cuda._sleep(HOLD_CYCLES)
        issue(runs, stream)
    pool._issue, pool._copy_table, pool._take_install_buffers = held, table, taken


def _prefetched_steps(rt, model, g, routed, graph: bool) -> list[torch.Tensor]:
    """Each step after a fetch of the keys it routes (held back on the bus), launched by its first pass."""
    x = torch.zeros(1, g.hidden, device="cuda")
    forward = lambda: model.forward(rt, x)  # noqa: E731
    first = rt.first_pass(forward)
    if graph:
        first, forward = graph_replayer(first), graph_replayer(forward)
    outputs = []
    for step in range(STEPS):
        x.copy_(_inputs(g, step, "cuda"))
        rt.fetch(routed[step], routed[step])
        got, _ = rt.step(forward, lambda: None, forward_first=first)
        outputs.append(got.clone())
    return outputs


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_a_first_pass_after_a_fetch_in_flight_equals_the_resident_run(cuda_case, graph):
    g, model, want, routed = cuda_case
    with _runtime(g, 0.25, "cuda") as rt:
        assert rt.first_passes and rt.pool.layer_waits
        _hold_rows(rt.pool)
        got = _prefetched_steps(rt, model, g, routed, graph)
        rt.pool.check_coherent()
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step} differs from the all-resident run"


@pytest.mark.gpu
def test_negative_control_without_the_wait_before_the_launch_reads_stale_rows(cuda_case):
    g, model, want, routed = cuda_case
    with _runtime(g, 0.25, "cuda") as rt:
        _hold_rows(rt.pool)
        rt.pool.before_unwaited_launch = lambda: None
        try:
            got = _prefetched_steps(rt, model, g, routed, graph=True)
            stale = any(not torch.equal(a, b) for a, b in zip(got, want))
        except ReplayLimitError:
            stale = True
        torch.cuda.synchronize()
    assert stale, "no first pass read a stale row: the test cannot fail"


@pytest.mark.gpu
@pytest.mark.parametrize("unwaited", [True, False])
def test_misses_and_replays_with_rows_held_back_equal_the_resident_run(cuda_case, unwaited):
    g, model, want, _ = cuda_case
    with _runtime(g, 0.25, "cuda", unwaited_first_pass=unwaited) as rt:
        _hold_rows(rt.pool)
        x = torch.zeros(1, g.hidden, device="cuda")
        forward = lambda: model.forward(rt, x)  # noqa: E731
        first = graph_replayer(rt.first_pass(forward)) if unwaited else None
        forward = graph_replayer(forward)
        for step in range(STEPS):
            x.copy_(_inputs(g, step, "cuda"))
            got, _ = rt.step(forward, lambda: None, forward_first=first)
            assert torch.equal(got, want[step]), f"step {step} differs from the all-resident run"
        assert rt.stats().replayed_steps > 0
        rt.pool.check_coherent()
