"""Host arena over a pack: the backend matrix (in-RAM / pack only / pack + arena, buffered and
O_DIRECT) for cold, warm, reboot, eviction, overflow, scan and preheat; fail-closed faults;
hostile heat files."""

import json
import logging
import random
import threading
import time

import psutil
import pytest
import torch
from pack_helpers import shake_row, write_shake_pack

from tierstore.atomic_files import atomic_write_bytes
from tierstore.cache import heat as heat_module
from tierstore.cache.arena import ARENA_POLICIES, Arena, arena_slots, available_host_bytes
from tierstore.cache.heat import parse_heat
from tierstore.errors import PackFormatError, ReadError
from tierstore.io.layout import PackSpec
from tierstore.io.pack import Pack
from tierstore.io.pack_rows import PackRows
from tierstore.io.pack_writer import PackWriter
from tierstore.io.readers import FaultPlan, FaultyReader, MemoryReader, PreadvPoolReader, UringReader
from tierstore.io.readers.choice import direct_io_supported, uring_unavailable_reason

LAYERS, EXPERTS, ROW_BYTES = 4, 16, 20000  # stride 20480: rows carry page padding
ALL_KEYS = [(layer, expert) for layer in range(LAYERS) for expert in range(EXPERTS)]


def row(layer, expert):
    return shake_row(layer, expert, ROW_BYTES)


@pytest.fixture(scope="module")
def pack(tmp_path_factory):
    spec = PackSpec(tag="base", num_layers=LAYERS, num_experts=EXPERTS, row_bytes=ROW_BYTES,
                    checkpoint_id="arena-test", abi_tag="w2-test", zero_mode="auto")
    return write_shake_pack(tmp_path_factory.mktemp("pack"), spec)


class CountingRows:
    """Wraps a row source and counts how often each key is read from it."""

    def __init__(self, inner):
        self.inner = inner
        self.num_layers, self.num_experts = inner.num_layers, inner.num_experts
        self.row_bytes, self.stride = inner.row_bytes, inner.stride
        self.reads: dict = {}

    def has_layer(self, layer):
        return self.inner.has_layer(layer)

    def read_rows(self, keys, dests):
        self.inner.read_rows(keys, dests)
        for key in keys:
            self.reads[key] = self.reads.get(key, 0) + 1


def make_reader(kind, pack):
    if kind == "memory":
        return MemoryReader.from_file(pack.path)
    backend, mode = kind.split("-")
    direct = mode == "direct"
    if direct and not direct_io_supported(pack.path):
        pytest.skip("filesystem refuses O_DIRECT")
    if backend == "uring":
        if uring_unavailable_reason() is not None:
            pytest.skip(f"io_uring unavailable: {uring_unavailable_reason()}")
        return UringReader(pack.path, direct=direct, depth=16)
    return PreadvPoolReader(pack.path, direct=direct, threads=4)


READERS = ["memory", "preadv-buffered", "preadv-direct", "uring-buffered", "uring-direct"]


def open_arena(pack, kind, num_slots, **kwargs):  # kwargs: Arena's (policy among them)
    source = CountingRows(PackRows(pack, make_reader(kind, pack)))
    return Arena(source, num_slots, **kwargs), source


def assert_rows(keys, views):
    for key, view in zip(keys, views):
        assert view.dtype == torch.uint8 and view.shape == (ROW_BYTES,)
        assert bytes(view.numpy()) == row(*key), key


@pytest.mark.parametrize("kind", READERS)
@pytest.mark.parametrize("num_slots", [0, 64], ids=["pack-only", "pack+arena"])
def test_cold_then_warm_sweeps(pack, kind, num_slots):
    arena, source = open_arena(pack, kind, num_slots)
    for sweep in range(2):
        for start in range(0, len(ALL_KEYS), 8):
            keys = ALL_KEYS[start:start + 8]
            assert_rows(keys, arena.fetch(keys))
    stats = arena.stats()
    if num_slots:
        assert stats.hit_rows == 64 and stats.miss_rows == 64  # the second sweep is all hits
        assert set(source.reads.values()) == {1}  # no row read from disk twice
    else:
        assert stats.hit_rows == 0 and stats.overflow_rows == 128
        assert set(source.reads.values()) == {2}


