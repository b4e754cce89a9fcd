"""The pass's own fetch (config `gather_in_pass`): spares armed before a decode pass, each MoE layer mapping and
copying its missing arena rows before its experts run, the host state following the pass-log read.

CPU: the plan's reference against its contract on random states; the runtime end to end (every step equal to the
all-resident run bit for bit, the pool's bytes and tables exact after each), with an arena holding every row and
with one holding a part (the rest goes the host path), at 1 and 3 tokens per step; a pass that fails mid-way leaves
the host state in step; unarmed passes gather nothing; the knob's refusals. GPU: the CUDA plan and copy equal the
reference on random states (outputs poisoned first), and the runtime end to end, eager and in a CUDA graph."""

from __future__ import annotations

import random
import re
from itertools import islice

import pytest
import torch
from test_runtime_fixtures import ToyMoE, arena_runtime, cuda_decode_steps, memory_source, toy_geometry

from tests.cuda_fixtures import needs_nvcc, ptxas_report
from tierstore.errors import ConfigError
from tierstore.kernels.cuda.pass_gather import SOURCE, GatherBuffers, gather_rows_ref, plan_pass_gather_ref
from tierstore.runtime import RuntimeConfig, TieredRuntime

LAYERS, EXPERTS = 4, 16


def _plan_case(seed: int, device: str = "cpu"):
    """A random state before layer `layer`'s plan: tables with some experts resident (base or FP4), a pass that
    routed some experts of layers <= layer and a pass before it that routed others, an arena holding most rows,
    armed spares (free slots, then victims; some victims no longer at their slot, as when the pass before evicted
    them)."""
    rng = random.Random(seed)
    layer = rng.randrange(LAYERS)
    slots = 40
    keys = list(range(LAYERS * EXPERTS))
    resident = rng.sample(keys, 30)
    table = torch.full((LAYERS * EXPERTS,), -1, dtype=torch.int32)
    table[resident] = torch.tensor(rng.sample(range(slots), 30), dtype=torch.int32)
    f4 = torch.full((LAYERS * EXPERTS,), -1, dtype=torch.int32)
    f4[rng.sample(keys, 6)] = torch.arange(6, dtype=torch.int32)
    seen = torch.zeros(LAYERS * EXPERTS, dtype=torch.int32)
    for key in rng.sample(range((layer + 1) * EXPERTS), 3 * (layer + 1)):
        seen[key] = rng.randint(1, 3)
    prev_seen = torch.zeros(LAYERS * EXPERTS, dtype=torch.int32)
    prev_seen[rng.sample(keys, 12)] = 1
    free = [s for s in range(slots) if s not in set(table.tolist())]
    victims = rng.sample(resident, 12)
    spares = [(s, -1) for s in free[:rng.randint(0, len(free))]] + [(int(table[v]), v) for v in victims]
    for stale in rng.sample(range(len(spares) - 12, len(spares)), 3):  # their victim moved (another slot)
        spares[stale] = ((spares[stale][0] + 1) % slots, spares[stale][1])
    buffers = GatherBuffers.allocate(len(spares) + 4, LAYERS * EXPERTS, EXPERTS, "cpu")
    buffers.state.copy_(torch.tensor([len(spares), rng.randrange(3), 0]))
    buffers.spares[:len(spares)] = torch.tensor(spares, dtype=torch.int32)
    held = rng.sample(keys, 50)
    buffers.addresses[held] = torch.tensor([4096 * (1 + k) for k in held], dtype=torch.int64)
    gathered = torch.zeros(1 + 3 * buffers.spares.shape[0], dtype=torch.int32)
    gathered[0] = rng.randrange(3)
    to = lambda t: t.to(device)  # noqa: E731
    buffers = GatherBuffers.over(to(buffers.control), to(buffers.addresses), to(buffers.desc))
    return (layer, to(seen).view(LAYERS, EXPERTS), to(prev_seen).view(LAYERS, EXPERTS), to(table).view(LAYERS, EXPERTS),
            to(f4).view(LAYERS, EXPERTS), buffers, to(gathered))


