"""Lazy promotions read their rows straight into the manager's staging: one reader batch per
promotion for the rows the arena does not hold, no pass through the arena, rows byte-exact in the
pool afterwards."""

from __future__ import annotations

import torch
from fp4_fixtures import routing_counts, tier_rows
from test_runtime_fixtures import toy_geometry

from tierstore.runtime import MemoryRowSource, RuntimeConfig
from tierstore.runtime.fp4_tier import Fp4Tier

GEOMETRY = toy_geometry(layers=2, experts=8, top_k=2)
ROWS = tier_rows(GEOMETRY)


class CountingRows(MemoryRowSource):
    def __init__(self, rows):
        super().__init__(rows)
        self.batches: list[list[tuple[int, int]]] = []

    def read_rows(self, keys, dests):
        self.batches.append(list(keys))
        super().read_rows(keys, dests)


def assert_exact(t: Fp4Tier, keys) -> None:
    row_bytes = ROWS[1].shape[-1]
    for key in keys:
        assert torch.equal(t.pool.slots[t.pool.slot_of(key), :row_bytes], ROWS[1][key])
    t.pool.check_coherent()


def test_a_promotion_batch_is_one_reader_batch_and_lands_byte_exact():
    source = CountingRows(ROWS[1])
    t = Fp4Tier(GEOMETRY, source, 8, "cpu", RuntimeConfig(fp4_policy="freq", fp4_promote=4), arena_slots=4)
    keys = [(0, 1), (0, 6), (1, 2), (1, 7)]
    assert t.promote_lazy(t.observe_window(routing_counts(*keys))) == 4
    assert len(source.batches) == 1 and sorted(source.batches[0]) == sorted(keys)
    assert t.staged_reads == 1
    assert not any(key in t.arena for key in keys), "lazy rows went through the arena"
    assert_exact(t, keys)


def test_rows_the_arena_holds_are_copied_not_read():
    source = CountingRows(ROWS[1])
    t = Fp4Tier(GEOMETRY, source, 8, "cpu", RuntimeConfig(fp4_policy="freq", fp4_promote=4), arena_slots=4)
    t.arena.fetch([(1, 3)])  # e.g. left there by a forced promotion
    source.batches.clear()
    keys = [(0, 0), (1, 3), (1, 4)]
    assert t.promote_lazy(t.observe_window(routing_counts(*keys))) == 3
    assert len(source.batches) == 1 and sorted(source.batches[0]) == [(0, 0), (1, 4)]
    assert_exact(t, keys)
    source.batches.clear()
    t2 = Fp4Tier(GEOMETRY, source, 8, "cpu", RuntimeConfig(fp4_policy="freq", fp4_promote=4), arena_slots=4)
    t2.arena.fetch([(0, 5)])
    source.batches.clear()
    assert t2.promote_lazy(t2.observe_window(routing_counts((0, 5)))) == 1
    assert source.batches == [] and t2.staged_reads == 0  # every row was a hit: no reader batch
    assert_exact(t2, [(0, 5)])


def test_staged_rows_are_page_strided_for_pack_readers():
    t = Fp4Tier(GEOMETRY, MemoryRowSource(ROWS[1]), 8, "cpu", RuntimeConfig(fp4_policy="freq", fp4_promote=4))
    assert t._staging.shape == (4, t.source.stride) and t._staging.data_ptr() % 4096 == 0
