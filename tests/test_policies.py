"""Contract suite: every registered policy obeys the EvictionPolicy protocol."""

import copy
import random

import pytest

from tierstore.cache.policy import (
    EvictionPolicy,
    UnknownPolicyError,
    expert_key,
    get_policy,
    policy_names,
    register_policy,
    split_key,
)
from tierstore.errors import CapacityError

KEYS = list(range(12))
PARAMS = {
    "belady": lambda: {"future": [random.Random(s).sample(KEYS, 4) for s in range(40)]},
    "static-hot": lambda: {"profile": {k: (k * 7) % 5 for k in KEYS}},
}


def make(name: str) -> EvictionPolicy:
    return get_policy(name, **PARAMS.get(name, dict)())


def filled(name: str, sizes=None) -> EvictionPolicy:
    policy = make(name)
    policy.begin_step(0)
    rng = random.Random(name)
    for key in KEYS:
        policy.on_insert(key, (sizes or {}).get(key, 1))
    for step in range(1, 6):
        policy.begin_step(step)
        touched = rng.sample(KEYS, 4)
        policy.observe(touched)
        for key in touched:
            policy.on_access(key)
    return policy


ALL = policy_names()


def test_builtin_policies_registered():
    assert set(ALL) >= {"lru", "lfu", "freq", "need", "class-lru", "s3fifo", "sieve", "static-hot", "belady"}


@pytest.mark.parametrize("name", ALL)
def test_victim_is_resident_and_not_excluded(name):
    policy = filled(name)
    exclude = frozenset(KEYS[:5])
    victim = policy.victim(exclude)
    assert victim in policy and victim not in exclude
    assert policy.victim(frozenset(KEYS)) is None


@pytest.mark.parametrize("name", ALL)
def test_pinned_entries_skipped(name):
    policy = filled(name)
    first = policy.victim()
    policy.pin(first)
    assert policy.victim() not in (first, None)
    for key in KEYS:
        policy.pin(key)
    assert policy.victim() is None
    policy.unpin(first)
    assert policy.victim() == first


@pytest.mark.parametrize("name", ALL)
def test_victim_choice_is_side_effect_free(name):
    policy = filled(name)
    twin = copy.deepcopy(policy)
    answers = {policy.victim(frozenset(KEYS[i:i + 3])) for i in range(0, 9)}
    assert answers <= set(KEYS)
    assert policy.victim() == policy.victim() == twin.victim()
    assert list(policy.eviction_order()) == list(twin.eviction_order())
    evicted = []
    for p in (policy, twin):
        order = []
        while (v := p.victim()) is not None:
            order.append(v)
            p.on_evict(v)
        evicted.append(order)
    assert evicted[0] == evicted[1] and sorted(evicted[0]) == KEYS


@pytest.mark.parametrize("name", ALL)
def test_eviction_order_starts_with_victim(name):
    policy = filled(name)
    exclude = frozenset({KEYS[3], KEYS[7]})
    order = list(policy.eviction_order(exclude))
    assert order[0] == policy.victim(exclude)
    assert sorted(order) == sorted(set(KEYS) - exclude)


@pytest.mark.parametrize("name", ALL)
def test_removed_entry_gone(name):
    policy = filled(name)
    gone = policy.victim()
    policy.on_remove(gone)
    assert gone not in policy and len(policy) == len(KEYS) - 1
    assert gone not in policy.eviction_order()
    with pytest.raises(KeyError):
        policy.on_access(gone)
    with pytest.raises(KeyError):
        policy.on_remove(gone)
    policy.on_insert(gone)
    assert gone in policy


@pytest.mark.parametrize("name", ALL)
def test_double_insert_and_bad_size_rejected(name):
    policy = filled(name)
    with pytest.raises(KeyError):
        policy.on_insert(KEYS[0])
    with pytest.raises(ValueError):
        policy.on_insert(99, size=0)


@pytest.mark.parametrize("name", ALL)
def test_sizes_respected(name):
    sizes = {k: 1 + k % 4 for k in KEYS}
    policy = filled(name, sizes)
    assert policy.used == sum(sizes.values())
    chosen = policy.victims(7)
    assert chosen == list(policy.eviction_order())[: len(chosen)]
    freed = sum(sizes[k] for k in chosen)
    assert freed >= 7 and freed - sizes[chosen[-1]] < 7
    with pytest.raises(CapacityError):
        policy.victims(policy.used + 1)