@pytest.mark.parametrize("kind", READERS)
def test_reboot_with_garbage_memory_serves_rows_from_the_pack(pack, kind):
    arena, source = open_arena(pack, kind, 64)
    arena.memory.copy_(torch.randint(0, 256, arena.memory.shape, dtype=torch.uint8))
    keys = random.Random(1).sample(ALL_KEYS, 20)
    assert_rows(keys, arena.fetch(keys))
    assert arena.stats().miss_rows == 20


@pytest.mark.parametrize("policy", ARENA_POLICIES)
@pytest.mark.parametrize("kind", READERS)
def test_eviction_stress_keeps_bytes_right(pack, kind, policy):
    arena, source = open_arena(pack, kind, 24, policy=policy)
    rng = random.Random(2)
    for _ in range(2):
        keys = ALL_KEYS[:]
        rng.shuffle(keys)
        for start in range(0, 64, 8):
            batch = keys[start:start + 8] + [keys[start]]  # with a duplicate
            assert_rows(batch, arena.fetch(batch))
    assert sum(source.reads.values()) > 64
    assert arena.stats().evictions > 0 and arena.stats().overflow_rows == 0


@pytest.mark.parametrize("kind", READERS)
def test_batch_larger_than_the_arena_overflows_through_staging(pack, kind, caplog):
    arena, _ = open_arena(pack, kind, 24)
    with caplog.at_level(logging.WARNING, logger="tierstore.cache"):
        assert_rows(ALL_KEYS, arena.fetch(ALL_KEYS))
    assert arena.stats().overflow_rows == 40
    assert "overflowed" in caplog.text


@pytest.mark.parametrize("policy", ARENA_POLICIES)
@pytest.mark.parametrize("kind", ["memory", "preadv-direct"])
def test_scan_fills_free_slots_and_never_evicts(pack, kind, policy):
    arena, _ = open_arena(pack, kind, 24, policy=policy)
    first, second, decode = ALL_KEYS[:16], ALL_KEYS[16:32], ALL_KEYS[32:36]
    assert_rows(first, arena.fetch(first, scan=True))
    assert all(key in arena for key in first)
    assert_rows(second, arena.fetch(second, scan=True))
    assert all(key in arena for key in first)  # the hot set survives the scan
    assert sum(key in arena for key in second) == 8 and arena.stats().overflow_rows == 8
    assert_rows(decode, arena.fetch(decode))  # decode evicts and inserts
    assert all(key in arena for key in decode) and arena.stats().evictions == 4


def test_hits_are_zero_copy_views_and_duplicates_share_a_slot(pack):
    arena, source = open_arena(pack, "memory", 8)
    first = arena.fetch([(1, 1), (1, 1), (2, 2)])
    assert first[0].data_ptr() == first[1].data_ptr()
    assert source.reads == {(1, 1): 1, (2, 2): 1}
    again = arena.fetch([(2, 2)])
    base, end = arena.memory.data_ptr(), arena.memory.data_ptr() + arena.memory.numel()
    assert again[0].data_ptr() == first[2].data_ptr() and base <= again[0].data_ptr() < end
    assert arena.memory.data_ptr() % 4096 == 0


@pytest.mark.parametrize("policy", ARENA_POLICIES)
@pytest.mark.parametrize("kind", ["memory", "preadv-buffered", "uring-direct"])
def test_preheat_makes_the_hottest_rows_hits_after_reopen(pack, kind, tmp_path, policy):
    heat = tmp_path / "x.pack.heat.json"
    arena, _ = open_arena(pack, kind, 8, heat_path=heat, policy=policy)
    for key in ALL_KEYS[:12]:  # the last 8 fetched are the hottest
        arena.fetch([key])
    arena.close()
    assert parse_heat(heat, LAYERS, EXPERTS)[:8] == ALL_KEYS[11:3:-1]
    reopened, source = open_arena(pack, kind, 8, heat_path=heat, policy=policy)
    assert sum(source.reads.values()) == 8
    assert_rows(ALL_KEYS[4:12], reopened.fetch(ALL_KEYS[4:12]))
    assert reopened.stats().hit_rows == 8 and reopened.stats().miss_rows == 0
    reopened.fetch([ALL_KEYS[20]])  # the victim is the coldest preheated row (asked for as often, hit first)
    assert ALL_KEYS[4] not in reopened and ALL_KEYS[11] in reopened


