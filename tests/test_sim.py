"""Simulator semantics, fast path == reference policy objects, tiers and cost model."""

import numpy as np
import pytest

from tierstore.errors import CapacityError
from tierstore.sim import simulate, synthetic_trace
from tierstore.sim.trace import Trace


def tiny(rows, num_experts=8):
    """rows: per token, per layer, the routed experts."""
    return Trace(experts=np.array(rows, np.int32), num_experts=num_experts)


def test_default_semantics_by_hand():
    # 1 layer, top-2, pool of 2 slots. Steps: {0,1} {0,2} {1,2} {0,1}
    t = tiny([[[0, 1]], [[0, 2]], [[1, 2]], [[0, 1]]])
    r = simulate(t, gpu_slots=2, policy="lru", fast=False)
    # step0: miss 0,1. step1: hit 0, miss 2 evicts 1. step2: hit 2, miss 1 evicts 0. step3: hit 1, miss 0.
    assert r.counters["hit_pairs"].tolist() == [0, 1, 1, 1]
    assert r.counters["miss_keys"].tolist() == [2, 1, 1, 1]
    assert r.token_hit_rate == 3 / 8 and r.zero_miss_step_fraction == 0.0
    b = simulate(t, gpu_slots=2, policy="belady", fast=False)
    assert b.counters["hit_pairs"].tolist() == [0, 1, 1, 1]


def test_step_larger_than_pool_overflows_temporarily():
    t = tiny([[[0, 1, 2]], [[0, 1, 2]], [[3, 4, 5]], [[0, 1, 2]]])
    for fast in (True, False):
        r = simulate(t, gpu_slots=2, policy="lru", fast=fast)
        # the 3-key step stays resident (overflow) and hits in full the next step; step 2's
        # inserts evict the old keys down to 2 slots, so step 3 misses everything
        assert r.counters["hit_pairs"].tolist() == [0, 3, 0, 0]


def test_multi_token_steps_count_pairs_against_step_start():
    t = tiny([[[0, 1]], [[0, 2]], [[0, 1]], [[0, 1]]])
    r = simulate(t, gpu_slots=4, tokens_per_step=2, fast=False)
    # step0 = tokens 0,1: keys 0 (2 pairs), 1, 2 all miss; step1: all 4 pairs hit
    assert r.counters["pairs"].tolist() == [4, 4]
    assert r.counters["hit_pairs"].tolist() == [0, 4] and r.counters["miss_keys"].tolist() == [3, 0]
    f = simulate(t, gpu_slots=4, tokens_per_step=2, fast=True)
    assert f.counters["hit_pairs"].tolist() == [0, 4]


@pytest.mark.parametrize("policy", ["lru", "belady"])
@pytest.mark.parametrize("seed,locality,tps", [(0, 0.0, 1), (1, 0.5, 1), (2, 0.3, 3)])
def test_fast_path_matches_policy_objects(policy, seed, locality, tps):
    t = synthetic_trace(300, 4, 16, 3, skew=1.0, locality=locality, burst_len=100, seed=seed)
    for slots in (4, 13, 30, 50):
        fast = simulate(t, gpu_slots=slots, policy=policy, tokens_per_step=tps, fast=True)
        ref = simulate(t, gpu_slots=slots, policy=policy, tokens_per_step=tps, fast=False)
        assert fast.params["engine"] == "fast" and ref.params["engine"] == "reference"
        for name in ("hit_pairs", "miss_keys", "pairs"):
            assert np.array_equal(fast.counters[name], ref.counters[name]), (slots, name)


def test_belady_bounds_every_policy_and_hit_rate_grows_with_slots():
    t = synthetic_trace(400, 4, 16, 2, skew=1.0, locality=0.2, seed=5)
    for slots in (8, 24, 40):
        best = simulate(t, gpu_slots=slots, policy="belady").token_hit_rate
        for name in ("lru", "lfu", "freq", "class-lru", "s3fifo", "sieve", "static-hot"):
            assert simulate(t, gpu_slots=slots, policy=name).token_hit_rate <= best + 1e-12, name
    rates = [simulate(t, gpu_slots=n).token_hit_rate for n in (8, 24, 40, 64)]
    assert rates == sorted(rates) and rates[-1] == pytest.approx(1 - 64 / t.num_events)


