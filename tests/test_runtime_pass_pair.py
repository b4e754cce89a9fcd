"""The pass pair (config `pass_pair`): a decode step likely to miss launches its pass and the replay together;
the first pass maps each layer's missing arena rows into armed spares after the layer's experts and copies them
(on a side stream on CUDA), the replay waits for each layer's rows before that layer.

CPU: every step equal to the all-resident run bit for bit, with the pool's bytes and tables exact after each, at 1
and 3 tokens, with an arena holding every row and with one holding a part (the rest goes the host path); the pass
log keeps the first pass's gathers and counts across the replay's reset; a step given no pair runs single passes
that gather nothing; a pair failing in its replay leaves the host in step; a pair whose first pass missed nothing
runs no replay (config pass_pair_replay_segment); the knob's refusals. GPU: the runtime end to end, eager and with
the pair captured as one CUDA graph, with every row copy held back on the side stream behind a device sleep (the
replay's waits keep it exact; its negative control, the waits removed, reads stale rows); the replay's conditional
segments in a graph, alone and in the runtime."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_runtime_fixtures import ToyMoE, arena_runtime, cuda_decode_steps, memory_source, toy_geometry

from tierstore.errors import ConfigError
from tierstore.runtime import RuntimeConfig, TieredRuntime
from tierstore.runtime.passlog import PassLog

LAYERS, EXPERTS = 4, 16


def _pair_runtime(g, slots: int, arena_slots: int | str, tokens: int = 1, **kwargs):
    """A runtime with pass_pair over a pool of `slots` (`arena_runtime`), pairing every step likely to miss
    (`pass_pair_choice` always; the timed choice is tested in test_runtime_pair_choice.py)."""
    kwargs.setdefault("pass_pair_choice", "always")
    return arena_runtime(g, slots, arena_slots, tokens, pass_pair=True, **kwargs)


def _resident(g, tokens: int = 1, device: str = "cpu", backend: str = "auto") -> TieredRuntime:
    rt = TieredRuntime(g, memory_source(g, seed=7), pool_slots=g.total_routed_experts, device=device,
                       backend=backend, config=RuntimeConfig(kpi_every=0, tokens_per_step=tokens))
    rt.preload()
    return rt


def _check_exact(rt: TieredRuntime, source) -> None:
    rt.settle()  # the pair's own mappings reach the host here (deferred from its read)
    rt.pool.check_coherent()
    for slot, (layer, expert) in enumerate(rt.pool.owner.tolist()):
        if layer >= 0:
            assert torch.equal(rt.pool.slots[slot].cpu(), source.rows[layer, expert]), f"slot {slot} bytes"


def _pair_step(rt: TieredRuntime, model: ToyMoE, x: torch.Tensor):
    forward = lambda: model.forward(rt, x)  # noqa: E731
    return rt.step(forward, lambda: None, forward_pair=rt.pass_pair(forward, lambda: None))


@pytest.mark.parametrize("tokens,slots,arena,copies", [(1, 32, "all", "kernel"), (3, 32, "all", "kernel"),
                                                       (1, 20, "all", "kernel"), (1, 32, 24, "kernel"),
                                                       (1, 32, "all", "engine")])
def test_pairs_equal_the_resident_run_with_exact_bytes_and_tables(tokens, slots, arena, copies):
    """(Engine copies on a CPU run the references like the kernel's.)"""
    g = toy_geometry(layers=LAYERS, experts=EXPERTS)
    model = ToyMoE(g, seed=3)
    resident = _resident(g, tokens)
    small, source = _pair_runtime(g, slots, arena, tokens, pass_pair_copies=copies)
    pairs_without_host_fetch = 0
    with resident, small:
        for step in range(48):
            x = torch.randn(tokens, g.hidden, generator=torch.Generator().manual_seed(step)) * 3
            want, _ = resident.step(lambda: model.forward(resident, x), lambda: None)
            before = small.stats()
            got, outcome = _pair_step(small, model, x)
            assert torch.equal(got, want), f"step {step} differs from the all-resident run"
            _check_exact(small, source)
            after = small.stats()
            if after.pair_steps > before.pair_steps:
                assert outcome.replays >= 1  # the pair's replay is counted
                pairs_without_host_fetch += outcome.replays == 1 and after.gathered_rows > before.gathered_rows
        stats = small.stats()
    assert stats.pair_steps > 0
    if arena == "all":
        assert stats.gathered_rows > 0
    if arena == "all" and tokens == 1:  # steps whose misses the pair's first pass fetched alone (with 3 tokens
        # a step routes most of the pool: victims the pass before routed are skipped and the spares can run out)
        assert pairs_without_host_fetch > 0
    if arena != "all":
        assert stats.fetched_rows > stats.gathered_rows  # rows not in the arena: the host path


def test_the_pass_log_keeps_the_first_pass_across_the_replays_reset():
    log = PassLog(2, 4, 2, capacity=8, device="cpu", gather_capacity=3)
    log.reset()
    log.gathered[:4] = torch.tensor([1, 5, 2, -1], dtype=torch.int32)
    log.counts.copy_(torch.tensor([3, 2], dtype=torch.int32))
    log.seen[1, 2] = 4
    log.reset(pair_replay=True)
    assert log.gathered[:4].tolist() == [1, 5, 2, -1]
    assert log.counts.tolist() == [0, 0] and int(log.seen.sum()) == 0
    log.read()
    assert log.host_first_missing() == (3, 2) and log.host_gathered() == ([5], [2], [-1])
    log.reset()  # a pass that is not a pair's replay clears all of it
    log.read()
    assert log.host_first_missing() == (0, 0) and log.host_gathered() == ([], [], [])
    with pytest.raises(ValueError, match="gather_capacity"):
        PassLog(2, 4, 2, capacity=8, device="cpu").reset(pair_replay=True)


def test_the_outcome_reports_the_first_pass_misses_of_a_pair():
    g = toy_geometry(layers=LAYERS, experts=EXPERTS)
    model = ToyMoE(g, seed=3)
    small, _ = _pair_runtime(g, 20, "all")
    with small:
        firsts = []
        for step in range(12):
            x = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(step)) * 3
            before = small.stats().gathered_rows
            _, outcome = _pair_step(small, model, x)
            firsts.append((outcome.first_pass_missing_pairs, small.stats().gathered_rows - before))
    # a pair whose first pass gathered had misses in that first pass (its log said so, not the replay's)
    assert any(gathered for _, gathered in firsts)
    assert all(first > 0 for first, gathered in firsts if gathered)