def wait_for(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_heat_file_is_written_periodically_in_the_background(pack, tmp_path, monkeypatch):
    heat = tmp_path / "h.json"
    release, writers = threading.Event(), []

    def slow_write(path, data):
        writers.append(threading.current_thread().name)
        release.wait(timeout=10)
        atomic_write_bytes(path, data)

    monkeypatch.setattr(heat_module, "atomic_write_bytes", slow_write)
    arena, _ = open_arena(pack, "memory", 8, heat_path=heat, heat_every=3)
    arena.fetch([(0, 0)])
    arena.fetch([(0, 0)])  # a pure hit places nothing and does not count
    arena.fetch([(0, 1)])
    assert not heat.exists()
    arena.fetch([(0, 2)])  # returns while the write is still blocked on the writer thread
    wait_for(lambda: writers)
    for expert in range(3, 9):  # two more snapshots while the first write is blocked: the last wins
        arena.fetch([(0, expert)])
    assert not heat.exists()
    release.set()
    wait_for(lambda: heat.exists() and len(parse_heat(heat, LAYERS, EXPERTS)) == 8)
    assert parse_heat(heat, LAYERS, EXPERTS) == [(0, e) for e in range(8, 0, -1)]
    assert len(writers) == 2 and all(name.startswith("tierstore-heat") for name in writers)
    arena.close()


def test_a_young_arena_never_erases_the_hot_set_it_booted_from(pack, tmp_path):
    heat = tmp_path / "y.pack.heat.json"
    arena, _ = open_arena(pack, "memory", 8, heat_path=heat)
    for key in ALL_KEYS[:8]:
        arena.fetch([key])
    arena.close()
    booted = parse_heat(heat, LAYERS, EXPERTS)
    assert booted == ALL_KEYS[7::-1]
    untouched, _ = open_arena(pack, "memory", 8, heat_path=heat, preheat=False)
    untouched.close()  # published nothing: the file keeps its keys
    assert parse_heat(heat, LAYERS, EXPERTS) == booted
    young, _ = open_arena(pack, "memory", 8, heat_path=heat, preheat=False)
    young.fetch([(3, 3), (3, 4)])
    young.close()  # its two rows first, then the rest of the hot set it booted from
    assert parse_heat(heat, LAYERS, EXPERTS) == [(3, 4), (3, 3)] + booted[:6]


def test_a_failed_preheat_keeps_the_heat_file(pack, tmp_path, caplog):
    heat = tmp_path / "f.pack.heat.json"
    arena, _ = open_arena(pack, "memory", 4, heat_path=heat)
    arena.fetch(ALL_KEYS[:4])
    arena.close()
    booted = parse_heat(heat, LAYERS, EXPERTS)
    reader = FaultyReader(MemoryReader.from_file(pack.path), FaultPlan(eio_rate=1.0))
    with caplog.at_level(logging.WARNING, logger="tierstore.cache"):
        cold = Arena(PackRows(pack, reader), 4, heat_path=heat)
    assert "preheat" in caplog.text and len(cold._table) == 0
    cold.close()
    assert parse_heat(heat, LAYERS, EXPERTS) == booted


def test_a_failed_background_heat_write_warns_and_fetches_go_on(pack, tmp_path, caplog):
    heat = tmp_path / "missing-dir" / "h.json"
    arena, _ = open_arena(pack, "memory", 8, heat_path=heat, heat_every=1)
    with caplog.at_level(logging.WARNING, logger="tierstore.cache"):
        assert_rows([(1, 1)], arena.fetch([(1, 1)]))
        arena._heat.close()
    assert "could not write the heat file" in caplog.text


@pytest.mark.parametrize("content", [
    b"", b"{", b"[]", b'{"format": "tierstore-heat"}',
    json.dumps({"format": "tierstore-heat", "version": 1, "num_layers": 4, "num_experts": 16,
                "keys": [[0, 99]]}).encode(),
    json.dumps({"format": "tierstore-heat", "version": 1, "num_layers": 4, "num_experts": 16,
                "keys": [[-1, 0]]}).encode(),
    json.dumps({"format": "tierstore-heat", "version": 1, "num_layers": 4, "num_experts": 16,
                "keys": [[True, 0]]}).encode(),
    json.dumps({"format": "tierstore-heat", "version": 1, "num_layers": 4, "num_experts": 16,
                "keys": [[0, 0]] * 100000}).encode(),
    json.dumps({"format": "tierstore-heat", "version": 1, "num_layers": 5, "num_experts": 16,
                "keys": []}).encode(),
    json.dumps({"format": "tierstore-heat", "version": 1, "num_layers": 4, "num_experts": 16,
                "keys": [["../../etc", 0]]}).encode(),
    b"1" * 10000,
], ids=range(11))
def test_hostile_heat_files_give_a_cold_arena_with_a_warning(pack, tmp_path, caplog, content):
    heat = tmp_path / "bad.heat.json"
    heat.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="tierstore.cache"):
        arena, source = open_arena(pack, "memory", 8, heat_path=heat)
    assert "cold arena" in caplog.text
    assert source.reads == {} and len(arena._table) == 0
    assert_rows([(0, 0)], arena.fetch([(0, 0)]))
    with pytest.raises(PackFormatError):
        parse_heat(heat, LAYERS, EXPERTS)


