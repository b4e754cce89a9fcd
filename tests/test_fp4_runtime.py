"""The FP4 tier in the runtime (CPU, torch backend): kernels prefer FP4, the gate's replays reach
the all-FP4 result exactly, non-firing steps are untouched, `need` fills only on fires, the
manager keeps its invariants under a storm, and knobs refuse bad pools."""

from __future__ import annotations

import threading

import pytest
import torch
from fp4_fixtures import assert_fp4_coherent, decode_inputs, tier_rows, tiered
from test_runtime_fixtures import ToyMoE, toy_geometry

from tierstore.errors import CapacityError, ConfigError
from tierstore.kernels.layout import fp4_slot_layout, w2_slot_layout
from tierstore.kernels.moe_mm import TierPool, moe_mm_ref
from tierstore.runtime import MemoryRowSource, RuntimeConfig, TieredRuntime
from tierstore.runtime.fp4_manager import THREAD_NAME

GEOMETRY = toy_geometry(layers=3, experts=16, top_k=2)
ROWS = tier_rows(GEOMETRY)
ALL = GEOMETRY.total_routed_experts


def run(runtime, model, xs, wait: bool = True):
    outs, outcomes = [], []
    for x in xs:
        out, outcome = runtime.step(lambda x=x: model.forward(runtime, x), lambda: None)
        outs.append(out)
        outcomes.append(outcome)
        if wait:
            assert runtime.wait_fp4_manager(10)
    return outs, outcomes


def all_fp4(model, xs):
    with tiered(GEOMETRY, ROWS, pool_slots=ALL, fp4_slots=ALL, fp4_policy="need") as reference:
        reference.preload_fp4()
        return run(reference, model, xs)[0]


def test_fp4_slot_wins_over_base_slot_and_matches_the_reference():
    model, x = ToyMoE(GEOMETRY), torch.randn(3, GEOMETRY.hidden)
    ids, weights = model.route(0, x)
    with tiered(GEOMETRY, ROWS, pool_slots=ALL, fp4_slots=8, fp4_policy="need") as runtime:
        runtime.preload()
        promoted = sorted({(0, int(e)) for e in ids[:, 0].tolist()})
        runtime.preload_fp4(promoted)
        got = runtime.moe(0, x, ids, weights)
        w2 = TierPool(runtime.pool.slots, runtime.pool.table, w2_slot_layout(GEOMETRY.hidden, GEOMETRY.expert_inter))
        fp4 = TierPool(runtime.fp4.pool.slots, runtime.fp4.pool.table,
                       fp4_slot_layout(GEOMETRY.hidden, GEOMETRY.expert_inter))
        want, missing, _ = moe_mm_ref(x, ids, weights, w2, fp4, 0)
        base_only, _, _ = moe_mm_ref(x, ids, weights, w2, TierPool.empty(fp4.layout, 1, 3, 16, "cpu"), 0)
    assert missing == 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, base_only, rtol=1e-3, atol=1e-3)  # the FP4 rows were really used


def test_fired_steps_equal_the_all_fp4_run_bit_for_bit():
    model, xs = ToyMoE(GEOMETRY), decode_inputs(GEOMETRY, 12)
    want = all_fp4(model, xs)
    with tiered(GEOMETRY, ROWS, pool_slots=24, fp4_slots=ALL, gate=True, gate_tau=1.0, gate_fp_max=8,
                fp4_policy="need") as runtime:
        got, outcomes = run(runtime, model, xs)
        stats = runtime.gate_stats()
    assert all(o.gate is not None and o.gate.converged for o in outcomes)
    assert stats.fired == stats.steps == len(xs) and stats.promoted > 0
    assert all(o.residue_pairs == 0 for o in outcomes)  # the base misses of gate replays were repaired
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_fired_steps_with_pass_pairs_equal_the_all_fp4_run_bit_for_bit():
    """The pass pair beside the FP4 tier and the gate (config pass_pair, every step likely to miss paired): the
    pair's first pass reads the FP4 table like any pass, its signal is the one the gate judges, the gate's reruns
    are single passes; every step equals the all-FP4 run."""
    model, xs = ToyMoE(GEOMETRY), decode_inputs(GEOMETRY, 12)
    want = all_fp4(model, xs)
    w2_rows, fp4_rows = ROWS
    runtime = TieredRuntime(GEOMETRY, MemoryRowSource(w2_rows), pool_slots=24, arena_slots=ALL,
                            fp4_source=MemoryRowSource(fp4_rows), fp4_slots=ALL,
                            config=RuntimeConfig(kpi_every=0, gate=True, gate_tau=1.0, gate_fp_max=8,
                                                 fp4_policy="need", pass_pair=True, pass_pair_choice="always"))
    with runtime:
        runtime.arena.fetch([(layer, expert) for layer in range(GEOMETRY.num_moe_layers)
                             for expert in range(GEOMETRY.num_experts)], scan=True)
        got = []
        for x in xs:
            forward = lambda x=x: model.forward(runtime, x)  # noqa: E731
            out, outcome = runtime.step(forward, lambda: None, forward_pair=runtime.pass_pair(forward, lambda: None))
            assert outcome.gate is not None and outcome.gate.converged and outcome.residue_pairs == 0
            assert runtime.wait_fp4_manager(10)
            got.append(out)
        assert runtime.stats().pair_steps > 0
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step} differs from the all-FP4 run"


