"""DevicePool.install: copies merged per contiguous run, the table written whole from host staging
(victims unmapped first), bytes exact, nothing changed on a refused install. On the CPU device, and on
CUDA (marker `gpu`: the driver-API row and table copies, with and without per-layer waits)."""

import numpy as np
import pytest
import torch

from test_runtime_fixtures import on_copy_stream

from tierstore.cache.policy import get_policy
from tierstore.errors import CapacityError
from tierstore.runtime.pools import DevicePool

SLOT = 4096
LAYERS, EXPERTS = 2, 8


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu), pytest.param("cuda-layer-waits", marks=pytest.mark.gpu),
           pytest.param("cuda-layer-waits-2", marks=pytest.mark.gpu)]


def pool(slots: int = 6, device: str = "cpu") -> DevicePool:
    if device != "cpu" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return DevicePool(slots, SLOT, LAYERS, EXPERTS, device.split("-")[0], get_policy("lru"),
                      layer_waits="layer-waits" in device, copy_streams=2 if device.endswith("-2") else 1)


def host_rows(count: int, seed: int = 0, pin: bool = False) -> torch.Tensor:
    """count rows in one host buffer, uint8 [count, SLOT]."""
    rows = torch.randint(0, 256, (count, SLOT), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    return rows.pin_memory() if pin else rows


def assert_bytes(p: DevicePool, keys, rows) -> None:
    p.wait()
    for key, row in zip(keys, rows):
        assert torch.equal(p.slots[p.slot_of(key), :row.numel()].cpu(), row)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_adjacent_in_one_buffer_into_free_slots_take_one_copy(device):
    p, buffer = pool(device=device), host_rows(4, pin=device != "cpu")
    p.slots.fill_(0xA5)  # poisoned: every byte checked below must have been copied
    keys = [(0, 1), (0, 5), (1, 0), (1, 7)]
    p.install(keys, list(buffer), exclude=keys)  # rows are adjacent views of `buffer`; slots 0..3
    assert p.copies == (2 if p.layer_waits else 1)  # per-layer waits: one copy per layer's run
    assert [p.slot_of(k) for k in keys] == [0, 1, 2, 3]
    assert_bytes(p, keys, buffer)
    p.check_coherent()


@pytest.mark.parametrize("device", DEVICES)
def test_scattered_short_or_separate_rows_copy_one_by_one(device):
    pin = device != "cpu"
    p, buffer = pool(device=device), host_rows(4, seed=1, pin=pin)
    p.slots.fill_(0xA5)
    scattered = [buffer[2], buffer[0]]  # not ascending in memory
    p.install([(0, 0), (0, 1)], scattered, exclude=[])
    assert p.copies == 2
    short = [buffer[1, :SLOT - 16], buffer[2]]  # a short row never merges
    p.install([(1, 0), (1, 1)], short, exclude=[])
    assert p.copies == 4
    separate = [host_rows(1, seed=2, pin=pin)[0], host_rows(1, seed=3, pin=pin)[0]]  # two allocations
    p.install([(1, 2), (1, 3)], separate, exclude=[])
    assert p.copies == 6
    assert_bytes(p, [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2), (1, 3)], scattered + short + separate)
    p.check_coherent()


@pytest.mark.parametrize("device", DEVICES)
def test_evictions_unmap_victims_and_table_equals_mirror(device):
    p = pool(slots=3, device=device)
    first = [(0, 0), (0, 1), (0, 2)]
    p.install(first, list(host_rows(3, pin=device != "cpu")), exclude=first)
    p.touch([(0, 0)], now=1.0)  # (0, 1) and (0, 2) are now the least recently used
    second = [(1, 4), (1, 5)]
    fresh = host_rows(2, seed=5, pin=device != "cpu")
    p.install(second, list(fresh), exclude=second + [(0, 0)])
    assert not p.is_resident((0, 1)) and not p.is_resident((0, 2)) and p.is_resident((0, 0))
    p.wait()
    assert torch.equal(p.table.cpu(), torch.from_numpy(p.mirror))
    assert int(p.table[0, 1]) == -1 and int(p.table[0, 2]) == -1
    assert_bytes(p, second, fresh)
    p.check_coherent()


def test_refused_install_changes_nothing():
    p = pool(slots=2)
    p.install([(0, 0)], [host_rows(1)[0]], exclude=[])
    table, slots = p.table.clone(), p.slots.clone()
    with pytest.raises(CapacityError, match="does not fit"):
        p.install([(0, 1)], [torch.zeros(SLOT + 1, dtype=torch.uint8)], exclude=[])
    with pytest.raises(ValueError, match="contiguous 1-D uint8 host"):
        p.install([(0, 1)], [host_rows(1)[0, ::2]], exclude=[])  # a strided view has no one host range
    with pytest.raises(CapacityError, match="cannot take 2 more"):
        p.install([(1, 0), (1, 1)], list(host_rows(2)), exclude=[(0, 0)])
    assert torch.equal(p.table, table) and torch.equal(p.slots, slots)
    assert np.array_equal(p.mirror, table.numpy())
    p.check_coherent()


def test_capacity_for_stops_counting_at_enough():
    p = pool(slots=4)
    keys = [(0, e) for e in range(4)]
    p.install(keys, list(host_rows(4)), exclude=keys)
    assert p.capacity_for([(0, 0)]) == 3
    assert p.capacity_for([(0, 0)], enough=2) == 2
    assert p.capacity_for([(0, 0)], enough=9) == 3
    assert pool().capacity_for([], enough=5) == 5


