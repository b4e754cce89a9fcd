"""`freq-dense` against `freq`: the same eviction order under random traffic (bit for bit where every decay factor
is a power of two), the same hits on the golden trace, and the runtime's knob that gives it a half-life."""

import random
from pathlib import Path

import numpy as np
import pytest
from test_runtime_fixtures import memory_source, toy_geometry

from tierstore.cache.policies import freq_dense
from tierstore.cache.policies.freq_dense import DenseFrequencyPolicy
from tierstore.cache.policy import get_decaying_policy, get_policy
from tierstore.errors import ConfigError
from tierstore.runtime import RuntimeConfig, TieredRuntime
from tierstore.sim import load_trace, simulate

GOLDEN = Path(__file__).parent / "golden"


def drive(policies, seed: int, steps: int = 300, keys: int = 40, capacity: int = 14, batched: bool = False):
    """The same random traffic into every policy: per step, routed keys (some twice) observed, hits, misses
    installed over victims outside the step's keys, now and then a pin, an unpin or a removal; yields
    (step, excluded keys) after each step, for the caller to compare the policies."""
    rng = random.Random(seed)
    resident: set[int] = set()
    now = 0
    for step in range(steps):
        now += rng.choice((0, 1, 1, 3))  # whole-number times, some steps at the same time, some further apart
        routed = rng.sample(range(keys), rng.randint(1, 6))
        observed = routed + rng.sample(routed, rng.randint(0, len(routed)))  # repeats count twice
        hits = [k for k in routed if k in resident]
        misses = [k for k in routed if k not in resident]
        for policy in policies:
            policy.begin_step(now)
            policy.observe(observed)
        for policy in policies:
            policy.on_access_many(hits) if batched else [policy.on_access(k) for k in hits]
        room = capacity - len(resident)
        if len(misses) > room:
            wanted = len(misses) - room
            victims = [policies[0].victims(wanted, set(routed))]
            victims += [p.victims(wanted, set(routed)) for p in policies[1:]]
            assert all(v == victims[0] for v in victims), f"step {step}: victims differ: {victims}"
            for policy in policies:
                policy.on_evict_many(victims[0]) if batched else [policy.on_evict(k) for k in victims[0]]
            resident.difference_update(victims[0])
        for policy in policies:
            policy.on_insert_many(misses) if batched else [policy.on_insert(k) for k in misses]
        resident.update(misses)
        choice = rng.random()
        if choice < 0.05 and resident:
            gone = rng.choice(sorted(resident))
            for policy in policies:
                policy.on_remove(gone)
            resident.discard(gone)
        elif choice < 0.10 and resident:
            pinned = rng.choice(sorted(resident))
            for policy in policies:
                policy.pin(pinned)
        elif choice < 0.15:
            for policy in policies:
                for key in list(policy.pinned):
                    policy.unpin(key)
        yield step, set(rng.sample(range(keys), rng.randint(0, 5)))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("batched", [False, True])
def test_order_and_counts_equal_freq_bit_for_bit_with_power_of_two_decays(seed, batched):
    reference, dense = get_policy("freq", half_life=1.0), get_policy("freq-dense", half_life=1.0)
    for step, exclude in drive([reference, dense], seed, batched=batched):
        assert list(dense.eviction_order(exclude)) == list(reference.eviction_order(exclude)), f"step {step}"
        assert dense.victim(exclude) == reference.victim(exclude)
        assert dict(dense.sizes) == dict(reference.sizes) and dense.pinned == reference.pinned
        for key in range(40):  # the decayed counts themselves, exactly
            assert dense.heat(key) == reference.heat(key), f"step {step}, key {key}"


def test_order_equals_freq_with_an_everyday_half_life():
    reference, dense = get_policy("freq", half_life=256.0), get_policy("freq-dense", half_life=256.0)
    for step, exclude in drive([reference, dense], seed=9, steps=400):
        assert list(dense.eviction_order(exclude)) == list(reference.eviction_order(exclude)), f"step {step}"
        assert np.allclose([dense.heat(k) for k in range(40)], [reference.heat(k) for k in range(40)], rtol=1e-12)


def test_a_large_pool_orders_as_freq_past_its_first_victims():
    rng = random.Random(3)
    reference, dense = get_policy("freq", half_life=1.0), get_policy("freq-dense", half_life=1.0)
    for now in range(6):
        routed = [rng.randrange(1500) for _ in range(900)]  # many repeats: many keys tie on heat
        for policy in (reference, dense):
            policy.begin_step(now)
            policy.observe(routed)
    fresh = rng.sample(range(1500), 1000)
    for policy in (reference, dense):
        policy.on_insert_many(fresh)
        policy.on_access_many(fresh[::7])
    exclude = set(rng.sample(range(1500), 50))
    order = dense.eviction_order(exclude)
    dense.on_access_many(fresh[:300])  # after the order was asked: it is the order as of the ask
    assert list(order) == list(reference.eviction_order(exclude))
    reference.on_access_many(fresh[:300])
    assert list(dense.eviction_order()) == list(reference.eviction_order())
    assert dense.victims(40, exclude) == reference.victims(40, exclude)


class FreshlySorted(DenseFrequencyPolicy):
    """`freq-dense` that sorts its resident keys afresh on every order (no order kept between calls)."""

    def _resident_order(self):
        self._order = None
        return super()._resident_order()