def test_per_layer_pools_never_share_slots():
    t = tiny([[[0], [0]], [[1], [1]], [[0], [0]]], num_experts=2)
    glob = simulate(t, gpu_slots=2, fast=False)
    per = simulate(t, gpu_slots=4, pool="per-layer", fast=False)
    assert glob.counters["hit_pairs"].tolist() == [0, 0, 0]
    assert per.counters["hit_pairs"].tolist() == [0, 0, 2]


def test_arena_serves_rows_evicted_from_gpu():
    t = tiny([[[0]], [[1]], [[0]], [[1]]], num_experts=4)
    r = simulate(t, gpu_slots=1, arena_slots=2, geometry="olmoe-1b-7b")
    assert r.counters["arena_rows"].tolist() == [0, 0, 1, 1] and r.arena_hit_rate == 0.5
    assert r.bytes_moved()["disk_w2"] == 2 * r.geometry.w2_expert_bytes


def test_a_frequency_arena_keeps_the_key_it_is_asked_for_most_where_lru_drops_it():
    # key 0 asked every third step among keys asked once; the 1-slot pool misses every step, the arena holds 2
    sequence = [0, 1, 2, 0, 3, 4, 0, 5, 6, 0, 7, 8, 0]
    t = tiny([[[key]] for key in sequence], num_experts=9)
    lru = simulate(t, gpu_slots=1, arena_slots=2, arena_policy="lru")
    freq = simulate(t, gpu_slots=1, arena_slots=2, arena_policy="freq-dense")
    assert lru.counters["miss_keys"].tolist() == [1] * 13 and lru.counters["arena_rows"].sum() == 0
    # the second ask of key 0 (step 3) counts it twice; from then on it outranks the keys asked once
    assert freq.counters["arena_rows"].tolist() == [0] * 6 + [1, 0, 0, 1, 0, 0, 1]
    assert freq.params["arena_policy"] == "freq-dense"
    belady = simulate(t, gpu_slots=1, arena_slots=2, arena_policy="belady")  # given the trace's future
    assert belady.counters["arena_rows"].sum() >= freq.counters["arena_rows"].sum()


def test_fp4_pool_lazy_promotion_and_gate():
    t = synthetic_trace(200, 2, 8, 2, skew=1.5, seed=3)
    lazy = simulate(t, gpu_slots=4, fp4_slots=4)
    assert lazy.fp4_share > 0.3 and lazy.counters["promoted_rows"].sum() > 0
    t.confidence = np.where(np.arange(200) % 10 == 0, 0.2, 0.95).astype(np.float32)
    gated = simulate(t, gpu_slots=4, fp4_slots=4, fp4_policy="need", gate_tau=0.6, geometry="olmoe-1b-7b")
    assert gated.counters["fired"].sum() == 20 and gated.counters["promoted_rows"].sum() == 0
    assert 0 < gated.fp4_share < lazy.fp4_share
    with pytest.raises(ValueError, match="confidence gate"):
        simulate(synthetic_trace(10, 1, 4, 1), gpu_slots=2, gate_tau=0.5)


def test_cost_model_step_time_and_gib_capacities():
    t = synthetic_trace(100, 16, 64, 8, seed=0, geometry="olmoe-1b-7b")
    r = simulate(t, gpu_gb=1.0)
    g = r.geometry
    assert r.params["gpu_slots"] == (1 << 30) // g.w2_expert_bytes
    steps = r.step_seconds()
    compute = 128 * g.w2_expert_bytes / r.cost.hbm_bytes_per_s
    missed = r.counters["miss_keys"] > 0
    assert np.allclose(steps[~missed], compute)
    fetch = r.cost.h2d_latency_s + r.counters["miss_keys"][missed] * g.w2_expert_bytes / r.cost.h2d_bytes_per_s
    assert np.allclose(steps[missed], 2 * compute + fetch)
    assert r.tokens_per_s == pytest.approx(100 / steps.sum())
    with pytest.raises(CapacityError, match="geometry"):
        simulate(synthetic_trace(10, 1, 4, 1), gpu_gb=1.0)
    with pytest.raises(CapacityError, match="exactly one"):
        simulate(t)
    with pytest.raises(ValueError, match="unknown fields"):
        simulate(t, gpu_slots=4, cost={"hbm": 1})
