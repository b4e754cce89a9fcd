"""The host side of a no-miss step: the pass log read as one buffer, and the LRU pool's deferred
hits, which must leave the policy exactly where per-key `on_access` calls would."""

import numpy as np
import pytest
import torch

from tierstore.cache.policy import get_policy
from tierstore.runtime.passlog import PassLog
from tierstore.runtime.pools import DevicePool

SLOT = 64
LAYERS, EXPERTS = 3, 8


def test_pass_log_read_matches_the_device_tensors_and_reset_keeps_entries():
    log = PassLog(LAYERS, EXPERTS, top_k=2, capacity=5, device="cpu", record_tokens=2)
    log.reset()
    log.record(0, torch.tensor([[1, 4], [4, 6]]))
    log.record(2, torch.tensor([[7, 0]]))
    log.entries[:2] = torch.tensor([[0, 4], [2, 7]], dtype=torch.int32)
    log.counts[:] = torch.tensor([3, 7], dtype=torch.int32)  # 7 experts missed, 5 logged at most
    report = log.read()
    assert (report.missing_pairs, report.unlogged_experts) == (3, 2)
    assert report.missing_keys[:2] == ((0, 4), (2, 7))
    assert report.routed_keys == tuple(map(tuple, torch.argwhere(log.seen > 0).tolist()))
    assert report.routed_keys == ((0, 1), (0, 4), (0, 6), (2, 0), (2, 7))
    assert report.routed_ids.tolist() == [1, 4, 6, 16, 23]
    assert torch.equal(torch.from_numpy(report.routing), log.routing)
    log.reset()
    assert not log.counts.any() and not log.seen.any()
    assert log.entries[1].tolist() == [2, 7]  # entries are overwritten by the next misses, never cleared


def test_no_miss_pass_reports_nothing_missing():
    log = PassLog(LAYERS, EXPERTS, top_k=2, capacity=4, device="cpu")
    log.reset()
    log.record(1, torch.tensor([[2, 3]]))
    report = log.read()
    assert (report.missing_pairs, report.missing_keys, report.unlogged_experts) == (0, (), 0)
    assert report.routing is None and report.routed_keys == ((1, 2), (1, 3))


def eager_lru(pool: DevicePool, reference, steps_hits: list[np.ndarray]) -> None:
    """What the per-key path did: on_access for every resident routed key, in ascending order."""
    for hits in steps_hits:
        for key_id in hits.tolist():
            if key_id in reference:
                reference.on_access(key_id)


def test_deferred_lru_hits_give_exactly_the_per_key_order():
    rng = np.random.default_rng(3)
    p = DevicePool(10, SLOT, LAYERS, EXPERTS, "cpu", get_policy("lru"))
    reference = get_policy("lru")
    assert p._deferred_hits
    rows = torch.zeros(LAYERS * EXPERTS, SLOT, dtype=torch.uint8)
    for step in range(200):
        routed = np.unique(rng.choice(LAYERS * EXPERTS, size=rng.integers(1, 6), replace=False))
        p.touch_ids(routed, float(step))
        eager_lru(p, reference, [routed])
        if step % 3 == 0:  # install the missing routed keys: reads the policy (victims, inserts)
            keys = [divmod(int(k), EXPERTS) for k in routed if not p.is_resident(divmod(int(k), EXPERTS))]
            victims = reference.victims(max(0, len(keys) - p.num_free), {int(k) for k in routed})
            p.install(keys, [rows[0]] * len(keys), exclude=[divmod(int(k), EXPERTS) for k in routed])
            for victim in victims:
                reference.on_evict(victim)
            for key in keys:
                reference.on_insert(key[0] * EXPERTS + key[1])
        assert list(p.policy.eviction_order()) == list(reference.eviction_order()), f"step {step}"
        p.check_coherent()


def test_touch_of_keys_equals_touch_of_ids():
    by_keys = DevicePool(4, SLOT, LAYERS, EXPERTS, "cpu", get_policy("lru"))
    by_ids = DevicePool(4, SLOT, LAYERS, EXPERTS, "cpu", get_policy("lru"))
    keys = [(0, 1), (1, 2), (2, 3), (0, 5)]
    row = torch.zeros(SLOT, dtype=torch.uint8)
    for p in (by_keys, by_ids):
        p.install(keys, [row] * 4, exclude=keys)
    by_keys.touch([(2, 3), (0, 1)], 1.0)
    by_ids.touch_ids(np.array([1, 19]), 1.0)
    assert list(by_keys.policy.eviction_order()) == list(by_ids.policy.eviction_order()) == [10, 5, 1, 19]


def test_other_policies_get_observe_and_hits_at_once():
    p = DevicePool(4, SLOT, LAYERS, EXPERTS, "cpu", get_policy("lfu"))
    assert not p._deferred_hits
    row = torch.zeros(SLOT, dtype=torch.uint8)
    p.install([(0, 1), (0, 2)], [row] * 2, exclude=[])
    p.touch_ids(np.array([1, 1 + EXPERTS]), 1.0)
    assert list(p.policy.eviction_order())[-1] == 1  # (0, 1) was hit; (1, 1) was not resident


def test_routed_ids_are_computed_late_but_from_their_own_pass():
    """A report's routed ids wait until asked for, and the log's next read computes them first, before it
    overwrites the host copy they come from: a report read earlier keeps its own pass's ids."""
    log = PassLog(LAYERS, EXPERTS, top_k=2, capacity=4, device="cpu")
    log.reset()
    log.record(0, torch.tensor([[1, 4]]))
    first = log.read()
    assert "routed_ids" not in first.__dict__  # not computed by the read itself
    log.reset()
    log.record(2, torch.tensor([[3, 5]]))
    second = log.read()
    assert "routed_ids" in first.__dict__  # the second read computed it before its copy
    assert first.routed_ids.tolist() == [1, 4] and second.routed_ids.tolist() == [19, 21]
    assert first.routed_keys == ((0, 1), (0, 4)) and second.routed_id_set == frozenset({19, 21})


@pytest.mark.parametrize("slots, told", [(48, False), (12, True)])
def test_only_a_pool_that_can_evict_tells_its_policy_what_steps_routed(monkeypatch, slots, told):
    """A pool holding every expert never evicts, so its steps skip the policy's bookkeeping (host work at full
    coverage); a pool that can evict hears of every decode step's routed experts, once each."""
    from test_runtime_fixtures import ToyMoE, arena_runtime, toy_geometry

    g = toy_geometry()
    rt, _ = arena_runtime(g, slots, 0, full_pool_reads=True)  # every step read: its routed experts known
    touched = []
    monkeypatch.setattr(rt.pool, "touch_ids", lambda ids, now: touched.append(ids.tolist()))
    model = ToyMoE(g)
    x = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(3))
    routed = []
    with rt:
        rt.preload([(layer, expert) for layer in range(g.num_moe_layers) for expert in range(g.num_experts)][:slots])
        for _ in range(5):
            x, outcome = rt.step(lambda x=x: model.forward(rt, x), lambda: None)
            routed.append(outcome.last_pass.routed_ids.tolist())
            x = x / x.norm()
        rt.settle()
    assert touched == (routed if told else [])