@pytest.mark.parametrize("seed", range(20))
def test_the_plan_reference_keeps_its_contract(seed):
    layer, seen, prev_seen, table, f4, buffers, gathered = _plan_case(seed)
    before_table, before_state = table.clone().view(-1), buffers.state.clone()
    first = int(gathered[0])
    plan_pass_gather_ref(layer, seen, prev_seen, table, f4, buffers, gathered, slot_base=1 << 20, slot_bytes=256)
    armed, cursor, _ = before_state.tolist()
    flat_seen, flat_prev = seen.view(-1), prev_seen.view(-1)
    keys = range(layer * EXPERTS, (layer + 1) * EXPERTS)
    needed = [k for k in keys if flat_seen[k] > 0 and before_table[k] < 0 and f4.view(-1)[k] < 0
              and buffers.addresses[k] != 0 and cursor < armed]
    eligible = [(i, s, v) for i, (s, v) in enumerate(buffers.spares[:armed].tolist()) if i >= cursor
                and (v < 0 or (flat_seen[v] == 0 and flat_prev[v] == 0 and before_table[v] == s))]
    take = min(len(needed), len(eligible))
    assert int(gathered[0]) == first + take and int(buffers.state[2]) == take
    entries = gathered[1 + 3 * first:1 + 3 * (first + take)].view(-1, 3).tolist()
    assert [e[0] for e in entries] == needed[:take]  # ascending experts of the layer, as many as spares allow
    assert [(e[1], e[2]) for e in entries] == [(s, v) for _, s, v in eligible[:take]]
    after = table.view(-1)
    for key, slot, victim in entries:
        assert after[key] == slot and (victim < 0 or (after[victim] == -1 and flat_seen[victim] == 0
                                                      and flat_prev[victim] == 0 and before_table[victim] == slot))
    changed = set(torch.nonzero(after != before_table).view(-1).tolist())
    assert changed == {e[0] for e in entries} | {e[2] for e in entries if e[2] >= 0}
    assert buffers.desc[:take].tolist() == [[4096 * (1 + k), (1 << 20) + 256 * s] for k, s, _ in entries]
    assert int(buffers.state[1]) == (eligible[take - 1][0] + 1 if take else cursor)
    assert int(buffers.state[0]) == (0 if layer == LAYERS - 1 else armed)


def test_gather_rows_ref_copies_each_planned_row():
    buffers = GatherBuffers.allocate(4, LAYERS * EXPERTS, EXPERTS, "cpu")
    source = torch.randint(0, 256, (3, 64), dtype=torch.uint8)
    target = torch.zeros(3, 64, dtype=torch.uint8)
    buffers.desc[:2] = torch.tensor([[source[2].data_ptr(), target[0].data_ptr()],
                                     [source[0].data_ptr(), target[1].data_ptr()]])
    buffers.state[2] = 2
    gather_rows_ref(buffers, 64)
    assert torch.equal(target[0], source[2]) and torch.equal(target[1], source[0]) and not target[2].any()


def _gather_runtime(g, slots: int, arena_slots: int | str, tokens: int = 1, **kwargs):
    """A runtime with gather_in_pass over a pool of `slots` (`arena_runtime`)."""
    return arena_runtime(g, slots, arena_slots, tokens, gather_in_pass=True, **kwargs)


def _check_exact(rt: TieredRuntime, source) -> None:
    rt.settle()  # the last pass's own mappings reach the host here (deferred from its read)
    rt.pool.check_coherent()
    for slot, (layer, expert) in enumerate(rt.pool.owner.tolist()):
        if layer >= 0:
            assert torch.equal(rt.pool.slots[slot].cpu(), source.rows[layer, expert]), f"slot {slot} bytes"


@pytest.mark.parametrize("tokens,slots,arena", [(1, 32, "all"), (3, 32, "all"), (1, 20, "all"), (1, 32, 24)])
def test_runtime_gathers_in_the_pass_and_equals_the_resident_run(tokens, slots, arena):
    """Every step equal to the all-resident run, bytes and tables exact after each; the passes fetch for
    themselves (with every row in the arena, no step replays once warm unless spares ran short); an arena
    holding a part sends the rest down the host path, still exact."""
    g = toy_geometry(layers=LAYERS, experts=EXPERTS)
    model = ToyMoE(g, seed=3)
    resident = TieredRuntime(g, memory_source(g, seed=7), pool_slots=g.total_routed_experts,
                             config=RuntimeConfig(kpi_every=0, tokens_per_step=tokens))
    resident.preload()
    small, source = _gather_runtime(g, slots, arena, tokens)
    with resident, small:
        for step in range(48):
            x = torch.randn(tokens, g.hidden, generator=torch.Generator().manual_seed(step)) * 3
            want, _ = resident.step(lambda: model.forward(resident, x), lambda: None)
            got, _ = small.step(lambda: model.forward(small, x), lambda: None)
            assert torch.equal(got, want), f"step {step} differs from the all-resident run"
            _check_exact(small, source)
            if step == 0:  # the first pass has no spares (they are staged while the pass before runs)
                first = small.stats()
        x = torch.randn(tokens, g.hidden, generator=torch.Generator().manual_seed(99)) * 3
        small.step(lambda: model.forward(small, x), lambda: None)  # its own rows reach the host later:
        line = small.kpi_line()  # the KPI line counts them
        stats = small.stats()
    assert f"{stats.gathered_rows} rows gathered by their pass" in line
    assert stats.gathered_rows > 0 and stats.fetched_rows >= stats.gathered_rows
    if arena == "all" and slots == 32 and tokens == 1:  # every later miss fetched by its own pass (with 3 tokens a
        # step routes most of the pool: victims the pass before routed are skipped and the spares can run out)
        assert stats.fetched_rows - first.fetched_rows == stats.gathered_rows - first.gathered_rows
    if arena != "all":
        assert stats.fetched_rows > stats.gathered_rows  # rows not in the arena: the host path