@pytest.mark.parametrize("half_life", [2.7, 1e-3])  # 1e-3: counts decay to zero and tie, the kept order goes stale
@pytest.mark.parametrize("seed", range(3))
def test_the_kept_order_equals_a_fresh_sort_of_the_same_state(seed, half_life, monkeypatch):
    monkeypatch.setattr(freq_dense, "_MERGE_FROM", 0)  # merge at this small pool's size too
    kept, fresh = DenseFrequencyPolicy(half_life=half_life), FreshlySorted(half_life=half_life)
    rng = random.Random(seed)
    for step, exclude in drive([kept, fresh], seed, steps=400, batched=True):
        for _ in range(rng.randint(0, 2)):  # some steps ask more than once, some never
            assert list(kept.eviction_order(exclude)) == list(fresh.eviction_order(exclude)), f"step {step}"
        assert kept.victim() == fresh.victim()


def test_a_count_raised_without_a_hit_is_ordered_by_its_older_touch(monkeypatch):
    monkeypatch.setattr(freq_dense, "_MERGE_FROM", 0)
    policy = get_policy("freq-dense", half_life=1e30)
    policy.on_insert_many([5, 9])  # 5 touched first
    policy.observe([9])
    assert list(policy.eviction_order()) == [5, 9]  # heats 0 < 1
    policy.observe([5])  # heats tie at 1: the older touch, 5, goes first (the kept order had 9 after 5 by heat)
    assert list(policy.eviction_order()) == [5, 9]
    policy.observe([5])
    assert list(policy.eviction_order()) == [9, 5]
    policy.on_access(9)
    policy.observe([9])  # tie again: 5 is now the older touch
    assert list(policy.eviction_order()) == [5, 9]


@pytest.mark.parametrize("slots", [6, 16, 32, 48])
def test_golden_trace_hits_equal_freq(slots):
    trace = load_trace(GOLDEN / "trace.npz")
    got = simulate(trace, gpu_slots=slots, policy="freq-dense", fast=False)
    want = simulate(trace, gpu_slots=slots, policy="freq", fast=False)
    assert int(got.counters["hit_pairs"].sum()) == int(want.counters["hit_pairs"].sum())
    assert np.array_equal(got.counters["miss_keys"], want.counters["miss_keys"])


def test_counts_survive_eviction_and_rank_the_key_on_return():
    policy = get_policy("freq-dense")
    policy.begin_step(0.0)
    policy.observe([7, 7, 7, 3])
    policy.on_insert_many([7, 3])
    policy.on_evict_many([7])
    policy.on_insert(9)
    policy.on_insert(7)  # back, with its three routings
    assert policy.heat(7) == 3.0 and list(policy.eviction_order()) == [9, 3, 7]


def test_a_batch_of_repeated_hits_ticks_the_clock_once_per_hit_as_single_hooks_do():
    one, many = get_policy("freq-dense"), get_policy("freq-dense")
    for policy in (one, many):
        policy.on_insert_many([1, 2, 3])
    for key in (3, 1, 3, 3):
        one.on_access(key)
    many.on_access_many([3, 1, 3, 3])
    for policy in (one, many):
        policy.on_insert(4)  # its touch comes after every hit's
        policy.on_access(2)
    assert list(many.eviction_order()) == list(one.eviction_order()) == [1, 3, 4, 2]
    assert many._clock == one._clock and np.array_equal(many._touch[:5], one._touch[:5])


def test_keys_beyond_the_arrays_and_bad_keys():
    policy = get_policy("freq-dense")
    policy.on_insert(5000)  # grows the arrays
    policy.observe([6000])
    assert list(policy.eviction_order({6000, 10**9})) == [5000] and policy.heat(6000) == 1.0
    with pytest.raises(ValueError, match="non-negative"):
        policy.observe([-1])
    with pytest.raises(ValueError, match="non-negative"):
        policy.on_insert(-1)
    assert -1 not in policy and list(policy.eviction_order()) == [5000]
    with pytest.raises(ValueError, match="half_life must be positive"):
        get_policy("freq-dense", half_life=0)


def test_get_decaying_policy_gives_a_half_life_only_where_the_policy_takes_one():
    assert get_decaying_policy("freq-dense", 7.5).half_life == 7.5
    assert get_decaying_policy("freq", 3.0).counter.half_life == 3.0
    assert type(get_decaying_policy("lru", 3.0)).__name__ == "LRUPolicy"


def test_runtime_passes_policy_half_life_to_its_pool():
    g = toy_geometry(layers=2, experts=8)
    config = RuntimeConfig(policy="freq-dense", policy_half_life_s=12.0, kpi_every=0)
    with TieredRuntime(g, memory_source(g, seed=1), pool_slots=8, config=config) as runtime:
        assert runtime.pool.policy.name == "freq-dense" and runtime.pool.policy.half_life == 12.0
    with pytest.raises(ConfigError, match="policy_half_life_s must be > 0"):
        RuntimeConfig(policy_half_life_s=0)


def test_generate_cli_defaults_to_the_runtime_configs_policy():
    import argparse

    from tierstore.commands.generate import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["generate", "ckpt", "--prompt", "x"])
    assert args.policy == RuntimeConfig().policy == "freq-dense"
