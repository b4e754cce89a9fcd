"""The host arena's `freq-dense` policy: it evicts the row asked for least (decayed), never a row its batch uses,
and writes its hot set hottest first; the runtime's knob `arena_policy`. The arena's invariants under both policies
(eviction stress, scan, preheat, faults) are in test_arena.py."""

import pytest
import torch
from pack_helpers import shake_row, write_shake_pack

from tierstore.cache.arena import Arena
from tierstore.cache.frequency_slots import FrequencySlotTable
from tierstore.errors import ConfigError
from tierstore.io.layout import PackSpec
from tierstore.io.pack_rows import PackRows
from tierstore.io.readers import MemoryReader
from tierstore.runtime import RuntimeConfig

LAYERS, EXPERTS, ROW_BYTES = 1, 9, 5000


def row(layer, expert):
    return shake_row(layer, expert, ROW_BYTES)


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    spec = PackSpec(tag="base", num_layers=LAYERS, num_experts=EXPERTS, row_bytes=ROW_BYTES,
                    checkpoint_id="arena-policy-test", abi_tag="w2-test", zero_mode="auto")
    return write_shake_pack(tmp_path_factory.mktemp("pack"), spec)


def arena(pack, slots, policy):
    return Arena(PackRows(pack, MemoryReader.from_file(pack.path)), slots, policy=policy)


@pytest.mark.parametrize("policy, hits", [("lru", [0] * 13), ("freq-dense", [0] * 6 + [1, 0, 0, 1, 0, 0, 1])])
def test_the_row_asked_for_most_stays_where_lru_drops_it(pack, policy, hits):
    # the simulator's case (test_sim.py): expert 0 asked every third fetch among experts asked once, 2 slots
    cache = arena(pack, 2, policy)
    seen = []
    for expert in [0, 1, 2, 0, 3, 4, 0, 5, 6, 0, 7, 8, 0]:
        before = cache.stats().hit_rows
        (got,) = cache.fetch([(0, expert)])
        assert bytes(got.numpy()) == row(0, expert)
        seen.append(cache.stats().hit_rows - before)
    assert seen == hits


def test_a_batch_never_evicts_a_row_it_uses_however_cold(pack):
    cache = arena(pack, 2, "freq-dense")
    cache.fetch([(0, 1)])
    cache.fetch([(0, 2)])
    cache.fetch([(0, 1)])  # expert 1 asked twice: the hotter
    views = cache.fetch([(0, 3), (0, 2)])  # expert 2 is in the batch: the hot expert 1 goes
    assert [bytes(v.numpy()) for v in views] == [row(0, 3), row(0, 2)]
    assert (0, 1) not in cache and (0, 2) in cache and (0, 3) in cache
    assert cache.stats().evictions == 1


def test_counts_decay_so_a_row_asked_for_recently_outranks_one_asked_for_long_ago():
    now = [0.0]
    table = FrequencySlotTable(2, EXPERTS, half_life_s=1.0, clock=lambda: now[0])
    for key, slot in (((0, 1), table.take_free()), ((0, 2), table.take_free())):
        table.hit_many([key])  # asked for (a miss), then published
        table.publish(key, slot)
    table.hit_many([(0, 1)])  # expert 1: asked twice at t = 0
    now[0] = 10.0
    table.hit_many([(0, 2)])  # expert 2: asked twice, the second time at t = 10
    assert table.hottest_first() == [(0, 2), (0, 1)]
    now[0] = 11.0
    assert table.hit_many([(0, 3)]) == {}
    slot = table.evict(busy=set())  # expert 1's counts have halved ten times
    assert (0, 1) not in table and (0, 2) in table and slot is not None
    table.publish((0, 3), slot)
    assert table.evict(busy={table.hit((0, 2)), slot}) is None  # every slot busy: nothing to evict
    table.clear()
    assert len(table) == 0 and table.num_free == 2 and table.hottest_first() == []


def test_bad_policies_are_refused(pack):
    with pytest.raises(ValueError, match="arena policy must be one of lru, freq-dense"):
        arena(pack, 2, "sieve")
    with pytest.raises(ValueError, match="half_life_s must be positive"):
        Arena(PackRows(pack, MemoryReader.from_file(pack.path)), 2, policy="freq-dense", half_life_s=0)


def test_the_runtime_knob():
    import argparse

    from tierstore.commands.generate import register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["generate", "ckpt", "--prompt", "x"]).arena_policy == RuntimeConfig().arena_policy
    assert parser.parse_args(["generate", "ckpt", "--prompt", "x", "--arena-policy", "freq-dense"]).arena_policy \
        == "freq-dense"
    assert RuntimeConfig().arena_policy == "lru"
    assert RuntimeConfig.from_env({"TIERSTORE_ARENA_POLICY": "freq-dense"}).arena_policy == "freq-dense"
    with pytest.raises(ConfigError, match="arena_policy"):
        RuntimeConfig(arena_policy="sieve")


def test_a_runtime_with_an_evicting_frequency_arena_returns_the_all_resident_logits():
    from test_runtime_fixtures import ToyMoE, arena_runtime, toy_geometry

    g = toy_geometry()  # 3 layers x 16 experts
    model = ToyMoE(g, seed=3)
    resident, _ = arena_runtime(g, g.total_routed_experts, 0, force_pool=True)
    small, _ = arena_runtime(g, 12, 10, force_pool=True, arena_policy="freq-dense")
    with resident, small:
        resident.preload()
        assert small.arena.policy == "freq-dense" and isinstance(small.arena._table, FrequencySlotTable)
        for step in range(40):
            x = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(step)) * 3
            want, _ = resident.step(lambda: model.forward(resident, x), lambda: None)
            got, _ = small.step(lambda: model.forward(small, x), lambda: None)
            assert torch.equal(got, want), f"step {step}"
        assert small.arena.stats().evictions > 0 and small.arena.stats().hit_rows > 0