@pytest.mark.parametrize("slots,tokens", [(20, 1), (32, 3), (40, 1)])
def test_spares_for_the_next_pass_are_free_slots_then_the_policys_order(slots, tokens):
    """`ahead_spares`: the free slots outside those the running pass may take, in the order `install` takes them,
    then the policy's eviction order from its first (from the current plan, or a walk), each with its slot."""
    g = toy_geometry(layers=LAYERS, experts=EXPERTS)
    model = ToyMoE(g, seed=11)
    small, _ = _gather_runtime(g, slots, "all", tokens)
    with small:
        compared = 0
        for step in range(30):
            x = torch.randn(tokens, g.hidden, generator=torch.Generator().manual_seed(step)) * 3
            small.step(lambda: model.forward(small, x), lambda: None)
            small.settle()
            pool = small.pool
            free = pool._free[::-1]
            exclude = set(free[::2])
            for planned in (False, True):
                if planned:
                    pool.plan_victims(slots)
                for count in (4, 12, slots):
                    got_slots, got_victims = pool.ahead_spares(count, exclude)
                    want_free = [slot for slot in free if slot not in exclude][:count]
                    order = list(islice(pool.policy.eviction_order(), count - len(want_free)))
                    assert got_victims == [-1] * len(want_free) + order, f"step {step}, {count} spares"
                    assert got_slots == want_free + [pool.slot_of(divmod(key, EXPERTS)) for key in order]
                    compared += 1
    assert compared == 30 * 6


def test_victims_are_never_routed_earlier_in_their_pass():
    """Every victim a pass took was routed neither by the pass before (config gather_keeps_recent) nor by that pass
    up to the layer that took it."""
    g = toy_geometry(layers=LAYERS, experts=EXPERTS)
    model = ToyMoE(g, seed=5)
    small, _ = _gather_runtime(g, 20, "all", gather_keeps_recent=True)
    with small:
        took = 0
        for step in range(30):
            x = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(step)) * 3
            small.step(lambda: model.forward(small, x), lambda: None)
            ids, _, victims = small.log.host_gathered()
            seen, before = small.log.host_routed_counts(), small._gather.prev_seen.view(-1).tolist()
            for key, victim in zip(ids, victims):
                if victim >= 0:
                    assert before[victim] == 0, f"step {step}: victim {victim} was routed by the pass before"
                if victim >= 0 and victim // EXPERTS <= key // EXPERTS:
                    assert seen[victim] == 0, f"step {step}: victim {victim} was routed before layer {key // EXPERTS}"
                    took += 1
    assert took > 0


@pytest.mark.parametrize("keeps_recent", [True, False])
def test_a_victim_the_pass_before_routed_is_skipped_unless_the_knob_is_off(keeps_recent):
    """config gather_keeps_recent: on, no pass takes a victim the pass before it routed; off, some pass does (a
    tight pool where every step routes much of it), and every step still equals the all-resident run."""
    g = toy_geometry(layers=LAYERS, experts=EXPERTS)
    model = ToyMoE(g, seed=5)
    resident = TieredRuntime(g, memory_source(g, seed=7), pool_slots=g.total_routed_experts,
                             config=RuntimeConfig(kpi_every=0))
    resident.preload()
    small, source = _gather_runtime(g, 20, "all", gather_keeps_recent=keeps_recent)
    recent_victims, victims_seen = 0, 0
    with resident, small:
        before = None  # the routed counts of the last pass of the step before
        for step in range(40):
            x = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(step)) * 3
            want, _ = resident.step(lambda: model.forward(resident, x), lambda: None)
            got, outcome = small.step(lambda: model.forward(small, x), lambda: None)
            assert torch.equal(got, want), f"step {step} differs from the all-resident run"
            _check_exact(small, source)
            victims = [victim for victim in small.log.host_gathered()[2] if victim >= 0]
            if outcome.replays == 0 and before is not None:  # the gathering pass was the step's last
                victims_seen += len(victims)
                recent_victims += sum(before[victim] > 0 for victim in victims)
            before = small.log.host_routed_counts().copy()  # the read buffer is reused by the next read
    assert victims_seen > 0
    assert (recent_victims > 0) == (not keeps_recent)
    assert RuntimeConfig.from_env({"TIERSTORE_GATHER_KEEPS_RECENT": "0"}).gather_keeps_recent is False