def test_heat_file_that_is_a_directory_gives_a_cold_arena(pack, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="tierstore.cache"):
        arena, _ = open_arena(pack, "memory", 8, heat_path=tmp_path)
    assert "cold arena" in caplog.text and len(arena._table) == 0


@pytest.mark.parametrize("kind", ["preadv-direct", "uring-buffered", "uring-direct"])
def test_the_arena_registers_its_slots_with_io_uring_and_withdraws_them_at_close(pack, kind):
    reader = make_reader(kind, pack)
    arena = Arena(PackRows(pack, reader), 8)
    uring = isinstance(reader, UringReader)
    assert arena.registered == uring and (not uring or reader.uses_fixed_buffers)
    assert_rows(ALL_KEYS[:20], [t.clone() for t in arena.fetch(ALL_KEYS[:20])])  # 12 through staging
    assert_rows(ALL_KEYS[12:20], arena.fetch(ALL_KEYS[12:20]))
    arena.close()
    assert not uring or not reader.uses_fixed_buffers
    reader.close()


def test_a_collected_arena_withdraws_its_registration(pack):
    reader = make_reader("uring-buffered", pack)
    source = PackRows(pack, reader)
    arena = Arena(source, 4)
    assert arena.registered and reader.uses_fixed_buffers
    del arena
    assert not reader.uses_fixed_buffers
    source.close()


def faulty_arena(pack, plan, num_slots=8, policy="lru"):
    reader = FaultyReader(PreadvPoolReader(pack.path), plan)
    return Arena(PackRows(pack, reader), num_slots, policy=policy), reader


@pytest.mark.parametrize("policy", ARENA_POLICIES)
@pytest.mark.parametrize("fault", ["eio", "short"])
def test_read_failure_mid_batch_publishes_nothing_and_a_retry_reads_correct_bytes(pack, fault, policy):
    victim = pack.spec.row_offset(1, 5)
    plan = FaultPlan(eio_offsets={victim}) if fault == "eio" else FaultPlan(short_offsets={victim})
    arena, reader = faulty_arena(pack, plan, policy=policy)
    warm = [(0, 0), (0, 1)]
    arena.fetch(warm)
    batch = [(1, 4), (1, 5), (1, 6)]
    with pytest.raises(ReadError, match=f"offset {victim}"):
        arena.fetch(batch)
    assert not any(key in arena for key in batch)
    assert all(key in arena for key in warm)
    assert_rows(batch, arena.fetch(batch))
    assert reader.fired == [(fault, victim)]