@pytest.mark.parametrize("name", ALL)
def test_random_operations_keep_bookkeeping_consistent(name):
    rng = random.Random(1234)
    policy = make(name)
    resident = set()
    for step in range(60):
        policy.begin_step(step)
        key = rng.choice(KEYS)
        if key in resident:
            if rng.random() < 0.3:
                policy.on_remove(key)
                resident.discard(key)
            else:
                policy.on_access(key)
        else:
            policy.on_insert(key)
            resident.add(key)
        if len(resident) > 6:
            victim = policy.victim(frozenset({key}))
            assert victim in resident and victim != key
            policy.on_evict(victim)
            resident.discard(victim)
        assert set(policy.sizes) == resident
        assert sorted(policy.eviction_order()) == sorted(resident)


def test_unknown_policy_lists_names():
    with pytest.raises(UnknownPolicyError, match="registered: .*lru"):
        get_policy("nope")
    with pytest.raises(UnknownPolicyError, match="bad parameters"):
        get_policy("lru", half_life=3)


def test_user_policy_registration():
    @register_policy("test-mru")
    class MRU(EvictionPolicy):
        name = "test-mru"

        def eviction_order(self, exclude=frozenset()):
            return (k for k in reversed(list(self.sizes)) if self.evictable(k, exclude))

    policy = get_policy("test-mru")
    for key in (4, 5, 6):
        policy.on_insert(key)
    assert policy.victim() == 6 and "test-mru" in policy_names()
    with pytest.raises(UnknownPolicyError, match="already registered"):
        register_policy("test-mru", EvictionPolicy)


def test_expert_key_roundtrip_and_bounds():
    assert expert_key(3, 5, 64) == 197 and split_key(197, 64) == (3, 5)
    with pytest.raises(ValueError):
        expert_key(0, 64, 64)


def policy_state(policy: EvictionPolicy) -> tuple:
    return dict(policy.sizes), set(policy.pinned), policy.version, list(policy.eviction_order())


def singly(policy: EvictionPolicy, victims: list[int], accessed: list[int]) -> None:
    for key in victims:
        policy.on_evict(key)
    for key in victims:
        policy.on_insert(key)
    for key in accessed:
        policy.on_access(key)


def batched(policy: EvictionPolicy, victims: list[int], accessed: list[int]) -> None:
    policy.on_evict_many(victims)
    policy.on_insert_many(victims)
    policy.on_access_many(accessed)


@pytest.mark.parametrize("name", ALL)
def test_batch_hooks_leave_the_state_the_single_hooks_leave(name):
    one, many = filled(name), filled(name)
    one.pin(KEYS[-1])
    many.pin(KEYS[-1])
    victims = list(one.eviction_order())[:3]
    accessed = [KEYS[5], KEYS[1], KEYS[-1], KEYS[5]]
    singly(one, victims, accessed)
    batched(many, victims, accessed)
    assert policy_state(many) == policy_state(one)


@pytest.mark.parametrize("name", ALL)
def test_batch_hooks_raise_where_the_single_hooks_raise(name):
    one, many = filled(name), filled(name)
    for hook, keys in (("on_access", [KEYS[2], 99, KEYS[3]]), ("on_evict", [KEYS[4], 99, KEYS[6]]),
                       ("on_insert", [100, KEYS[7], 101])):
        with pytest.raises(KeyError) as single_error:
            for key in keys:
                getattr(one, hook)(key)
        with pytest.raises(KeyError) as batch_error:
            getattr(many, f"{hook}_many")(keys)
        assert str(batch_error.value) == str(single_error.value)
        assert policy_state(many) == policy_state(one)


def test_a_subclass_of_lru_gets_its_own_single_hooks_in_a_batch():
    lru = get_policy("lru")

    class CountingLRU(type(lru)):
        def on_access(self, key: int) -> None:
            self.counted = getattr(self, "counted", 0) + 1
            super().on_access(key)

    policy = CountingLRU()
    policy.on_insert_many([1, 2, 3])
    policy.on_access_many([3, 1])
    assert policy.counted == 2 and list(policy.eviction_order()) == [2, 3, 1]