def test_a_pass_that_fails_midway_leaves_the_host_in_step():
    """A forward raising after two MoE layers (which gathered): the step fails, the pool is coherent after, and
    the next steps equal the resident run."""
    g = toy_geometry(layers=LAYERS, experts=EXPERTS)
    model = ToyMoE(g, seed=3)
    resident = TieredRuntime(g, memory_source(g, seed=7), pool_slots=g.total_routed_experts,
                             config=RuntimeConfig(kpi_every=0))
    resident.preload()
    small, source = _gather_runtime(g, 24, "all")
    with resident, small:
        for step in range(3):  # spares are staged while a pass before runs
            x = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(50 + step)) * 3
            small.step(lambda: model.forward(small, x), lambda: None)
        original = small.moe

        def failing(layer, *args):
            if layer == 2:
                raise RuntimeError("injected")
            return original(layer, *args)
        x = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(99)) * 3
        small.moe = failing
        with pytest.raises(RuntimeError, match="injected"):
            small.step(lambda: model.forward(small, x), lambda: None)
        small.moe = original
        assert int(small.log.gathered[0]) > 0, "the failed pass should have gathered in its first layers"
        _check_exact(small, source)
        assert int(small._gather.buffers.state[0]) == 0  # disarmed
        for step in range(8):
            x = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(step)) * 3
            want, _ = resident.step(lambda: model.forward(resident, x), lambda: None)
            got, _ = small.step(lambda: model.forward(small, x), lambda: None)
            assert torch.equal(got, want)
            _check_exact(small, source)


def test_passes_outside_a_decode_step_gather_nothing():
    g = toy_geometry(layers=LAYERS, experts=EXPERTS)
    model = ToyMoE(g, seed=3)
    small, source = _gather_runtime(g, 32, "all")
    with small:
        x = torch.randn(4, g.hidden, generator=torch.Generator().manual_seed(1)) * 3
        small.step(lambda: model.forward(small, x), lambda: None, prefill=True)
        assert small.stats().gathered_rows == 0  # prefill fetches each layer's routed set itself
        small.step(lambda: model.forward(small, x[:1]), lambda: None)
        mirror = small.pool.mirror.copy()
        model.forward(small, torch.randn(1, g.hidden) * 3)  # a pass nobody armed
        assert int(small.log.gathered[0]) == 0 and (small.pool.mirror == mirror).all()
        _check_exact(small, source)


def test_the_knob_refuses_what_it_cannot_serve():
    assert RuntimeConfig().gather_in_pass is False
    assert RuntimeConfig.from_env({"TIERSTORE_GATHER_IN_PASS": "1"}).gather_in_pass is True
    with pytest.raises(ConfigError, match="gather_in_pass and early_fetch"):
        RuntimeConfig(gather_in_pass=True, early_fetch=True)
    g = toy_geometry(layers=LAYERS, experts=EXPERTS)
    with pytest.raises(ConfigError, match="this runtime has none"):
        _gather_runtime(g, 32, 0)
    full, _ = _gather_runtime(g, g.total_routed_experts, 0)  # a pool holding every expert never misses: off
    with full:
        assert full._gather is None


@needs_nvcc
def test_the_kernels_compile_without_spills(tmp_path):
    report = ptxas_report(SOURCE, tmp_path / "pass_gather.cubin", {})
    for kernel in ("plan_pass_gather", "gather_pass_rows", "gather_rows"):
        info = report.split(f"Compiling entry function '{kernel}'")[1]
        assert re.search(r"\b0 bytes stack frame, 0 bytes spill stores", info), (kernel, info[:300])