def test_a_gate_that_never_fires_changes_nothing():
    model, xs = ToyMoE(GEOMETRY), decode_inputs(GEOMETRY, 10, seed=1)
    results = []
    for gate in (False, True):
        with tiered(GEOMETRY, ROWS, pool_slots=24, fp4_slots=12, gate=gate, gate_tau=-1.0, fp4_policy="freq",
                    force_fp4_pool=True) as runtime:
            outs, outcomes = run(runtime, model, xs)
            results.append(outs)
            assert all(o.gate is None for o in outcomes)
            if gate:
                assert runtime.gate_stats().steps == len(xs) and runtime.gate_stats().fired == 0
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_need_policy_fills_only_on_fires():
    model, xs = ToyMoE(GEOMETRY), decode_inputs(GEOMETRY, 8, seed=2)
    with tiered(GEOMETRY, ROWS, pool_slots=ALL, fp4_slots=ALL, gate=True, gate_tau=-1.0, fp4_policy="need") as runtime:
        run(runtime, model, xs)
        assert runtime.fp4.pool.num_mapped == 0
        runtime.gate.set_tau(1.0)
        _, outcomes = run(runtime, model, xs[:2])
        stats = runtime.fp4_stats()
    assert stats.promoted_lazy == 0 and stats.promoted_forced == stats.mapped > 0
    assert sum(o.gate.promoted for o in outcomes) == stats.promoted_forced


def test_freq_policy_promotes_lazily_in_the_background():
    model, xs = ToyMoE(GEOMETRY), decode_inputs(GEOMETRY, 6, seed=3)
    with tiered(GEOMETRY, ROWS, pool_slots=ALL, fp4_slots=10, fp4_policy="freq", fp4_promote=4) as runtime:
        run(runtime, model, xs)
        stats = runtime.fp4_stats()
        assert_fp4_coherent(runtime, ROWS[1])
        names = [t.name for t in threading.enumerate()]
    assert THREAD_NAME in names
    assert 0 < stats.promoted_lazy and stats.mapped <= 10 and stats.routed_pairs == len(xs) * 3 * 2
    assert THREAD_NAME not in [t.name for t in threading.enumerate()]  # close() stopped it


def test_per_step_budget_is_shared_by_the_gate_iterations():
    model, xs = ToyMoE(GEOMETRY), decode_inputs(GEOMETRY, 4, seed=4)
    with tiered(GEOMETRY, ROWS, pool_slots=ALL, fp4_slots=ALL, gate=True, gate_tau=1.0, gate_budget=2,
                gate_fp_max=3, fp4_policy="need") as runtime:
        _, outcomes = run(runtime, model, xs)
    for outcome in outcomes:
        assert 0 < outcome.gate.promoted <= 2
        assert not outcome.gate.converged or outcome.gate.promoted == 0