@pytest.mark.parametrize("policy", ARENA_POLICIES)
def test_failed_read_into_an_evicted_slot_leaves_no_stale_hit(pack, policy):
    victim = pack.spec.row_offset(2, 0)
    arena, _ = faulty_arena(pack, FaultPlan(eio_offsets={victim}), num_slots=2, policy=policy)
    arena.fetch([(0, 0), (0, 1)])
    with pytest.raises(ReadError):
        arena.fetch([(2, 0)])  # evicts (0, 0) for a read that fails
    assert (0, 0) not in arena and (2, 0) not in arena and (0, 1) in arena
    assert_rows([(0, 0), (2, 0)], arena.fetch([(0, 0), (2, 0)]))


def test_flipped_bit_is_caught_by_the_checksum_and_never_served(pack):
    victim = pack.spec.row_offset(3, 3)
    arena, _ = faulty_arena(pack, FaultPlan(flip_offsets={victim}))
    with pytest.raises(PackFormatError, match=r"checksum: \(3, 3\)"):
        arena.fetch([(3, 2), (3, 3)])
    assert (3, 3) not in arena and (3, 2) not in arena
    assert_rows([(3, 3)], arena.fetch([(3, 3)]))


@pytest.mark.parametrize("policy", ARENA_POLICIES)
def test_random_fault_storm_never_serves_wrong_bytes(pack, policy):
    arena, reader = faulty_arena(pack, FaultPlan(eio_rate=0.05, short_rate=0.05, flip_rate=0.05, seed=3), 16,
                                 policy=policy)
    rng, failures = random.Random(5), 0
    for _ in range(60):
        keys = rng.sample(ALL_KEYS, 6)
        try:
            views = arena.fetch(keys)
        except (ReadError, PackFormatError):
            failures += 1
            continue
        assert_rows(keys, views)
    assert failures > 0 and len(reader.fired) > 0


def test_keys_outside_the_source_are_refused(pack):
    arena, _ = open_arena(pack, "memory", 4)
    for key in ((4, 0), (0, 16), (-1, 0)):
        with pytest.raises(PackFormatError, match="outside"):
            arena.fetch([key])


def test_a_refused_key_fails_the_batch_before_any_read(pack):
    arena, source = open_arena(pack, "memory", 4)
    with pytest.raises(PackFormatError, match=rf"^row \(0, {EXPERTS}\) is outside {LAYERS} layers x {EXPERTS} experts$"):
        arena.fetch([(0, 1), (0, EXPERTS)])
    source.has_layer = lambda layer: layer != 2
    with pytest.raises(PackFormatError, match="^layer 2 is not available from the row source$"):
        arena.fetch([(1, 1), (2, 0)])
    assert source.reads == {} and len(arena._table) == 0


def test_a_refused_key_beside_hits_reads_nothing_and_changes_no_row(pack):
    """Keys are checked where they miss (a hit was checked when it was read): a batch of a hit and a key outside
    the source still fails before any read, and the arena keeps exactly the rows it held."""
    arena, source = open_arena(pack, "memory", 4)
    arena.fetch([(0, 1)])
    reads = dict(source.reads)
    with pytest.raises(PackFormatError, match=rf"^row \(0, {EXPERTS}\) is outside"):
        arena.fetch([(0, 1), (0, EXPERTS)])
    assert source.reads == reads and arena._table.hottest_first() == [(0, 1)]


def test_before_read_runs_once_before_a_read_and_never_on_hits(pack):
    """`before_read` (a device pool's wait for copies that may read arena rows) runs before the source is read,
    once per fetch, and not at all when every key hits; hits come back in the order asked, as the same rows."""
    arena, source = open_arena(pack, "memory", 4)
    calls = []
    read_rows = source.read_rows
    source.read_rows = lambda *a, **k: (calls.append("read"), read_rows(*a, **k))[1]
    first = arena.fetch([(0, 1), (1, 2)], before_read=lambda: calls.append("before"))
    assert calls == ["before", "read"]
    calls.clear()
    again = arena.fetch([(1, 2), (0, 1)], before_read=lambda: calls.append("before"))
    assert calls == [] and [r.data_ptr() for r in again] == [r.data_ptr() for r in first[::-1]]
    repeated = arena.fetch([(0, 1), (0, 1), (0, 3)], before_read=lambda: calls.append("before"))
    assert calls == ["before", "read"] and repeated[0].data_ptr() == repeated[1].data_ptr() == first[0].data_ptr()