@pytest.fixture
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(12))
def test_cuda_plan_and_copy_equal_the_reference(cuda, seed):
    from tierstore.kernels.cuda.pass_gather import PassGatherCuda

    layer, seen, prev_seen, table, f4, buffers, gathered = _plan_case(seed, "cuda")
    slots = torch.randint(0, 256, (40, 512), dtype=torch.uint8, device="cuda")
    arena = torch.randint(0, 256, (LAYERS * EXPERTS, 512), dtype=torch.uint8).pin_memory()
    held = buffers.addresses.nonzero().view(-1)
    buffers.addresses[held] = torch.tensor([arena[k].data_ptr() for k in held.tolist()], device="cuda")
    ref = [t.clone() for t in (seen, table, f4, gathered)]
    ref_buffers = GatherBuffers.over(buffers.control.clone(), buffers.addresses.clone(), buffers.desc.clone())
    buffers.desc.fill_(-7)  # poison what the kernel writes
    ref_buffers.desc.fill_(-7)
    first = int(gathered[0])
    gathered[1 + 3 * first:] = -9
    ref[3][1 + 3 * first:] = -9
    expected_slots = slots.clone()
    PassGatherCuda()(layer, seen, prev_seen, table, f4, buffers, gathered, slots, 512)
    plan_pass_gather_ref(layer, ref[0], prev_seen, ref[1], ref[2], ref_buffers, ref[3], slots.data_ptr(), 512)
    torch.cuda.synchronize()
    assert torch.equal(table, ref[1]) and torch.equal(gathered, ref[3])
    assert torch.equal(buffers.control, ref_buffers.control)
    take = int(ref_buffers.state[2])
    assert torch.equal(buffers.desc[:take], ref_buffers.desc[:take])
    for key, slot, _ in ref[3][1 + 3 * first:1 + 3 * (first + take)].view(-1, 3).tolist():
        expected_slots[slot] = arena[key].cuda()
    assert torch.equal(slots, expected_slots)  # the planned rows copied, every other slot untouched


@pytest.mark.gpu
@pytest.mark.parametrize("active", [1, 3, 16, 40], ids=lambda a: f"active{a}")
def test_cuda_copy_with_fewer_working_blocks_lands_every_row(cuda, active):
    """The pair's copy grid (config pass_pair_wide_blocks): a grid of 16 blocks of which the device word says how
    many work (past the grid: all of it) copies each described row exactly and nothing else."""
    from tierstore.kernels.cuda.pass_gather import PassGatherCuda

    gen = torch.Generator().manual_seed(active)
    row_bytes = 3 * 4096 + 48  # not a multiple of a block's run of words
    arena = torch.randint(0, 256, (12, row_bytes), dtype=torch.uint8, generator=gen).pin_memory()
    slots = torch.full((10, row_bytes), 0xA5, dtype=torch.uint8, device="cuda")  # poisoned
    sources, targets = torch.randperm(12, generator=gen)[:5].tolist(), torch.randperm(10, generator=gen)[:5].tolist()
    desc = torch.tensor([[arena[s].data_ptr(), slots[t].data_ptr()] for s, t in zip(sources, targets)],
                        dtype=torch.int64, device="cuda")
    rows = torch.tensor([5], dtype=torch.int32, device="cuda")
    PassGatherCuda().copy_rows(desc, rows, row_bytes, blocks=16,
                               active=torch.tensor([active], dtype=torch.int32, device="cuda"))
    torch.cuda.synchronize()
    expected = torch.full_like(slots, 0xA5)
    for s, t in zip(sources, targets):
        expected[t] = arena[s].cuda()
    assert torch.equal(slots, expected)


@pytest.mark.gpu
def test_cuda_refuses_the_torch_backend(cuda):
    g = toy_geometry(layers=LAYERS, experts=EXPERTS, hidden=128, inter=64)
    with pytest.raises(ConfigError, match="needs the triton backend"):
        _gather_runtime(g, 20, "all", device="cuda", backend="torch")


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_cuda_runtime_gathers_in_the_pass_and_equals_the_resident_run(cuda, graph):
    g = toy_geometry(layers=LAYERS, experts=EXPERTS, hidden=128, inter=64)
    model = ToyMoE(g)
    model.routers = model.routers.cuda()
    resident = TieredRuntime(g, memory_source(g, seed=7), pool_slots=g.total_routed_experts, device="cuda",
                             backend="triton", config=RuntimeConfig(kpi_every=0))
    with resident:
        resident.preload()
        want = cuda_decode_steps(resident, model, g, graph=False)
    small, source = _gather_runtime(g, 20, "all", device="cuda", backend="triton")
    with small:
        got = cuda_decode_steps(small, model, g, graph)
        _check_exact(small, source)
        stats = small.stats()
    assert stats.gathered_rows > 0
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step} differs from the all-resident run"
