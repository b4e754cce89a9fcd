"""Lazy FP4 promotions copy their rows outside the safe point: `DevicePool.reserve` takes slots
(victims unmapped at once), `write_reserved` copies with no lock held, `map_reserved` maps them;
reserved slots are neither free nor mapped, so no install takes them and no kernel reads them."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from fp4_fixtures import routing_counts, tier_rows
from test_runtime_fixtures import toy_geometry

from tierstore.cache.policy import get_policy
from tierstore.errors import CapacityError
from tierstore.runtime import MemoryRowSource, RuntimeConfig
from tierstore.runtime.fp4_tier import Fp4Tier
from tierstore.runtime.pools import DevicePool

SLOT = 4096
GEOMETRY = toy_geometry(layers=2, experts=8, top_k=2)
ROWS = tier_rows(GEOMETRY)


def rows(count: int, seed: int) -> list[torch.Tensor]:
    data = torch.randint(0, 256, (count, SLOT), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    return list(data)


def table_is_mirror(p: DevicePool) -> bool:
    return np.array_equal(p.table.numpy(), p.mirror)


def test_reserve_unmaps_victims_at_once_and_map_reserved_lands_byte_exact():
    p = DevicePool(4, SLOT, 2, 8, "cpu", get_policy("lru"))
    old = [(0, 0), (0, 1), (0, 2)]
    p.install(old, rows(3, 0), exclude=old)
    slots = p.reserve(2, exclude=[(0, 2)])  # the free slot, then the LRU victim outside the exclusion
    assert slots[0] == 3 and p.mirror[0, 0] == -1 and p.is_resident((0, 1)) and p.is_resident((0, 2))
    assert table_is_mirror(p) and p.num_free == 0 and p.num_mapped == 2
    p.check_coherent()
    with pytest.raises(CapacityError):  # reserved slots are not evictable: only (0, 1) and (0, 2) are
        p.install([(1, 0), (1, 1), (1, 2)], rows(3, 1), exclude=[])
    new, data = [(1, 5), (1, 6)], rows(2, 2)
    p.write_reserved(data, slots)
    assert p.mirror[1, 5] == -1 and table_is_mirror(p)  # written, not mapped yet
    p.map_reserved(new, slots)
    assert [p.slot_of(k) for k in new] == slots and table_is_mirror(p) and p.num_mapped == 4
    for key, row in zip(new, data):
        assert torch.equal(p.slots[p.slot_of(key)], row)
    p.check_coherent()


def test_released_reservations_go_back_to_the_free_list_and_checks_refuse_misuse():
    p = DevicePool(3, SLOT, 2, 8, "cpu", get_policy("lru"))
    slots = p.reserve(2, exclude=[])
    assert p.num_free == 1 and p.num_mapped == 0
    with pytest.raises(ValueError):
        p.map_reserved([(0, 0)], [2])  # slot 2 is free, not reserved
    with pytest.raises(ValueError):
        p.write_reserved(rows(1, 3), [2])
    p.release_reserved(slots)
    assert p.num_free == 3
    p.check_coherent()
    p.install([(0, 0), (0, 1), (0, 2)], rows(3, 4), exclude=[])  # every slot usable again
    p.check_coherent()


def test_the_runner_steps_while_the_managers_rows_are_copied_and_a_forced_install_wins():
    t = Fp4Tier(GEOMETRY, MemoryRowSource(ROWS[1]), 4, "cpu", RuntimeConfig(fp4_policy="freq", fp4_promote=2))
    copying, release = threading.Event(), threading.Event()
    write = t.pool.write_reserved

    def slow_write(rows_, slots):
        copying.set()
        assert release.wait(10)
        write(rows_, slots)
    t.pool.write_reserved = slow_write
    keys = [(0, 1), (1, 3)]
    done = []
    manager = threading.Thread(target=lambda: done.append(t.promote_lazy(t.observe_window(routing_counts(*keys)))))
    manager.start()
    assert copying.wait(10)
    assert t.lock.acquire(timeout=1)  # the safe point is free while the rows are copied
    try:
        assert not t.pool.is_resident((0, 1)) and t.pool.num_mapped == 0
        assert t.force_promote([(0, 1)], [(0, 1)], None) == 1  # the runner installs one of them meanwhile
    finally:
        t.lock.release()
    release.set()
    manager.join(10)
    assert done == [1] and t.promoted_lazy == 1 and t.promoted_forced == 1
    assert t.pool.num_mapped == 2 and t.pool.num_free == 2  # the slot reserved for (0, 1) went back
    row_bytes = ROWS[1].shape[-1]
    for key in keys:
        assert torch.equal(t.pool.slots[t.pool.slot_of(key), :row_bytes], ROWS[1][key])
    t.pool.check_coherent()