@pytest.mark.parametrize("segment", [4, 1, 0])
def test_a_pair_whose_first_pass_missed_nothing_runs_no_replay(segment):
    """Config pass_pair_replay_segment (0: off): a pair whose first pass missed nothing returns that pass's result
    and counts no replay; one that missed runs its replay. Every step equal to the resident run."""
    g = toy_geometry(layers=LAYERS, experts=EXPERTS)
    model = ToyMoE(g, seed=3)
    resident = _resident(g)
    small, source = _pair_runtime(g, 32, "all", pass_pair_replay_segment=segment)
    pairs = []  # (the first pass's missing pairs, replays counted, the halves of the pair's forward calls)
    with resident, small:
        for step in range(48):  # four inputs again and again (their experts fit the pool), a new one every fifth
            seed = step % 4 if step % 5 else 100 + step
            x = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(seed)) * 3
            want, _ = resident.step(lambda: model.forward(resident, x), lambda: None)
            halves = []

            def forward():
                halves.append(small._pair_half)
                return model.forward(small, x)
            before = small.stats().pair_steps
            got, outcome = small.step(forward, lambda: None, forward_pair=small.pass_pair(forward, lambda: None))
            assert torch.equal(got, want), f"step {step} differs from the all-resident run"
            _check_exact(small, source)
            if small.stats().pair_steps > before:
                pairs.append((outcome.first_pass_missing_pairs, outcome.replays, [h for h in halves if h]))
    hits = [pair for pair in pairs if pair[0] == 0]
    assert hits and len(hits) < len(pairs), "the case needs pairs that missed and pairs that did not"
    for first, replays, halves in pairs:
        if segment and not first:
            assert replays == 0 and halves == [1]
        else:
            assert replays >= 1 and halves == [1, 2]