def test_hit_many_marks_each_published_key_once_in_first_occurrence_order():
    from tierstore.cache.slots import SlotTable

    table = SlotTable(4)
    for key in "abcd":
        table.publish(key, table.take_free())
    found = table.hit_many(["b", "x", "a", "b"])
    assert found == {"b": 1, "a": 0}
    assert table.hottest_first() == ["a", "b", "d", "c"]  # b then a moved to the end, b once


def test_arena_sizing():
    stride = 1 << 20
    pack = 400 * stride
    assert arena_slots("auto", stride, pack, available=2 * pack) == 400  # the pack fits in half: every row
    assert arena_slots("auto", stride, pack, available=2 * pack - 1) == 100  # else a quarter of the pack
    assert arena_slots("auto", stride, 8 * stride, available=0) == 16  # floor of 16 slots
    assert 0 < available_host_bytes() <= psutil.virtual_memory().total
    assert arena_slots(0.5, stride, 400 * stride) == 512
    assert arena_slots("0.001", stride, 400 * stride) == 16  # floor of 16 slots
    for bad in ("lots", "-1", "nan"):
        with pytest.raises(ValueError, match="arena size"):
            arena_slots(bad, stride, 1)


class ThreadRecordingPool(PreadvPoolReader):
    """Records the thread each `on_read` (PackRows' hand-off to verification) runs on."""

    def submit(self, ops, on_read=None):
        def recorded(index):
            self.on_read_threads.add(threading.current_thread().name)
            on_read(index)

        return super().submit(ops, on_read=recorded)


@pytest.mark.parametrize("direct", [False, True])
def test_a_row_corrupt_on_disk_read_through_the_preadv_pool_is_never_published(tmp_path, direct):
    """Rows of a batch are handed to verification from the pool's worker threads as each read
    completes; a row whose bytes on disk no longer match its checksum fails the whole batch,
    naming it, and no key of that batch is published (only the earlier batch stays a hit)."""
    spec = PackSpec(tag="base", num_layers=LAYERS, num_experts=EXPERTS, row_bytes=ROW_BYTES,
                    checkpoint_id="arena-test", abi_tag="w2-test", zero_mode="auto")
    with PackWriter(tmp_path, spec) as writer:
        for layer in range(LAYERS):
            writer.write_layer(layer, (row(layer, e) for e in range(EXPERTS)))
    pack = Pack(tmp_path, spec)
    if direct and not direct_io_supported(pack.path):
        pytest.skip("filesystem refuses O_DIRECT")
    victim = (2, 9)
    position = spec.row_offset(*victim) + ROW_BYTES - 3  # in the payload, near its end
    with open(pack.path, "r+b") as handle:
        handle.seek(position)
        good = handle.read(1)
        handle.seek(position)
        handle.write(bytes([good[0] ^ 0x10]))
    reader = ThreadRecordingPool(pack.path, direct=direct, threads=4)
    reader.on_read_threads = set()
    arena = Arena(PackRows(pack, reader), 16)
    warm = [(0, 0), (0, 1), (0, 2)]
    assert_rows(warm, arena.fetch(warm))
    batch = [(2, 6), (2, 7), (2, 8), victim, (2, 10), (2, 11)]  # > 2 reads: the pool's threads run them
    with pytest.raises(PackFormatError, match=r"1 row\(s\) .* fail their checksum: \(2, 9\); run `tierstore verify`"):
        arena.fetch(batch)
    assert reader.on_read_threads and all(name.startswith("tierstore-preadv") for name in reader.on_read_threads)
    assert not any(key in arena for key in batch)
    assert all(key in arena for key in warm)
    with pytest.raises(PackFormatError, match=r"\(2, 9\)"):  # never served later either
        arena.fetch([victim])
    assert victim not in arena
    with open(pack.path, "r+b") as handle:  # repaired: the same arena now reads the right bytes
        handle.seek(position)
        handle.write(good)
    assert_rows(batch, arena.fetch(batch))
    assert all(key in arena for key in batch + warm)
    arena.source.close()
