"""Config `stream_arena`: a decode pass computes an expert without a pool slot from its pinned arena row instead of
missing it (no replay), and the rows it streamed are installed while the next step's first pass runs, with nothing
waiting for them.

CPU (the torch backend streams the same way): every step equal to the all-resident run bit for bit with no replay,
the pool's bytes and tables exact after each step, experts streamed and then installed (an input's third run in a
row hits: its second streams again, the install issued only once that second pass is launched); a prefill right
after a streamed step exact, the install still pending dropped; an arena not filled yet misses what it lacks
(fetched and replayed) and streams what it gained since; the combine's STREAM in Triton's interpreter; the knob's
refusals. GPU (marker gpu, nvcc): the CUDA stream builds against the resident kernels on the same bytes (outputs
poisoned, equal bit for bit, at the down kernels' 32- and 16-word tile widths, read plainly, with the L2 prefetch,
staged in shared memory and by a stage build given no room for its stage),
and the runtime end to end, eager and in CUDA graphs, equal to its all-resident run with no replay."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_runtime_fixtures import ToyMoE, arena_runtime, cuda_decode_steps, memory_source, toy_geometry

from tierstore.errors import ConfigError
from tierstore.runtime import RuntimeConfig, TieredRuntime

LAYERS, EXPERTS = 4, 16


def _resident(g, device: str = "cpu", backend: str = "auto") -> TieredRuntime:
    rt = TieredRuntime(g, memory_source(g, seed=7), pool_slots=g.total_routed_experts, device=device,
                       backend=backend, config=RuntimeConfig(kpi_every=0))
    rt.preload()
    return rt


def _check_exact(rt: TieredRuntime, source) -> None:
    rt.pool.wait()
    rt.pool.check_coherent()
    for slot, (layer, expert) in enumerate(rt.pool.owner.tolist()):
        if layer >= 0:
            assert torch.equal(rt.pool.slots[slot].cpu(), source.rows[layer, expert]), f"slot {slot} bytes"


def _x(seed: int, g) -> torch.Tensor:
    return torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(seed)) * 3


def _streamed_run(install: str, inputs: list[int]):
    """Decode steps of inputs `inputs` (seeds) on a 12-slot pool with stream_arena, each checked against the
    all-resident run (equal, no replay, the pool exact): (each step's streamed experts, stats, KPI line)."""
    g = toy_geometry(layers=LAYERS, experts=EXPERTS)
    model = ToyMoE(g, seed=3)
    resident = _resident(g)
    small, source = arena_runtime(g, 12, "all", stream_arena=True, stream_install=install)
    streamed = []
    with resident, small:
        for step, seed in enumerate(inputs):
            x = _x(seed, g)
            want, _ = resident.step(lambda: model.forward(resident, x), lambda: None)
            got, outcome = small.step(lambda: model.forward(small, x), lambda: None)
            assert torch.equal(got, want), f"step {step} differs from the all-resident run"
            assert outcome.replays == 0 and outcome.first_pass_missing_pairs == 0
            _check_exact(small, source)
            streamed.append(outcome.last_pass.missing_ids)
        return streamed, small.stats(), small.kpi_line()


@pytest.mark.parametrize("install", ["all", "hotter"])
def test_streamed_steps_equal_the_resident_run_and_never_replay(install):
    streamed, stats, line = _streamed_run(install, [step // 3 for step in range(48)])  # each input 3 times in a row
    assert stats.streamed_steps > 0 and stats.streamed_experts >= stats.streamed_steps
    assert 0 < stats.streamed_installs <= stats.fetched_rows and stats.replays == 0
    if install == "all":  # the second run streams again (its install is issued once its pass is launched)
        assert all(not ids for ids in streamed[2::3]), "what a step streamed is installed: an input's third run hits"
    assert f"{stats.streamed_steps} steps streamed {stats.streamed_experts} experts" in line
    assert f"{stats.streamed_installs} rows installed after them" in line


def test_hotter_installs_a_recurring_input_and_fewer_rows_than_all():
    inputs = [0 if step % 2 == 0 else 100 + step for step in range(64)]  # input 0 every other step, fresh ones between
    hotter, hot_stats, _ = _streamed_run("hotter", inputs)
    _, all_stats, _ = _streamed_run("all", inputs)
    assert all(not ids for ids in hotter[-16::2]), "the recurring input's experts are the hottest: they stay installed"
    assert hot_stats.streamed_installs < all_stats.streamed_installs / 2


def _empty_arena_runs():
    """(geometry, model, all-resident runtime, source, streaming runtime of 12 slots over an empty arena of every
    expert, which fills from the pack as its passes miss)."""
    g = toy_geometry(layers=LAYERS, experts=EXPERTS)
    source = memory_source(g, seed=7)
    small = TieredRuntime(g, source, pool_slots=12, arena_slots=g.total_routed_experts,
                          config=RuntimeConfig(kpi_every=0, stream_arena=True))
    return g, ToyMoE(g, seed=3), _resident(g), source, small


def test_an_arena_filling_up_misses_what_it_lacks_and_streams_what_it_gained():
    g, model, resident, source, small = _empty_arena_runs()
    outcomes = []
    with resident, small:
        for step in range(40):
            x = _x(step % 10, g)  # ten inputs: the arena has their rows after the first round
            want, _ = resident.step(lambda: model.forward(resident, x), lambda: None)
            got, outcome = small.step(lambda: model.forward(small, x), lambda: None)
            assert torch.equal(got, want), f"step {step} differs from the all-resident run"
            _check_exact(small, source)
            outcomes.append(outcome)
        stats = small.stats()
    assert outcomes[0].replays >= 1  # an empty arena: the first step misses, reads the pack and replays
    assert all(o.replays == 0 for o in outcomes[10:]), "rows the arena gained are streamed"
    assert stats.streamed_steps > 0


def test_victims_are_planned_only_while_a_pass_can_miss():
    """The victim plan (`plan_victims`, while a pass runs) prepares a fetch: it is made while the arena lacks rows,
    not once every expert has a published row (a decode pass then streams what it lacks), and again for the pass
    after one that missed all the same (here a row withheld from the streaming table); every step stays exact."""
    g, model, resident, source, small = _empty_arena_runs()
    planned_at: list[int] = []
    plan = small.pool.plan_victims
    step = 0

    def counted(count):
        planned_at.append(step)
        plan(count)
    small.pool.plan_victims = counted

    def run(x):
        want, _ = resident.step(lambda: model.forward(resident, x), lambda: None)
        got, outcome = small.step(lambda: model.forward(small, x), lambda: None)
        assert torch.equal(got, want), f"step {step} differs from the all-resident run"
        _check_exact(small, source)
        return outcome

    with resident, small:
        while not small._stream_rows.complete:  # the arena fills from the pack as passes miss
            assert step < 200, "the arena never held every row"
            run(torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(step)) * 3)
            step += 1
        assert planned_at and planned_at[0] == 0, "passes that can miss plan their victims"
        filled, planned_at[:] = step, []
        for _ in range(6):  # every row published: no pass misses, nothing is planned
            assert run(_x(step, g)).replays == 0
            step += 1
        assert planned_at == []
        x = _x(step, g)
        # a pass that misses all the same, as a batch the CUDA multi-token kernels serve does: the rows of the
        # experts without a slot withheld from the streaming table for one step (still "complete")
        table = small._stream_rows.at
        kept = table.clone()
        table[torch.from_numpy(small.pool.mirror.reshape(-1) < 0)] = 0
        outcome = run(x)
        assert outcome.replays >= 1 and outcome.first_pass_missing_pairs > 0
        assert planned_at == [step] * outcome.replays, "no plan for its first pass; its replays plan"
        table.copy_(kept)
        step += 1
        planned_at[:] = []
        assert run(_x(step, g)).first_pass_missing_pairs == 0
        assert planned_at == [step], "the step after one whose first pass missed plans"
        step += 1
        run(_x(step, g))
        assert planned_at == [step - 1], "and the one after a step whose first pass missed nothing does not"
    assert filled > 1


def test_a_prefill_after_a_streamed_step_stays_exact_and_drops_the_pending_install():
    g = toy_geometry(layers=LAYERS, experts=EXPERTS)
    model = ToyMoE(g, seed=3)
    resident = _resident(g)
    small, source = arena_runtime(g, 12, "all", tokens=8, stream_arena=True, force_pool=True)
    with resident, small:
        for step in range(6):  # decode steps until one streamed (an install pending), then a prefill
            x = _x(step, g)
            resident.step(lambda: model.forward(resident, x), lambda: None)
            small.step(lambda: model.forward(small, x), lambda: None)
            pending = small._decode_pending
            if pending is not None and pending.missing_ids and not pending.missing_pairs:
                break
        else:
            pytest.fail("no decode step streamed: the test needs a smaller pool")
        mapped = small.pool.mirror.copy()
        x = torch.randn(8, g.hidden, generator=torch.Generator().manual_seed(11))
        want, _ = resident.step(lambda: model.forward(resident, x), lambda: None, prefill=True)
        got, _ = small.step(lambda: model.forward(small, x), lambda: None, prefill=True)
        assert torch.equal(got, want)
        assert small._decode_pending is None
        _check_exact(small, source)
        assert (small.pool.mirror != mapped).any()  # the prefill fetched its own routed sets
        x = _x(0, g)
        want, _ = resident.step(lambda: model.forward(resident, x), lambda: None)
        got, outcome = small.step(lambda: model.forward(small, x), lambda: None)
        assert torch.equal(got, want) and outcome.replays == 0
        _check_exact(small, source)


def test_a_full_pool_streams_nothing_and_prefill_still_fetches():
    g = toy_geometry(layers=LAYERS, experts=EXPERTS)
    model = ToyMoE(g, seed=3)
    resident = _resident(g)
    small, _ = arena_runtime(g, 12, "all", tokens=8, stream_arena=True, force_pool=True)
    with resident, small:
        x = torch.randn(8, g.hidden, generator=torch.Generator().manual_seed(5))
        want, _ = resident.step(lambda: model.forward(resident, x), lambda: None, prefill=True)
        got, outcome = small.step(lambda: model.forward(small, x), lambda: None, prefill=True)
        assert torch.equal(got, want) and outcome.first_pass_missing_pairs == 0
        assert small.stats().streamed_steps == 0  # prefill fetches each layer's routed set before the layer
    full, _ = arena_runtime(g, g.total_routed_experts, "all", stream_arena=True)
    with full:
        assert full._stream_rows is None  # a pool that holds every expert never misses: nothing to stream


def test_the_knob_refuses_what_it_cannot_serve():
    g = toy_geometry(layers=LAYERS, experts=EXPERTS)
    with pytest.raises(ConfigError, match="arena must hold every routed expert and never evict: it has 40 slots "
                                          "for 64 experts"):
        arena_runtime(g, 12, 40, stream_arena=True)
    for other in ("gather_in_pass", "early_fetch"):
        with pytest.raises(ConfigError, match=f"stream_arena and {other} both serve misses"):
            RuntimeConfig(stream_arena=True, **{other: True})
    with pytest.raises(ConfigError, match="set pass_pair to auto or false"):
        RuntimeConfig(stream_arena=True, pass_pair=True)
    assert RuntimeConfig.from_env({"TIERSTORE_STREAM_ARENA": "1"}).stream_arena is True
    assert RuntimeConfig().stream_arena == "auto"


def test_auto_streams_only_where_it_can_run():
    """stream_arena auto: off on a CPU (the torch backend streams only when asked), with an arena short of every
    expert, and beside gather_in_pass / early_fetch / pass_pair true, where true refuses."""
    g = toy_geometry(layers=LAYERS, experts=EXPERTS)
    for arena, config in (("all", {}), (40, {}), ("all", {"gather_in_pass": True}), ("all", {"early_fetch": True}),
                          ("all", {"pass_pair": True})):
        rt, _ = arena_runtime(g, 12, arena, **config)
        with rt:
            assert rt._stream_rows is None, (arena, config)
    rt, _ = arena_runtime(g, 12, "all", stream_arena=True)
    with rt:
        assert rt._stream_rows is not None


def test_the_knob_refuses_an_fp4_tier():
    from fp4_fixtures import tier_rows

    from tierstore.runtime import MemoryRowSource

    g = toy_geometry(layers=LAYERS, experts=EXPERTS)
    w2_rows, fp4_rows = tier_rows(g)
    with pytest.raises(ConfigError, match="stream_arena streams W2 rows only"):
        TieredRuntime(g, MemoryRowSource(w2_rows), pool_slots=12, arena_slots=g.total_routed_experts,
                      fp4_source=MemoryRowSource(fp4_rows), fp4_slots=4,
                      config=RuntimeConfig(kpi_every=0, stream_arena=True))


def test_the_combine_adds_streamed_pairs_only_with_stream():
    """Triton's interpreter on CPU (the GPU where there is one): a pair of an expert in neither pool contributes
    its y row when STREAM and its stream_at word is nonzero, else nothing."""
    from tierstore.kernels import MoeWorkspace, fp4_tier, moe_combine, w2_tier

    device = "cuda" if torch.cuda.is_available() else "cpu"
    w2, f4 = w2_tier(512, 512, 1, 1, 4, device), fp4_tier(512, 512, 1, 1, 4, device)
    w2.table[0, 0] = 0  # expert 0 resident, 1 streamed, 2 missing
    at = torch.zeros(4, dtype=torch.int64, device=device)
    at[1] = 4096
    w2 = dataclasses.replace(w2, stream_at=at)
    ids = torch.tensor([[0, 1, 2]], dtype=torch.int32, device=device)
    weights = torch.tensor([[0.5, 0.25, 2.0]], dtype=torch.float32, device=device)
    ws = MoeWorkspace.allocate(1, 3, 4, 512, 512, torch.float32, device)
    ws.y.copy_(torch.arange(3, dtype=torch.float32, device=device)[:, None] + 1)  # pair p: p + 1 everywhere
    out = torch.full((1, 512), float("nan"), dtype=torch.float32, device=device)
    moe_combine(ids, weights, w2, f4, 0, ws, out, stream=True)
    assert torch.equal(out, torch.full_like(out, 0.5 * 1 + 0.25 * 2))
    moe_combine(ids, weights, w2, f4, 0, ws, out)
    assert torch.equal(out, torch.full_like(out, 0.5))


# -- GPU -----------------------------------------------------------------------------------------------------------

STREAM_FITS = dict(layers=2, experts=16, top_k=2, hidden=512)  # the CUDA kernels' shape rules


@pytest.fixture
def cuda():
    from tierstore.kernels.cuda import loader

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9 or loader.nvcc_path() is None:
        pytest.skip("needs a Hopper GPU and nvcc")


# how a stream build reads a streamed row: W2MoeCuda's stream options, and whether the stage gets its shared memory
STREAM_READS = {"plain": (dict(stream_prefetch=False), None), "prefetch": (dict(stream_prefetch=True), None),
                "stage": (dict(stream_prefetch=True, stream_stage=True), True),
                "stage_no_room": (dict(stream_prefetch=True, stream_stage=True), False)}


@pytest.mark.gpu
@pytest.mark.parametrize("read", list(STREAM_READS))
@pytest.mark.parametrize("inter", [512, 768])
def test_cuda_stream_builds_equal_the_resident_kernels_on_the_same_bytes(cuda, monkeypatch, inter, read):
    """moe_mm with W2MoeCuda(stream=True) over a pool where half the routed experts have no slot but an arena row in
    pinned memory, against W2MoeCuda() with every expert in a slot: the same output bit for bit (poisoned first), no
    missing pair, the streamed experts logged. The streamed rows read plainly, with the L2 prefetch, staged in shared
    memory (W2_STREAM_STAGE: the launches are given the room), and by a stage build given no room (its blocks then
    read as the prefetch build's)."""
    from test_runtime_fixtures import random_slot_rows

    from tierstore.kernels import MissLog, MoeWorkspace, TierPool, fp4_tier, moe_mm
    from tierstore.kernels.cuda import w2_down, w2_gate_up
    from tierstore.kernels.cuda.w2_moe import W2MoeCuda
    from tierstore.kernels.layout import w2_slot_layout

    g = toy_geometry(**STREAM_FITS, inter=inter)
    layout = w2_slot_layout(g.hidden, g.expert_inter)
    rows = random_slot_rows(g, seed=11)  # [L, E, slot_bytes] uint8
    experts = g.num_experts
    slots = rows.reshape(-1, layout.slot_bytes).cuda()  # slot s = key id s
    table = torch.arange(g.num_moe_layers * experts, dtype=torch.int32).view(g.num_moe_layers, experts).cuda()
    resident = TierPool(slots, table, layout)
    arena = rows.reshape(-1, layout.slot_bytes).pin_memory()  # the same rows in pinned host memory
    streamed = [1, 2, 5, 8, 9, 14]
    part_table = table.clone()
    at = torch.zeros(table.numel(), dtype=torch.int64)
    for layer in range(g.num_moe_layers):
        for e in streamed:
            key = layer * experts + e
            part_table[layer, e] = -1
            at[key] = arena[key].data_ptr() - slots.data_ptr()
    part = TierPool(slots, part_table, layout, stream_at=at.cuda())
    fp4 = fp4_tier(g.hidden, g.expert_inter, 1, g.num_moe_layers, experts, "cuda")
    wps = w2_down.wps_of(layout)
    options, room = STREAM_READS[read]
    if room is False:
        monkeypatch.setattr(w2_gate_up, "STREAM_STAGE_LIMIT", 0)
    plain, streaming = W2MoeCuda(wps=wps), W2MoeCuda(wps=wps, stream=True, **options)
    staged = (streaming.gate_up.shared_bytes(layout) > 2 * g.hidden,
              streaming.down.shared_bytes(layout) > 2 * w2_down.act_k(layout))
    assert staged == ((True, True) if room else (False, False))
    gen = torch.Generator().manual_seed(inter)
    for trial in range(4):
        ids = torch.stack([torch.randperm(experts, generator=gen)[:g.top_k] for _ in range(1)]).to(torch.int32).cuda()
        x = (torch.randn(1, g.hidden, generator=gen) * 2).to(torch.bfloat16).cuda()
        w = torch.rand(1, g.top_k, generator=gen).cuda()
        outs = []
        for pool, op in ((resident, plain), (part, streaming)):
            ws = MoeWorkspace.allocate(1, g.top_k, experts, g.hidden, g.expert_inter, torch.bfloat16, "cuda",
                                       block_tokens=1)
            ws.act.fill_(float("nan"))
            ws.y.fill_(float("nan"))
            misses = MissLog.allocate(16, "cuda")
            out = torch.full((1, g.hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
            moe_mm(x, ids, w, pool, fp4, trial % 2, misses, ws, out=out, cuda_w2=op)
            torch.cuda.synchronize()
            outs.append((out, misses.counts.tolist()))
        (want, want_counts), (got, got_counts) = outs
        assert want_counts == [0, 0]
        routed_streamed = sorted(set(ids.reshape(-1).tolist()) & set(streamed))
        assert got_counts == [0, len(routed_streamed)]
        assert not torch.isnan(got).any() and torch.equal(got, want), f"trial {trial}"


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True])
def test_cuda_runtime_streams_and_equals_its_resident_run(cuda, graph):
    g = toy_geometry(**STREAM_FITS, inter=512)
    model = ToyMoE(g, seed=5)
    model.routers = model.routers.to(torch.bfloat16).cuda()  # the CUDA kernels take bfloat16 hidden states
    resident = _resident(g, device="cuda", backend="triton")
    small, source = arena_runtime(g, 8, "all", device="cuda", backend="triton", stream_arena=True, force_pool=True)
    assert small._stream_rows is not None and not small.pairs
    with resident, small:
        seeds = [s // 2 for s in range(40)]
        want = cuda_decode_steps(resident, model, g, graph, seeds=seeds, dtype=torch.bfloat16)
        outcomes = []
        got = cuda_decode_steps(small, model, g, graph, seeds=seeds, outcomes=outcomes, dtype=torch.bfloat16)
        for step, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"step {step} differs from the all-resident run"
        assert all(outcome.replays == 0 for _, outcome in outcomes)
        stats = small.stats()
        assert stats.streamed_steps > 0 and stats.fetched_rows > 0
        _check_exact(small, source)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, hidden", [(torch.bfloat16, 512), (torch.float32, 512), (torch.bfloat16, 256)],
                         ids=["bf16-cuda-kernels", "float32-triton", "hidden256-triton"])
def test_cuda_auto_streams_on_every_kernel_path(cuda, dtype, hidden):
    """stream_arena auto on CUDA (the default): passes stream with no replay whichever kernels run them, the CUDA
    kernels' stream builds (bfloat16, hidden a multiple of 512) or the Triton stages (float32 hidden states, or a
    hidden size the CUDA kernels do not take), in CUDA graphs, equal to the all-resident run; the pool exact."""
    g = toy_geometry(**{**STREAM_FITS, "hidden": hidden}, inter=512)
    model = ToyMoE(g, seed=5)
    model.routers = model.routers.to(dtype).cuda()
    resident = _resident(g, device="cuda", backend="triton")
    small, source = arena_runtime(g, 8, "all", device="cuda", backend="triton", force_pool=True)
    assert small._stream_rows is not None and not small.pairs
    cuda_kernels = small.experts._workspace(1, g.top_k, dtype)[1] is not None  # the CUDA op serves these passes
    assert cuda_kernels == (dtype == torch.bfloat16 and hidden % 512 == 0)
    with resident, small:
        seeds = [s // 2 for s in range(24)]
        want = cuda_decode_steps(resident, model, g, True, seeds=seeds, dtype=dtype)
        outcomes = []
        got = cuda_decode_steps(small, model, g, True, seeds=seeds, outcomes=outcomes, dtype=dtype)
        for step, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"step {step} differs from the all-resident run"
        assert all(outcome.replays == 0 for _, outcome in outcomes)
        assert small.stats().streamed_steps > 0
        _check_exact(small, source)