def test_copy_into_writes_the_replays_result_over_the_first_passes():
    from tierstore.runtime.replay_if import copy_into

    first = (torch.zeros(3), [torch.zeros(2, 2)], None)
    second = (torch.arange(3.0), [torch.ones(2, 2)], None)
    out = copy_into(first, second)
    assert out is first and torch.equal(first[0], second[0]) and torch.equal(first[1][0], second[1][0])
    same = torch.ones(4)
    assert copy_into(same, same) is same
    with pytest.raises(ValueError, match="the replay returned 1 values, the first pass 2"):
        copy_into((torch.zeros(1), torch.zeros(1)), (torch.zeros(1),))
    with pytest.raises(TypeError, match="returns tensors or tuples of them"):
        copy_into({"logits": torch.zeros(1)}, {"logits": torch.zeros(1)})


def test_the_conditional_node_library_builds_with_its_entry_points(tmp_path):
    """`kernels/cuda/graph_if.cu` as a shared library (nvcc; no GPU needed to build or load it): what replay_if
    calls is exported, and the build is cached by its source."""
    from tierstore.kernels.cuda import loader

    if loader.nvcc_path() is None:
        pytest.skip("needs nvcc")
    source = Path(loader.__file__).with_name("graph_if.cu")
    path = loader.build_path(source, fmt="so", cache_dir=tmp_path)
    assert path.suffix == ".so" and loader.build_path(source, fmt="so", cache_dir=tmp_path) == path
    lib = loader.build_library(source, cache_dir=tmp_path)
    for name in ("tierstore_begin_if", "tierstore_end_if", "tierstore_new_stream", "tierstore_load_if"):
        assert hasattr(lib, name), name


def test_a_step_without_a_pair_gathers_nothing_and_stays_exact():
    g = toy_geometry(layers=LAYERS, experts=EXPERTS)
    model = ToyMoE(g, seed=3)
    resident = _resident(g)
    small, source = _pair_runtime(g, 20, "all")
    with resident, small:
        for step in range(16):
            x = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(step)) * 3
            want, _ = resident.step(lambda: model.forward(resident, x), lambda: None)
            got, _ = small.step(lambda: model.forward(small, x), lambda: None)
            assert torch.equal(got, want)
            _check_exact(small, source)
        stats = small.stats()
    assert stats.pair_steps == 0 and stats.gathered_rows == 0 and stats.fetched_rows > 0


def test_a_pair_failing_in_its_replay_leaves_the_host_in_step():
    """The replay raising after its first layers (the first pass gathered): the step fails, the pool is coherent
    after, and the next steps equal the resident run."""
    g = toy_geometry(layers=LAYERS, experts=EXPERTS)
    model = ToyMoE(g, seed=3)
    resident = _resident(g)
    small, source = _pair_runtime(g, 24, "all")
    with resident, small:
        for step in range(3):
            x = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(50 + step)) * 3
            _pair_step(small, model, x)
        original = small.moe

        def failing(layer, *args):
            if small._pair_half == 2 and layer == 2:
                raise RuntimeError("injected")
            return original(layer, *args)
        small.moe = failing
        x = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(99)) * 3
        with pytest.raises(RuntimeError, match="injected"):
            _pair_step(small, model, x)
        small.moe = original
        assert small._pair_half == 0
        assert int(small.log.gathered[0]) > 0, "the failed pair's first pass should have gathered"
        _check_exact(small, source)
        assert int(small._gather.buffers.state[0]) == 0  # disarmed
        for step in range(8):
            x = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(step)) * 3
            want, _ = resident.step(lambda: model.forward(resident, x), lambda: None)
            got, _ = _pair_step(small, model, x)
            assert torch.equal(got, want)
            _check_exact(small, source)


def test_after_a_pair_that_gathered_less_than_it_missed_single_passes_run_for_a_while():
    """An arena of 48 of the 64 rows, filled by fetches: pairs miss rows they cannot gather; the steps after such a pair run
    single passes (PAIR_RETRY_STEPS), every step still equal to the resident run."""
    from tierstore.runtime.pair_choice import PAIR_RETRY_STEPS

    g = toy_geometry(layers=LAYERS, experts=EXPERTS)
    model = ToyMoE(g, seed=3)
    resident = _resident(g)
    small, source = _pair_runtime(g, 32, 48)
    kinds = []  # (launched a pair, the runtime backed off after it)
    with resident, small:
        for step in range(48):
            x = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(step)) * 3
            want, _ = resident.step(lambda: model.forward(resident, x), lambda: None)
            before = small.stats()
            got, outcome = _pair_step(small, model, x)
            assert torch.equal(got, want)
            after = small.stats()
            paired = after.pair_steps > before.pair_steps
            kinds.append((paired, paired and small._pair_choice.backoff_left == PAIR_RETRY_STEPS))
        _check_exact(small, source)
    shorts = [i for i, (_, short) in enumerate(kinds) if short]
    assert shorts, "no pair fell short: the case does not test the back-off"
    for i in shorts:
        assert not any(paired for paired, _ in kinds[i + 1:i + 1 + PAIR_RETRY_STEPS])
    assert any(paired and not short for paired, short in kinds)