@pytest.mark.parametrize("arena_slots", [0, 64])
def test_a_fill_through_the_arena_or_staging_is_one_copy(arena_slots):
    from test_runtime_fixtures import memory_source, toy_geometry

    from tierstore.runtime import RuntimeConfig, TieredRuntime

    g = toy_geometry(hidden=256, inter=128)  # slot bytes 36864, a 4 KiB multiple: arena stride == slot bytes
    source = memory_source(g)
    with TieredRuntime(g, source, pool_slots=48, arena_slots=arena_slots, config=RuntimeConfig(kpi_every=0)) as rt:
        keys = [(0, e) for e in range(6)] + [(1, 3), (2, 9)]
        rt.fetch(keys, keys)
        assert rt.pool.copies == 1
        for key in keys:
            assert torch.equal(rt.pool.slots[rt.pool.slot_of(key), :source.row_bytes], source.rows[key])
        rt.pool.check_coherent()


def test_an_install_given_the_evictable_victims_equals_one_that_asks_the_policy():
    asked, given = pool(slots=4), pool(slots=4)
    keys = [(0, e) for e in range(4)]
    for p in (asked, given):
        p.install(keys, list(host_rows(4)), exclude=keys)
        p.touch([(0, 2), (0, 0)], now=1.0)
    new, protect = [(1, 0), (1, 1)], [(0, 0), (1, 0), (1, 1)]
    victims = given.evictable(protect, len(new) - given.num_free)
    assert victims == [1, 3]  # least recently used first, (0, 0) protected
    asked.install(new, list(host_rows(2, seed=1)), exclude=protect)
    given.install(new, list(host_rows(2, seed=1)), exclude=protect, victims=victims)
    for name in ("mirror", "owner", "generation"):
        assert np.array_equal(getattr(given, name), getattr(asked, name))
    assert list(given.policy.eviction_order()) == list(asked.policy.eviction_order())
    assert given._free == asked._free and torch.equal(given.slots, asked.slots)
    given.check_coherent()
    assert given.evictable([], 9) == list(given.policy.eviction_order())  # fewer when there are not that many


def test_missing_keeps_the_keys_that_are_not_resident_in_order():
    p = pool(slots=4)
    p.install([(0, 1), (1, 3)], list(host_rows(2)), exclude=[])
    assert p.missing([(1, 3), (1, 7), (0, 1), (0, 0)]) == [(1, 7), (0, 0)]


def test_all_resident_of_key_ids():
    p = pool(slots=4)
    p.install([(0, 1), (1, 3)], list(host_rows(2)), exclude=[])
    assert p.all_resident(np.array([1, EXPERTS + 3])) and p.all_resident(np.array([], dtype=np.int64))
    assert not p.all_resident(np.array([1, 2]))


@pytest.mark.gpu
def test_two_installs_in_flight_keep_their_own_staging_and_a_third_waits_for_the_first():
    """Copies held back on the copy stream: two installs return without waiting on the host, each
    with its own staged tables; the third waits for the first. Bytes and tables exact at the end."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    p = DevicePool(4, SLOT, LAYERS, EXPERTS, "cuda", get_policy("lru"), layer_waits=True)
    p.slots.fill_(0xA5)
    issue = p._issue

    def held(runs, stream):
        with on_copy_stream(stream):
            torch.cuda._sleep(20_000_000)  # ~10 ms on the copy stream before each install's rows
        issue(runs, stream)

    p._issue = held
    first, second, third = [(0, 1), (0, 2)], [(1, 3), (1, 4)], [(0, 5), (1, 6)]
    rows = host_rows(6, seed=7, pin=True)
    p.install(first, [rows[0], rows[1]], exclude=first)
    p.install(second, [rows[2], rows[3]], exclude=second)
    assert len(p._in_flight) == 2 and p.wait_seconds == 0.0  # neither install blocked the host
    p.install(third, [rows[4], rows[5]], exclude=third)  # evicts two of the first four (pool of 4)
    assert p.wait_seconds > 0.0 and len(p._in_flight) <= 2  # it waited for the first install's copies
    p.wait()
    resident = [key for key in first + second + third if p.is_resident(key)]
    assert len(resident) == 4 and set(third) <= set(resident)
    by_key = dict(zip(first + second + third, rows))
    assert_bytes(p, resident, [by_key[key] for key in resident])
    assert np.array_equal(p.table.cpu().numpy(), p.mirror)
    p.check_coherent()


def test_a_fetch_waits_for_copies_in_flight_only_when_the_arena_will_rewrite_rows():
    """Arena hits are views of rows nothing rewrites, so their fetch issues its install behind copies
    still in flight; a fetch that reads the source into the arena (which may evict rows those copies
    read) waits for them first."""
    from test_runtime_fixtures import memory_source, toy_geometry

    from tierstore.runtime import RuntimeConfig, TieredRuntime
    from tierstore.runtime.replay import preload_arena

    g = toy_geometry()
    with TieredRuntime(g, memory_source(g), pool_slots=8, arena_slots=4, config=RuntimeConfig(kpi_every=0)) as runtime:
        preload_arena(runtime)  # keys (0, 0) .. (0, 3)
        waits = []
        runtime.pool.wait = lambda: waits.append(True)
        runtime.fetch([(0, 0), (0, 1)], protect=[])
        assert waits == []
        runtime.fetch([(0, 2), (1, 0)], protect=[])  # (1, 0) is read from the source
        assert waits == [True]

