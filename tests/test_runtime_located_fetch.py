"""The step's fetch from located arena rows (`TieredRuntime._fetch_located`): victims planned before the
pass-log read (`DevicePool.plan_victims` / `planned_victims`), rows found by key id (`Arena.locate`,
`hit_ids`) and installed from host addresses (`DevicePool.install_located`). Each piece against the
general path it stands in for, on random states; the runtime end to end against the all-resident run.
CPU everywhere; the pool's install on CUDA too (marker `gpu`)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from test_runtime_fixtures import ToyMoE, memory_source, toy_geometry

from tierstore.cache.arena import Arena
from tierstore.cache.policy import get_policy
from tierstore.runtime import RuntimeConfig, TieredRuntime
from tierstore.runtime.pools import DevicePool

LAYERS, EXPERTS, SLOT = 3, 8, 4096
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _pool(slots: int, device: str = "cpu") -> DevicePool:
    if device != "cpu" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return DevicePool(slots, SLOT, LAYERS, EXPERTS, device, get_policy("lru"), layer_waits=device == "cuda")


def _host_rows(count: int, seed: int, pin: bool = False) -> torch.Tensor:
    """uint8 [count, SLOT] in one host buffer (adjacent rows)."""
    rows = torch.randint(0, 256, (count, SLOT), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    return rows.pin_memory() if pin else rows


def _filled(slots: int, seed: int, device: str = "cpu", filled: int | None = None) -> tuple[DevicePool, list[int]]:
    """A pool of `slots` with `filled` (default all) random keys installed a few at a time and half hit since."""
    rng = random.Random(seed)
    p = _pool(slots, device)
    filled = slots if filled is None else filled
    keys = rng.sample([(l, e) for l in range(LAYERS) for e in range(EXPERTS)], filled)
    rows = _host_rows(filled, seed, pin=device != "cpu")
    for start in range(0, filled, 3):
        p.install(keys[start:start + 3], list(rows[start:start + 3]), exclude=())
    p.wait()
    p.touch(rng.sample(keys, filled // 2), now=1.0)
    return p, [p.key_id(k) for k in keys]


def test_lru_order_is_filtered_by_exclude():
    """The property `filtered_order` promises: excluding keys only removes them from the order."""
    rng = random.Random(3)
    policy = get_policy("lru")
    for key in rng.sample(range(100), 40):
        policy.on_insert(key)
    policy.on_access_many(rng.sample(sorted(policy.sizes), 15))
    policy.pin(sorted(policy.sizes)[0])
    exclude = set(rng.sample(sorted(policy.sizes), 10))
    assert policy.filtered_order
    assert list(policy.eviction_order(exclude)) == [k for k in policy.eviction_order() if k not in exclude]
    assert not get_policy("sieve").filtered_order  # a sweeping order is not a filter: never planned


def _mask(ids) -> np.ndarray:
    """int32 [L * E], nonzero at `ids` (like the pass log's routed counts)."""
    mask = np.zeros(LAYERS * EXPERTS, dtype=np.int32)
    mask[list(ids)] = 3
    return mask


@pytest.mark.parametrize("seed", range(5))
def test_planned_victims_equal_the_walk_of_the_policy(seed):
    p, ids = _filled(12, seed)
    rng = random.Random(seed)
    routed = set(rng.sample(ids, 5) + rng.sample(range(LAYERS * EXPERTS), 3))
    count = rng.randint(1, 6)
    p.plan_victims(count + len(routed))
    victims, slots = p.planned_victims(_mask(routed), count)
    assert victims == p.evictable_ids(routed, count)
    assert slots == [p.slot_of(divmod(v, EXPERTS)) for v in victims]
    assert p.planned_victims(_mask(routed), count) is None  # a plan is used once


def test_a_plan_goes_stale_when_the_policy_or_the_free_slots_change():
    p, ids = _filled(12, seed=1)
    none = _mask([])
    p.plan_victims(20)
    p.touch_ids(np.array([ids[0]], dtype=np.int64), now=2.0)  # a hit reaches the policy
    assert p.planned_victims(none, 1) is None
    p.plan_victims(20)
    assert p.planned_victims(none, 1)[0] == p.evictable_ids(set(), 1)
    p.plan_victims(2)
    assert p.planned_victims(_mask(p.evictable_ids(set(), 2)), 1) is None  # too short to tell
    q, _ = _filled(12, seed=1, filled=9)
    q.plan_victims(20)
    absent = next((layer, expert) for layer in range(LAYERS) for expert in range(EXPERTS)
                  if not q.is_resident((layer, expert)))
    q.install([absent], [_host_rows(1, seed=2)[0]], exclude=())
    assert q.planned_victims(none, 1) is None  # an install took a free slot (and changed the policy)


def test_arena_locates_rows_by_id_and_records_their_use_only_when_told():
    g = toy_geometry(layers=LAYERS, experts=EXPERTS)
    source = memory_source(g, seed=2)
    arena = Arena(source, num_slots=4, pin=False)
    keys = [(0, 1), (1, 3), (2, 5), (2, 6)]
    arena.fetch(keys)
    ids = [layer * EXPERTS + expert for layer, expert in keys]
    addresses = arena.locate(ids)
    base = arena.memory.data_ptr()
    for (layer, expert), address in zip(keys, addresses):
        row = arena.memory[address - base:address - base + source.row_bytes]
        assert torch.equal(row, source.rows[layer, expert].reshape(-1)[:source.row_bytes])
    assert arena.locate([ids[0], 0]) is None  # (0, 0) is not in the arena
    hits = arena.row_counts()[0]
    arena.hit_ids([ids[0]])  # (0, 1) becomes the most recently used: the next read evicts (1, 3)
    assert arena.row_counts()[0] == hits + 1
    arena.fetch([(0, 0)])
    assert (1, 3) not in arena and (0, 1) in arena
    assert arena.locate(ids[1:2]) is None and arena.locate([0]) is not None


@pytest.mark.parametrize("device", DEVICES)
def test_install_located_equals_install(device):
    """Same keys, rows and victims through `install` and `install_located`: same slots, tables, owners,
    policy and bytes; rows adjacent on the host into consecutive free slots go as one copy."""
    results = []
    for located in (False, True):
        p, _ = _filled(12, seed=4, device=device, filled=10)  # 2 free slots, then 3 victims
        ids = sorted(set(range(LAYERS * EXPERTS)) - set(p.policy.sizes))[:5]
        rows = _host_rows(5, seed=9, pin=device != "cpu")
        victims = p.evictable_ids(set(), 5 - p.num_free)
        keys = [divmod(i, EXPERTS) for i in ids]
        p.slots.fill_(0)  # poison: the new keys' bytes must come from the install
        if located:
            addresses = [rows.data_ptr() + i * SLOT for i in range(5)]
            p.install_located(ids, addresses, SLOT, victims, [p.slot_of(divmod(v, EXPERTS)) for v in victims])
        else:
            p.install(keys, list(rows), exclude=(), victims=victims)
        p.wait()
        p.check_coherent()
        for key, row in zip(keys, rows):
            assert torch.equal(p.slots[p.slot_of(key)].cpu(), row.cpu())
        results.append((p.mirror.copy(), p.owner.copy(), list(p.policy.eviction_order()), p.copies))
    (mirror, owner, order, _), (mirror2, owner2, order2, _) = results
    assert np.array_equal(mirror, mirror2) and np.array_equal(owner, owner2) and order == order2


def test_install_located_merges_adjacent_rows_into_one_copy_per_layer():
    p = _pool(8)
    rows = _host_rows(4, seed=5)
    ids = [0, 1, EXPERTS, EXPERTS + 1]  # two layers, two rows each
    before = p.copies
    p.install_located(ids, [rows.data_ptr() + i * SLOT for i in range(4)], SLOT, [], [])
    assert p.copies - before == 2  # adjacent bytes and slots merge, but not across a layer
    for key_id, row in zip(ids, rows):
        assert torch.equal(p.slots[p.slot_of(divmod(key_id, EXPERTS))], row)


def test_install_located_refuses_a_wrong_victim_count_and_changes_nothing():
    p, _ = _filled(10, seed=6)
    mirror = p.mirror.copy()
    ids = sorted(set(range(LAYERS * EXPERTS)) - set(p.policy.sizes))[:3]
    victims = p.evictable_ids(set(), 1)
    with pytest.raises(ValueError, match="need 3 victims, got 1"):
        p.install_located(ids, [0, 0, 0], SLOT, victims, [p.slot_of(divmod(victims[0], EXPERTS))])
    assert np.array_equal(p.mirror, mirror)


@pytest.mark.parametrize("tokens_per_step", [1, 3])
def test_runtime_takes_the_located_fetch_and_equals_the_resident_run(monkeypatch, tokens_per_step):
    """An arena that holds every row: once it is filled every step's fetch goes by located rows, and every
    step equals the all-resident run bit for bit, with the pool's bytes and tables exact after each."""
    located = []
    original = TieredRuntime._fetch_located

    def spy(self, report):
        installed = original(self, report)
        located.append(installed)
        return installed
    monkeypatch.setattr(TieredRuntime, "_fetch_located", spy)
    g = toy_geometry(layers=4, experts=16)
    model = ToyMoE(g, seed=3)
    config = RuntimeConfig(kpi_every=0, tokens_per_step=tokens_per_step)
    resident = TieredRuntime(g, memory_source(g, seed=7), pool_slots=g.total_routed_experts, config=config)
    resident.preload()
    source = memory_source(g, seed=7)
    small = TieredRuntime(g, source, pool_slots=32, arena_slots=g.total_routed_experts, config=config)
    with resident, small:
        small.arena.fetch([(l, e) for l in range(4) for e in range(16)], scan=True)  # every row in the arena
        for step in range(40):
            x = torch.randn(tokens_per_step, g.hidden, generator=torch.Generator().manual_seed(step)) * 3
            want, _ = resident.step(lambda: model.forward(resident, x), lambda: None)
            got, _ = small.step(lambda: model.forward(small, x), lambda: None)
            assert torch.equal(got, want), f"step {step} differs from the all-resident run"
            small.pool.check_coherent()
            for slot, (layer, expert) in enumerate(small.pool.owner.tolist()):
                if layer >= 0:
                    assert torch.equal(small.pool.slots[slot], source.rows[layer, expert])
        stats = small.stats()
    assert stats.replayed_steps > 10
    assert None not in located and sum(1 for n in located if n) >= stats.replayed_steps
    assert stats.located_rows == sum(located) and stats.fetched_rows >= stats.located_rows > 0