@pytest.mark.parametrize("wide", [16, 0])
def test_the_copy_grid_is_timed_between_the_two_widths(wide):
    """Config pass_pair_wide_blocks: the pairs alternate the wide and the narrow grid while the choice learns (the
    wide first), each counted; without a wide grid none is."""
    g = toy_geometry(layers=LAYERS, experts=EXPERTS)
    model = ToyMoE(g, seed=3)
    small, _ = _pair_runtime(g, 32, "all", pass_pair_wide_blocks=wide)
    chosen = []
    with small:
        for step in range(24):
            x = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(step)) * 3
            before = small.stats()
            _pair_step(small, model, x)
            after = small.stats()
            if after.pair_steps > before.pair_steps:
                chosen.append(after.wide_pairs - before.wide_pairs)
        stats, kpi = small.stats(), small.kpi_line(24)
    assert len(chosen) >= 6
    if wide:
        assert chosen[:6] == [1, 0, 1, 0, 1, 0]  # learning: alternate, the wide grid first
        assert 0 < stats.wide_pairs == sum(chosen) < stats.pair_steps
        assert f"({stats.wide_pairs} with the wide copy grid)" in kpi
    else:
        assert stats.wide_pairs == 0 and small._grid_choice is None


def test_the_knob_refuses_what_it_cannot_serve():
    assert RuntimeConfig().pass_pair == "auto"
    assert [RuntimeConfig.from_env({"TIERSTORE_PASS_PAIR": raw}).pass_pair for raw in ("auto", "0", "on")] == [
        "auto", False, True]
    with pytest.raises(ConfigError, match="pass_pair must be auto, true or false"):
        RuntimeConfig(pass_pair="sometimes")
    with pytest.raises(ConfigError, match="pass_pair_copy_blocks must be an integer >= 1"):
        RuntimeConfig(pass_pair_copy_blocks=0)
    with pytest.raises(ConfigError, match="pass_pair_wide_blocks must be an integer >= 0"):
        RuntimeConfig(pass_pair_wide_blocks=-1)
    with pytest.raises(ConfigError, match="pass_pair_replay_segment must be an integer >= 0"):
        RuntimeConfig(pass_pair_replay_segment=-1)
    assert RuntimeConfig().pass_pair_replay_segment == 0
    assert RuntimeConfig.from_env({"TIERSTORE_PASS_PAIR_REPLAY_SEGMENT": "4"}).pass_pair_replay_segment == 4
    with pytest.raises(ConfigError, match="pass_pair_replay_segment with pass_pair_copies engine"):
        RuntimeConfig(pass_pair_replay_segment=4, pass_pair_copies="engine")
    with pytest.raises(ConfigError, match="gather_spares_per_miss must be an integer >= 1"):
        RuntimeConfig(gather_spares_per_miss=0)
    with pytest.raises(ConfigError, match="pass_pair_copies must be one of kernel, engine"):
        RuntimeConfig(pass_pair_copies="dma")
    with pytest.raises(ConfigError, match="pass_pair_plans must be one of stream, inline"):
        RuntimeConfig(pass_pair_plans="later")
    assert RuntimeConfig.from_env({"TIERSTORE_PASS_PAIR": "1"}).pass_pair is True
    for other in ("gather_in_pass", "early_fetch"):
        with pytest.raises(ConfigError, match=f"pass_pair and {other}"):
            RuntimeConfig(pass_pair=True, **{other: True})
        assert RuntimeConfig(**{other: True}).pass_pair == "auto"  # auto yields to either
    g = toy_geometry(layers=LAYERS, experts=EXPERTS)
    with pytest.raises(ConfigError, match="pass_pair copies rows from the arena"):
        _pair_runtime(g, 32, 0)
    full, _ = _pair_runtime(g, g.total_routed_experts, 0)  # a pool holding every expert never misses: off
    with full:
        assert not full.pairs
        with pytest.raises(ConfigError, match="has no pass pair"):
            full.pass_pair(lambda: None, lambda: None)
    auto, _ = arena_runtime(g, 32, "all")  # auto on a CPU: off (a pass is not asynchronous there)
    with auto:
        assert not auto.pairs and auto._gather is None


