"""Runtime core on the CPU device: pool bookkeeping, the step protocol (fixed-point replay,
strict / approximate / tolerance), start-up working-set check, stats and KPI line."""

import pytest
import torch
from test_runtime_fixtures import ToyMoE, memory_source, random_slot_rows, toy_geometry

from tierstore.errors import CapacityError, ConfigError
from tierstore.kernels.layout import unpack_matrix_ref, w2_slot_layout
from tierstore.reference_moe import ExpertPool, ExpertTier, reference_moe
from tierstore.runtime import ReplayLimitError, RuntimeConfig, TieredRuntime, working_set_slots


def make_runtime(geometry, fraction=1.0, seed=0, **config):
    slots = max(1, round(fraction * geometry.total_routed_experts))
    return TieredRuntime(geometry, memory_source(geometry, seed), pool_slots=slots, arena_slots=0,
                         config=RuntimeConfig(kpi_every=0, **config))


def tokens(geometry, step, count=1):
    return torch.randn(count, geometry.hidden, generator=torch.Generator().manual_seed(1000 + step))


def resident_run(geometry, model, steps, count=1):
    with make_runtime(geometry) as runtime:
        runtime.preload()
        return [runtime.step(lambda x=tokens(geometry, s, count): model.forward(runtime, x), lambda: None)[0]
                for s in range(steps)]


def test_all_resident_layer_equals_reference_moe():
    g = toy_geometry()
    rows = random_slot_rows(g)
    layout = w2_slot_layout(g.hidden, g.expert_inter)
    with make_runtime(g) as runtime:
        runtime.preload()
        x = tokens(g, 0, count=5)
        ids, weights = ToyMoE(g).route(1, x)
        runtime.log.reset()
        got = runtime.moe(1, x, ids, weights)
    pool = ExpertPool.from_experts([(unpack_matrix_ref(rows[1, e], layout, "w13"), unpack_matrix_ref(rows[1, e], layout, "w2"))
                                    for e in range(g.num_experts)])
    table = torch.full((g.num_moe_layers, g.num_experts), -1, dtype=torch.int32)
    table[1] = torch.arange(g.num_experts, dtype=torch.int32)
    expected = reference_moe(x, ids, weights, layer=1, tiers=[ExpertTier("w2", table, pool)])
    assert torch.equal(got, expected.output)


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_small_pool_steps_are_bit_identical_to_all_resident(fraction):
    g = toy_geometry()
    model = ToyMoE(g)
    expected = resident_run(g, model, 40)
    with make_runtime(g, fraction) as runtime:
        for step, want in enumerate(expected):
            got, outcome = runtime.step(lambda x=tokens(g, step): model.forward(runtime, x), lambda: None)
            assert torch.equal(got, want), f"step {step} differs after {outcome.replays} replays"
            assert outcome.last_pass.missing_pairs == 0
            runtime.pool.check_coherent()
        stats = runtime.stats()
    assert stats.steps == 40 and stats.replayed_steps > 0 and stats.fetched_rows > 0
    assert stats.second_order_steps > 0  # corrected early layers re-routed later ones


def test_prefill_fetches_each_layer_before_it_runs():
    g = toy_geometry()
    model = ToyMoE(g)
    want = resident_run(g, model, 1, count=6)[0]
    with make_runtime(g, 0.25) as runtime:
        got, outcome = runtime.step(lambda: model.forward(runtime, tokens(g, 0, 6)), lambda: None, prefill=True)
    assert outcome.first_pass_missing_pairs == 0 and outcome.replays == 0
    assert torch.equal(got, want)


def test_pool_below_working_set_is_refused_with_a_size_that_works():
    g = toy_geometry()
    need = working_set_slots(g, 1, 1.15)
    assert need == 7  # ceil(1.15 * 3 layers * 2)
    with pytest.raises(CapacityError, match=f">= {need} slots"):
        make_runtime(g, fraction=6 / 48)
    make_runtime(g, fraction=6 / 48, force_pool=True).close()


