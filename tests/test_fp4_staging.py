"""Lazy promotions read their rows before taking the tier's lock: a step can start while the
manager's host reads are in flight, and what lands afterwards is exact and coherent."""

from __future__ import annotations

import threading

import torch
from fp4_fixtures import routing_counts, tier_rows
from test_runtime_fixtures import toy_geometry

from tierstore.runtime import MemoryRowSource, RuntimeConfig
from tierstore.runtime.fp4_tier import Fp4Tier

GEOMETRY = toy_geometry(layers=2, experts=8, top_k=2)
ROWS = tier_rows(GEOMETRY)


class GatedRows(MemoryRowSource):
    """Rows whose reads wait until `release` is set (`reading` tells that one has started)."""

    def __init__(self, rows):
        super().__init__(rows)
        self.reading, self.release = threading.Event(), threading.Event()

    def read_rows(self, keys, dests):
        self.reading.set()
        assert self.release.wait(10)
        super().read_rows(keys, dests)


def test_the_tier_lock_is_free_while_lazy_rows_are_read():
    source = GatedRows(ROWS[1])
    t = Fp4Tier(GEOMETRY, source, 4, "cpu", RuntimeConfig(fp4_policy="freq", fp4_promote=2))
    keys = t.observe_window(routing_counts((0, 1), (0, 1), (1, 5)))
    promoted = []
    manager = threading.Thread(target=lambda: promoted.append(t.promote_lazy(keys)))
    manager.start()
    assert source.reading.wait(10)
    assert t.lock.acquire(timeout=1), "a step had to wait for the manager's host reads"
    t.close_step([(0, 1), (1, 5)])  # the runner closes a step meanwhile (re-entrant under its lock)
    t.lock.release()
    source.release.set()
    manager.join(10)
    assert promoted == [2]
    for key in [(0, 1), (1, 5)]:
        assert torch.equal(t.pool.slots[t.pool.slot_of(key), :ROWS[1].shape[-1]], ROWS[1][key])
    t.pool.check_coherent()


def test_keys_installed_while_staging_are_not_installed_twice():
    source = GatedRows(ROWS[1])
    t = Fp4Tier(GEOMETRY, source, 4, "cpu", RuntimeConfig(fp4_policy="freq", fp4_promote=2))
    keys = t.observe_window(routing_counts((0, 2), (1, 3)))
    promoted = []
    manager = threading.Thread(target=lambda: promoted.append(t.promote_lazy(keys)))
    manager.start()
    assert source.reading.wait(10)
    with t.lock:  # a step whose install does not need the arena (rows from elsewhere)
        t._install_rows([(0, 2)], [ROWS[1][0, 2]], {(0, 2), (1, 3)})
    source.release.set()
    manager.join(10)
    assert promoted == [1] and t.pool.num_mapped == 2
    assert torch.equal(t.pool.slots[t.pool.slot_of((1, 3)), :ROWS[1].shape[-1]], ROWS[1][1, 3])
    t.pool.check_coherent()