# -- GPU ------------------------------------------------------------------------------------------------------------

@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


def _held_back(rt: TieredRuntime, cycles: int = 20_000_000) -> None:
    """Every row copy of the pair's first pass starts only after a device sleep on its side stream (the copy
    kernel's launch, or with engine copies each row the host issues)."""
    gather = rt._gather
    if gather.engine:
        copy = gather._h2d.copy

        def late_row(destination, source, nbytes, stream):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(cycles)
            copy(destination, source, nbytes, stream)
        gather._h2d.copy = late_row
        return
    copy = gather._kernels.copy_rows

    def late_copy(*args, **kwargs):
        torch.cuda._sleep(cycles)
        copy(*args, **kwargs)
    gather._kernels.copy_rows = late_copy


def _held_back_plans(rt: TieredRuntime, cycles: int = 20_000_000) -> None:
    """Every plan of the pair's first pass starts only after a device sleep on the stream it runs on."""
    plan = rt._gather._kernels.plan_layer

    def late_plan(*args, **kwargs):
        torch.cuda._sleep(cycles)
        plan(*args, **kwargs)
    rt._gather._kernels.plan_layer = late_plan


def _cuda_case():
    """(geometry, model, the all-resident run's outputs) of the GPU tests."""
    g = toy_geometry(layers=LAYERS, experts=EXPERTS, hidden=128, inter=64)
    model = ToyMoE(g)
    model.routers = model.routers.cuda()
    with _resident(g, device="cuda", backend="triton") as resident:
        return g, model, cuda_decode_steps(resident, model, g, graph=False)


@pytest.mark.gpu
def test_cuda_refuses_the_torch_backend(cuda):
    g = toy_geometry(layers=LAYERS, experts=EXPERTS, hidden=128, inter=64)
    with pytest.raises(ConfigError, match="pass_pair on CUDA needs the triton backend"):
        _pair_runtime(g, 20, "all", device="cuda", backend="torch")


@pytest.mark.gpu
def test_cuda_auto_pairs_where_they_can_run(cuda):
    """pass_pair auto on CUDA: on with the triton backend and an arena; off with the torch backend, without an
    arena, beside gather_in_pass, in a pool that holds every expert, and where stream_arena (auto, on with an arena
    of every expert) serves the misses."""
    g = toy_geometry(layers=LAYERS, experts=EXPERTS, hidden=128, inter=64)
    no_stream = {"stream_arena": False}
    cases = [((20, "all"), no_stream, True), ((20, 40), {}, True), ((20, "all"), {}, False),
             ((20, "all"), {"backend": "torch"}, False), ((20, 0), {}, False),
             ((20, "all"), {"gather_in_pass": True}, False), ((g.total_routed_experts, "all"), no_stream, False)]
    for (slots, arena), kwargs, paired in cases:
        rt, _ = arena_runtime(g, slots, arena, device="cuda", **{"backend": "triton", **kwargs})
        with rt:
            assert rt.pairs is paired, (slots, arena, kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("copies, plans", [("kernel", "stream"), ("kernel", "inline"), ("engine", "stream")])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("held_back", ["prompt", "copies", "plans"])
def test_cuda_pairs_equal_the_resident_run(cuda, graph, held_back, copies, plans):
    """Every step equal to the resident run with the copies or the plans held back behind a device sleep (plans on
    their own stream: the replay must wait for the last one; engine copies plan inline whatever the knob says)."""
    g, model, want = _cuda_case()
    small, source = _pair_runtime(g, 20, "all", device="cuda", backend="triton", pass_pair_copies=copies,
                                  pass_pair_plans=plans)
    with small:
        assert (small._gather._plans is not None) is (copies == "kernel" and plans == "stream")
        if held_back == "copies":
            _held_back(small)
        elif held_back == "plans":
            _held_back_plans(small)
        got = cuda_decode_steps(small, model, g, graph)
        _check_exact(small, source)
        stats = small.stats()
    assert stats.pair_steps > 0 and stats.gathered_rows > 0
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step} differs from the all-resident run"