def test_strict_mode_raises_instead_of_returning_degraded_logits():
    g = toy_geometry()
    model = ToyMoE(g)
    with make_runtime(g, fraction=2 / 48, force_pool=True) as runtime:  # one step routes 6 experts
        with pytest.raises(CapacityError, match="cannot hold this step's routed experts"):
            runtime.step(lambda: model.forward(runtime, tokens(g, 0)), lambda: None)
        assert runtime.stats().failed_steps == 1
        runtime.pool.check_coherent()


def test_strict_mode_raises_after_fp_max_replays():
    g = toy_geometry()
    model = ToyMoE(g)
    raised = 0
    with make_runtime(g, 0.25, fp_max=1) as runtime:
        for step in range(30):
            try:
                _, outcome = runtime.step(lambda x=tokens(g, step): model.forward(runtime, x), lambda: None)
            except ReplayLimitError as exc:
                assert "no degraded logits" in str(exc)
                raised += 1
                continue
            assert outcome.last_pass.missing_pairs == 0
    assert raised > 0


def test_approximate_mode_and_miss_tolerance_are_counted():
    g = toy_geometry()
    model = ToyMoE(g)
    with make_runtime(g, fraction=3 / 48, force_pool=True, replay_mode="approximate") as runtime:
        for step in range(10):
            _, outcome = runtime.step(lambda x=tokens(g, step): model.forward(runtime, x), lambda: None)
            assert outcome.replays <= 1
            assert outcome.residue_pairs == outcome.last_pass.missing_pairs
        stats = runtime.stats()
        assert stats.residue_steps > 0 and "DEGRADED" in runtime.kpi_line()
    with make_runtime(g, 0.25, miss_tolerance=1000) as runtime:
        _, outcome = runtime.step(lambda: model.forward(runtime, tokens(g, 0)), lambda: None)
        assert outcome.tolerated and outcome.replays == 0
        assert runtime.pool.num_mapped > 0  # the misses were still fetched for later steps
        assert runtime.stats().tolerated_steps == 1


def test_eviction_never_takes_the_steps_routed_set():
    g = toy_geometry()
    with make_runtime(g, fraction=8 / 48) as runtime:
        runtime.fetch([(0, e) for e in range(8)], [])
        protect = [(0, 0), (0, 1), (0, 2)]
        runtime.fetch([(1, e) for e in range(5)], protect)
        assert all(runtime.pool.is_resident(k) for k in protect)
        with pytest.raises(CapacityError):
            runtime.fetch([(2, e) for e in range(6)], [(1, e) for e in range(5)] + protect)
        runtime.pool.check_coherent()


def test_stats_and_kpi_line():
    g = toy_geometry()
    model = ToyMoE(g)
    with make_runtime(g, 0.25) as runtime:
        for step in range(5):
            runtime.step(lambda x=tokens(g, step): model.forward(runtime, x), lambda: None)
        stats = runtime.stats()
        line = runtime.kpi_line()
    assert stats.steps == 5 and 0 < stats.replay_rate <= 1 and stats.fetched_bytes > 0
    assert stats.step_p99_s >= stats.step_p50_s > 0
    assert line.startswith("[tierstore] KPI: replay ") and "slots = 25.0% of experts" in line


def test_config_from_env_and_validation():
    config = RuntimeConfig.from_env({"TIERSTORE_REPLAY_MODE": "approximate", "TIERSTORE_FP_MAX": "4",
                                     "TIERSTORE_FORCE_POOL": "1"}, kpi_every=0)
    assert (config.replay_mode, config.fp_max, config.force_pool, config.kpi_every) == ("approximate", 4, True, 0)
    assert config.degraded
    with pytest.raises(ConfigError, match="TIERSTORE_FP_MAX"):
        RuntimeConfig.from_env({"TIERSTORE_FP_MAX": "many"})
    with pytest.raises(ConfigError, match="replay_mode"):
        RuntimeConfig(replay_mode="sloppy")