@pytest.mark.parametrize("policy", ["freq", "lru", "need"])
def test_storm_keeps_the_invariants(policy):
    """Lazy promotions (background, not waited for) and forced ones interleave over a small pool."""
    model, xs = ToyMoE(GEOMETRY), decode_inputs(GEOMETRY, 40, seed=5)
    with tiered(GEOMETRY, ROWS, pool_slots=24, fp4_slots=10, gate=True, gate_tau=0.2, fp4_policy=policy,
                fp4_promote=3, force_fp4_pool=True, gate_budget=4) as runtime:
        for i, x in enumerate(xs):
            runtime.step(lambda x=x: model.forward(runtime, x), lambda: None)
            if i % 7 == 0:
                assert_fp4_coherent(runtime, ROWS[1])
        assert runtime.wait_fp4_manager(10)
        assert_fp4_coherent(runtime, ROWS[1])
        stats, gate = runtime.fp4_stats(), runtime.gate_stats()
    assert 0 < gate.fired < gate.steps == len(xs)
    assert stats.evicted > 0 and stats.mapped == 10
    assert runtime._fp4_manager.error is None


def test_gate_needs_an_fp4_pool_and_a_pool_above_the_fire_floor():
    with pytest.raises(ConfigError, match="needs an FP4 pool"):
        TieredRuntime(GEOMETRY, MemoryRowSource(ROWS[0]), pool_slots=ALL, config=RuntimeConfig(gate=True))
    with pytest.raises(CapacityError, match="fire floor of 11 slots"):  # 3 layers x 2 x 1.7
        tiered(GEOMETRY, ROWS, pool_slots=ALL, fp4_slots=10, gate=True)
    with tiered(GEOMETRY, ROWS, pool_slots=ALL, fp4_slots=10, gate=True, gate_budget=0, force_fp4_pool=True) as runtime:
        assert runtime._gate_budget == 64  # forced below the floor: promotions stay capped
    with tiered(GEOMETRY, ROWS, pool_slots=ALL, fp4_slots=11, gate=True, gate_budget=0) as runtime:
        assert runtime._gate_budget is None


def test_fp4_pool_size_from_config_and_auto_refused_on_cpu():
    slot = fp4_slot_layout(GEOMETRY.hidden, GEOMETRY.expert_inter).slot_bytes
    config = RuntimeConfig(fp4_pool_gb=str(5 * slot / 2**30), kpi_every=0)
    with TieredRuntime(GEOMETRY, MemoryRowSource(ROWS[0]), pool_slots=ALL, fp4_source=MemoryRowSource(ROWS[1]),
                       config=config) as runtime:
        assert runtime.fp4.pool.num_slots == 5
    with pytest.raises(ConfigError, match="free CUDA memory"):
        TieredRuntime(GEOMETRY, MemoryRowSource(ROWS[0]), pool_slots=ALL, fp4_source=MemoryRowSource(ROWS[1]),
                      config=RuntimeConfig(fp4_pool_gb="auto"))
    with TieredRuntime(GEOMETRY, MemoryRowSource(ROWS[0]), pool_slots=ALL,
                       fp4_source=MemoryRowSource(ROWS[1])) as runtime:
        assert runtime.fp4 is None  # default fp4_pool_gb = 0: no tier


def test_fp4_rows_of_the_wrong_size_are_refused():
    from tierstore.errors import PackFormatError

    with pytest.raises(PackFormatError, match="FP4 row source"):
        TieredRuntime(GEOMETRY, MemoryRowSource(ROWS[0]), pool_slots=ALL, fp4_source=MemoryRowSource(ROWS[0][:2]),
                      fp4_slots=4)


def test_gate_fire_dump_and_kpi_line(tmp_path):
    import json

    dump = tmp_path / "fires.jsonl"
    model, xs = ToyMoE(GEOMETRY), decode_inputs(GEOMETRY, 3, seed=6)
    with tiered(GEOMETRY, ROWS, pool_slots=ALL, fp4_slots=ALL, gate=True, gate_tau=1.0, fp4_policy="need",
                gate_dump=str(dump)) as runtime:
        run(runtime, model, xs)
        line = runtime.kpi_line()
    fires = [json.loads(l) for l in dump.read_text().splitlines()]
    assert [f["step"] for f in fires] == [0, 1, 2] and all(f["tau"] == 1.0 and f["promoted"] >= 0 for f in fires)
    assert {"signal", "final_signal", "replays", "argmax_before", "argmax_after", "converged"} <= set(fires[0])
    assert "gate fired 3/3 steps (100.0%)" in line and "| fp4 " in line