@pytest.mark.gpu
@pytest.mark.parametrize("copies, segment", [("kernel", 0), ("kernel", 1), ("engine", 0)])
def test_cuda_negative_control_without_the_replays_waits_reads_stale_rows(cuda, copies, segment):
    """The held-back copies with the replay's waits removed but the last layer's (which joins the side stream, as
    a capture needs): some step differs from the resident run (so the waits keep the held-back test exact). With
    conditional segments of one layer (config pass_pair_replay_segment 1) the waits are the segments'."""
    g, model, want = _cuda_case()
    small, _ = _pair_runtime(g, 20, "all", device="cuda", backend="triton", pass_pair_copies=copies,
                             pass_pair_replay_segment=segment)
    with small:
        _held_back(small)
        wait_rows = small._gather.wait_rows
        small._gather.wait_rows = lambda layer: wait_rows(layer) if layer == LAYERS - 1 else None
        got = cuda_decode_steps(small, model, g, graph=True)
        torch.cuda.synchronize()
    assert any(not torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.gpu
def test_cuda_conditional_segments_run_only_when_the_first_pass_missed(cuda):
    """`ConditionalReplay` in a CUDA graph (by torch's IF nodes where it has them, else by the CUDA runtime's): six
    layers in segments of four; each segment waits for every one of its layers' copies before it opens; replayed
    with the count at 0 the output is the first pass's, above 0 the replay's (outputs poisoned)."""
    from tierstore.runtime.replay_if import (ConditionalReplay, capturing, conditional_capture_available, copy_into,
                                             prepare_if_nodes)

    assert prepare_if_nodes(torch.device("cuda")), "neither torch nor the CUDA runtime captures IF nodes"
    missed = torch.zeros(1, dtype=torch.int32, device="cuda")
    x = torch.zeros(8, device="cuda")
    waited = []
    graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
    with capturing(pool), torch.cuda.graph(graph, pool=pool):
        assert conditional_capture_available(torch.device("cuda"))
        first = x * 2
        replay = ConditionalReplay(missed, 6, 4, waited.append)
        replay.open()
        opened = list(waited)
        h = x + 1
        for layer in range(6):
            replay.layer(layer)
            h = h * 3 + layer
        out = copy_into(first, h)
        replay.close()
    assert opened == [0, 1, 2, 3] and waited == [0, 1, 2, 3, 4, 5]
    for count in (0, 2, 0, 1):
        x.copy_(torch.randn(8, generator=torch.Generator().manual_seed(count)).cuda())
        missed.fill_(count)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want = x * 2
        if count:
            want = x + 1
            for layer in range(6):
                want = want * 3 + layer
        assert torch.equal(out, want), f"count {count}"


@pytest.mark.gpu
@pytest.mark.parametrize("segment", [4, 1, 0])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_cuda_a_pair_that_missed_nothing_runs_no_replay(cuda, graph, segment):
    """Config pass_pair_replay_segment with the copies held back: every step equal to the resident run; a pair
    whose first pass missed nothing counts no replay (its conditional segments skipped), one that missed does."""
    g = toy_geometry(layers=LAYERS, experts=EXPERTS, hidden=128, inter=64)
    model = ToyMoE(g)
    model.routers = model.routers.cuda()
    seeds = [step % 4 if step % 5 else 100 + step for step in range(32)]  # repeated inputs, a new one every fifth
    with _resident(g, device="cuda", backend="triton") as resident:
        want = cuda_decode_steps(resident, model, g, graph=False, seeds=seeds)
    small, source = _pair_runtime(g, 32, "all", device="cuda", backend="triton", pass_pair_replay_segment=segment)
    outcomes = []
    with small:
        _held_back(small)
        got = cuda_decode_steps(small, model, g, graph, seeds=seeds, outcomes=outcomes)
        _check_exact(small, source)
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step} differs from the all-resident run"
    pairs = [(outcome.first_pass_missing_pairs, outcome.replays) for paired, outcome in outcomes if paired]
    hits = [pair for pair in pairs if pair[0] == 0]
    assert hits and len(hits) < len(pairs), "the case needs pairs that missed and pairs that did not"
    for first, replays in pairs:
        if segment and not first:
            assert replays == 0
        else:
            assert replays >= 1
