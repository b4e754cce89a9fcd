"""Hand-traced sequences per policy with the exact victims worked out on paper."""

from tierstore.cache.policy import get_policy


def fill(policy, keys, now=0):
    policy.begin_step(now)
    for key in keys:
        policy.on_insert(key)
    return policy


def test_lru():
    p = fill(get_policy("lru"), [1, 2, 3])
    p.on_access(1)
    assert p.victim() == 2 and p.victim({2}) == 3
    assert list(p.eviction_order()) == [2, 3, 1]


def test_lfu_counts_hits_and_breaks_ties_by_age():
    p = fill(get_policy("lfu"), [1, 2, 3])
    for key in (1, 1, 3):
        p.on_access(key)
    assert p.victim() == 2 and p.victim({2}) == 3  # counts 1:3, 2:1, 3:2
    p.on_access(2)
    p.on_access(2)  # 2 now has 3 hits like 1, but is newer
    assert list(p.eviction_order()) == [3, 1, 2]


def test_freq_decays_with_half_life():
    p = fill(get_policy("freq", half_life=1.0), [1, 2, 3])
    p.observe([1, 1, 2])
    assert p.victim() == 3  # heat 1:2, 2:1, 3:0
    p.begin_step(2)
    p.observe([3, 3])  # heat now 1: 0.5, 2: 0.25, 3: 2
    assert list(p.eviction_order()) == [2, 1, 3]
    assert abs(p.heat(1) - 0.5) < 1e-12


def test_need_ignores_routing_and_counts_gate_fires():
    p = fill(get_policy("need"), [1, 2, 3])
    p.record_need([1, 3])
    p.observe([2] * 10)
    assert p.victim() == 2 and p.victim({2}) == 1


def test_class_lru_evicts_lru_of_lowest_class():
    p = fill(get_policy("class-lru", half_life=1e9), [1, 2, 3])  # counts 1 -> class 1
    p.on_access(1)
    p.on_access(1)  # count 3 -> class 2
    p.on_access(2)  # count 2 -> class 1, touched after 3
    assert p.frequency_class(1) == 2 and p.frequency_class(2) == 1
    assert p.victim() == 3 and p.victim({3}) == 2
    assert list(p.eviction_order()) == [3, 2, 1]


def test_static_hot_evicts_unprofiled_then_coldest():
    p = fill(get_policy("static-hot", profile=[5, 1, 2]), [1, 2, 3, 4])
    assert list(p.eviction_order()) == [3, 4, 2, 1]  # 3, 4 unprofiled (LRU), then 2, then 1


def test_belady_furthest_next_use_and_tie_to_larger_key():
    p = fill(get_policy("belady", future=[[1, 2, 3], [1], [3], [2]]), [1, 2, 3])
    assert p.next_use(1) == 1 and p.next_use(3) == 2
    assert p.victim() == 2
    p.on_insert(4)
    p.on_insert(5)
    assert list(p.eviction_order()) == [5, 4, 2, 3, 1]
    p.begin_step(2)  # after step 2 neither 1 nor 3 is used again: the larger key goes first
    assert list(p.eviction_order({5, 4})) == [3, 1, 2]


def test_sieve_hand_clears_bits_and_wraps():
    p = fill(get_policy("sieve"), [1, 2, 3, 4])
    p.on_access(1)
    p.on_access(2)
    assert p.victim() == 3
    p.on_evict(3)  # the hand passed 1 and 2, clearing them
    assert p.visited == {1: False, 2: False, 4: False} and p.hand == 4
    assert p.victim() == 4
    p.on_evict(4)
    assert p.hand is None and p.victim() == 1


def test_sieve_full_lap():
    p = fill(get_policy("sieve"), [7, 8])
    p.on_access(7)
    p.on_access(8)
    assert p.victim() == 7
    p.on_evict(7)
    assert p.visited == {8: False}


def test_s3fifo_small_queue_promotes_and_ghosts():
    p = fill(get_policy("s3fifo"), range(1, 11))
    p.on_access(1)
    assert p.victim() == 2
    p.on_evict(2)  # 1 was hit: moved to main; 2 becomes a ghost
    assert p.main == [1] and 2 in p.ghost and p.small == list(range(3, 11))
    p.on_insert(2)  # a ghost comes back straight into main
    assert p.main == [1, 2] and p.victim() == 3


def test_s3fifo_main_queue_is_a_clock():
    p = fill(get_policy("s3fifo", small_fraction=0.5), [1, 2, 3, 4])
    for key in (1, 2, 3):
        p.on_access(key)
    assert p.victim() == 4
    p.on_evict(4)
    assert p.main == [1, 2, 3] and p.small == [] and p.count == {1: 0, 2: 0, 3: 0}
    for key in (2, 2, 3):
        p.on_access(key)  # counters 1:0, 2:2, 3:1
    assert p.victim() == 1
    assert p.victim({1}) == 3  # 3 is reached at lap 1 (time 5), 2 at lap 2 (time 7)
    p.on_evict(3)
    assert p.count == {1: 0, 2: 0} and p.main == [1, 2]
    assert p.victim() == 1 and p.victim({1}) == 2
