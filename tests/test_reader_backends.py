"""Reader backends: exact bytes for every backend in buffered and O_DIRECT mode, fail-closed
errors, fault injection, backend choice."""

import logging
import os

import pytest
import torch

from tierstore.errors import ReadError
from tierstore.io.readers import FaultPlan, FaultyReader, MemoryReader, PreadvPoolReader, ReadOp, UringReader
from tierstore.io.readers.choice import chosen_backend, direct_io_supported, kernel_version, make_reader, \
    uring_unavailable_reason

BLOCK = 8192
NUM_BLOCKS = 32


def aligned(nbytes: int) -> torch.Tensor:
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
    start = (-raw.data_ptr()) % 4096
    return raw[start:start + nbytes]


@pytest.fixture
def data_file(tmp_path):
    data = os.urandom(NUM_BLOCKS * BLOCK)
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    return path, data


def uring_or_skip():
    reason = uring_unavailable_reason()
    if reason is not None:
        pytest.skip(f"io_uring unavailable: {reason}")


def backends(path, direct, data):
    yield MemoryReader(data) if not direct else None
    yield PreadvPoolReader(path, direct=direct, threads=4)
    if uring_unavailable_reason() is None:
        yield UringReader(path, direct=direct, depth=8)


@pytest.mark.parametrize("direct", [False, True])
def test_every_backend_reads_exact_bytes_in_shuffled_batches(data_file, direct):
    path, data = data_file
    if direct and not direct_io_supported(path):
        pytest.skip("filesystem refuses O_DIRECT")
    order = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
    for reader in filter(None, backends(path, direct, data)):
        dest = aligned(NUM_BLOCKS * BLOCK)
        view = memoryview(dest.numpy())
        ops = [ReadOp(block * BLOCK, view[i * BLOCK:(i + 1) * BLOCK]) for i, block in enumerate(order)]
        reader.read(ops)  # 32 reads, more than the io_uring depth of 8: several submits
        expected = b"".join(data[b * BLOCK:(b + 1) * BLOCK] for b in order)
        assert bytes(view) == expected, reader.describe()
        reader.close()


@pytest.mark.parametrize("direct", [False, True])
def test_on_read_runs_once_per_good_read_after_its_bytes_arrived(data_file, direct):
    path, data = data_file
    if direct and not direct_io_supported(path):
        pytest.skip("filesystem refuses O_DIRECT")
    for reader in filter(None, backends(path, direct, data)):
        dest = aligned(NUM_BLOCKS * BLOCK)
        view = memoryview(dest.numpy())
        seen: dict[int, bytes] = {}
        ops = [ReadOp(b * BLOCK, view[b * BLOCK:(b + 1) * BLOCK]) for b in range(NUM_BLOCKS)]
        reader.read(ops, on_read=lambda index: seen.setdefault(index, bytes(ops[index].dest)))
        assert seen == {b: data[b * BLOCK:(b + 1) * BLOCK] for b in range(NUM_BLOCKS)}, reader.describe()
        reader.close()


@pytest.mark.parametrize("make", ["memory", "preadv", "uring"])
def test_on_read_skips_failed_reads_and_its_exception_fails_the_read(data_file, make):
    path, data = data_file
    if make == "uring":
        uring_or_skip()
    reader = {"memory": lambda: MemoryReader(data), "preadv": lambda: PreadvPoolReader(path, threads=2),
              "uring": lambda: UringReader(path, depth=2)}[make]()
    view = memoryview(bytearray(5 * BLOCK))
    tail = (NUM_BLOCKS - 1) * BLOCK
    ops = [ReadOp(b * BLOCK, view[b * BLOCK:(b + 1) * BLOCK]) for b in range(3)]
    ops.append(ReadOp(tail, view[3 * BLOCK:]))  # runs one block past the end of the file
    called = []

    def on_read(index):
        called.append(index)
        if index == 1:
            raise ValueError("bad row")

    with pytest.raises(ReadError, match=rf"2 of 4 reads .*offset {BLOCK}: on_read failed: ValueError.*offset {tail}"):
        reader.read(ops, on_read=on_read)
    assert sorted(called) == [0, 1, 2]
    reader.close()


def test_faulty_reader_runs_on_read_after_its_faults(data_file):
    path, data = data_file
    reader = FaultyReader(PreadvPoolReader(path), FaultPlan(eio_offsets={0}, flip_offsets={BLOCK}))
    view = memoryview(bytearray(2 * BLOCK))
    ops = [ReadOp(0, view[:BLOCK]), ReadOp(BLOCK, view[BLOCK:])]
    seen = {}
    with pytest.raises(ReadError, match="1 of 2 reads"):
        reader.read(ops, on_read=lambda index: seen.setdefault(index, bytes(ops[index].dest)))
    assert list(seen) == [1] and seen[1] != data[BLOCK:2 * BLOCK]  # it saw the flipped bit


def test_io_uring_window_wraps_its_rings_many_times(data_file):
    uring_or_skip()
    path, data = data_file
    view = memoryview(bytearray(5 * BLOCK))
    with UringReader(path, depth=2) as reader:
        for start in range(0, 40, 5):  # 8 batches of 5 reads through a ring of 2 entries
            blocks = [(start + i) % NUM_BLOCKS for i in range(5)]
            reader.read([ReadOp(b * BLOCK, view[i * BLOCK:(i + 1) * BLOCK]) for i, b in enumerate(blocks)])
            assert bytes(view) == b"".join(data[b * BLOCK:(b + 1) * BLOCK] for b in blocks)


def test_io_uring_interrupted_batch_waits_for_its_reads_and_the_ring_stays_usable(data_file, monkeypatch):
    uring_or_skip()
    path, data = data_file
    real_read, calls = os.eventfd_read, []

    def interrupted_once(fd):
        calls.append(fd)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real_read(fd)

    view = memoryview(aligned(8 * BLOCK).numpy())
    ops = [ReadOp(b * BLOCK, view[b * BLOCK:(b + 1) * BLOCK]) for b in range(8)]
    with UringReader(path, direct=direct_io_supported(path), depth=4) as reader:
        monkeypatch.setattr(os, "eventfd_read", interrupted_once)
        for _ in range(20):  # until a batch had to wait (reads served at submit never do)
            try:
                reader.read(ops)
            except KeyboardInterrupt:
                break
        monkeypatch.setattr(os, "eventfd_read", real_read)
        assert calls, "no batch ever waited for a completion"
        view[:] = bytes(len(view))
        reader.read(ops)  # no stale completion of the interrupted batch is left in the ring
        assert bytes(view) == data[:8 * BLOCK]


def test_io_uring_registered_buffers_read_exact_bytes(data_file):
    uring_or_skip()
    path, data = data_file
    dest = aligned(4 * BLOCK)
    view = memoryview(dest.numpy())
    with UringReader(path, direct=direct_io_supported(path), registered=view) as reader:
        reader.read([ReadOp((3 - i) * BLOCK, view[i * BLOCK:(i + 1) * BLOCK]) for i in range(4)])
        if reader.uses_fixed_buffers:
            assert "registered buffers" in reader.describe()
    assert bytes(view) == b"".join(data[b * BLOCK:(b + 1) * BLOCK] for b in (3, 2, 1, 0))


def test_io_uring_registration_is_split_into_whole_granules_and_can_be_replaced(data_file, monkeypatch):
    from tierstore.io.readers import uring

    uring_or_skip()
    path, data = data_file
    monkeypatch.setattr(uring, "MAX_FIXED_BYTES", 2 * BLOCK + 100)  # 2 granules per piece
    dest = aligned(5 * BLOCK)
    view = memoryview(dest.numpy())
    with UringReader(path, direct=direct_io_supported(path), depth=4) as reader:
        if not reader.register(view, granule=BLOCK):
            pytest.skip("the kernel refused fixed buffers here")
        assert len(reader._fixed) == 3  # 2 + 2 + 1 granules
        blocks = [7, 3, 11, 0, 5]
        ops = [ReadOp(b * BLOCK, view[i * BLOCK:(i + 1) * BLOCK]) for i, b in enumerate(blocks)]
        ops.append(ReadOp(20 * BLOCK, view[BLOCK:3 * BLOCK]))  # straddles two pieces: plain readv
        assert [reader._fixed_index(op) for op in ops] == [0, 0, 1, 1, 2, None]
        reader.read(ops[:5])
        assert bytes(view) == b"".join(data[b * BLOCK:(b + 1) * BLOCK] for b in blocks)
        reader.read(ops[5:])
        assert bytes(view[BLOCK:3 * BLOCK]) == data[20 * BLOCK:22 * BLOCK]
        assert reader.register(view[:BLOCK], granule=BLOCK) and len(reader._fixed) == 1
        assert not reader.register(None) and not reader.uses_fixed_buffers
    assert not reader.register(view)  # closed


@pytest.mark.parametrize("make", ["memory", "preadv", "uring"])
def test_read_past_end_of_file_fails_closed_naming_the_offset(data_file, make):
    path, data = data_file
    if make == "uring":
        uring_or_skip()
    reader = {"memory": lambda: MemoryReader(data), "preadv": lambda: PreadvPoolReader(path),
              "uring": lambda: UringReader(path)}[make]()
    dest = bytearray(3 * BLOCK)
    view = memoryview(dest)
    tail = (NUM_BLOCKS - 1) * BLOCK
    ops = [ReadOp(0, view[:BLOCK]), ReadOp(tail, view[BLOCK:3 * BLOCK])]  # second runs 1 block past EOF
    with pytest.raises(ReadError, match=rf"1 of 2 reads .* offset {tail}: short read"):
        reader.read(ops)
    assert bytes(view[:BLOCK]) == data[:BLOCK]  # the good read of the batch still completed
    reader.close()


def test_direct_reads_refuse_misaligned_requests(data_file):
    path, _ = data_file
    if not direct_io_supported(path):
        pytest.skip("filesystem refuses O_DIRECT")
    dest = aligned(2 * BLOCK)
    view = memoryview(dest.numpy())
    with PreadvPoolReader(path, direct=True) as reader:
        for op in (ReadOp(100, view[:BLOCK]), ReadOp(0, view[:BLOCK - 1]), ReadOp(0, view[1:BLOCK + 1])):
            with pytest.raises(ReadError, match="4096-aligned"):
                reader.read([op])


def test_injected_faults_fire_once_and_a_retry_reads_correct_bytes(data_file):
    path, data = data_file
    reader = FaultyReader(PreadvPoolReader(path), FaultPlan(eio_offsets={BLOCK}, short_offsets={3 * BLOCK}))
    dest = bytearray(4 * BLOCK)
    view = memoryview(dest)
    ops = [ReadOp(b * BLOCK, view[b * BLOCK:(b + 1) * BLOCK]) for b in range(4)]
    with pytest.raises(ReadError) as failure:
        reader.read(ops)
    message = str(failure.value)
    assert "2 of 4 reads" in message and "Input/output error" in message and "short read" in message
    assert bytes(view[BLOCK:2 * BLOCK]) != data[BLOCK:2 * BLOCK]  # the failed destination is scribbled
    reader.read(ops)
    assert bytes(view) == data[:4 * BLOCK]
    assert reader.fired == [("eio", BLOCK), ("short", 3 * BLOCK)]


def test_persistent_faults_and_bit_flips(data_file):
    path, data = data_file
    reader = FaultyReader(MemoryReader(data), FaultPlan(eio_offsets={0}, flip_offsets={BLOCK}, persistent=True))
    view = memoryview(bytearray(BLOCK))
    for _ in range(2):
        with pytest.raises(ReadError):
            reader.read([ReadOp(0, view)])
    reader.read([ReadOp(BLOCK, view)])  # a flip is silent at this level: checksums catch it
    flipped = bytes(view)
    assert flipped != data[BLOCK:2 * BLOCK]
    assert sum(bin(a ^ b).count("1") for a, b in zip(flipped, data[BLOCK:2 * BLOCK])) == 1


def test_rate_faults_are_reproducible_from_the_seed(data_file):
    _, data = data_file

    def fired(seed):
        reader = FaultyReader(MemoryReader(data), FaultPlan(eio_rate=0.3, seed=seed))
        view = memoryview(bytearray(NUM_BLOCKS * BLOCK))
        with pytest.raises(ReadError):
            reader.read([ReadOp(b * BLOCK, view[b * BLOCK:(b + 1) * BLOCK]) for b in range(NUM_BLOCKS)])
        return reader.fired

    assert fired(7) == fired(7)
    assert 0 < len(fired(7)) < NUM_BLOCKS


def test_backend_choice_is_logged_once_and_can_be_forced(data_file, caplog):
    path, _ = data_file
    chosen_backend.cache_clear()
    with caplog.at_level(logging.INFO, logger="tierstore.io"):
        make_reader(path).close()
        make_reader(path).close()
    assert len([r for r in caplog.records if "reader backend" in r.message]) == 1
    reader = make_reader(path, backend="preadv-pool")
    assert isinstance(reader, PreadvPoolReader)
    reader.close()
    with pytest.raises(ValueError, match="unknown reader backend"):
        make_reader(path, backend="bogus")
    chosen_backend.cache_clear()


def test_kernel_version_parsing():
    assert kernel_version("6.18.44-fc-v857") == (6, 18)
    assert kernel_version("5.4.0-150-generic") == (5, 4)
    assert kernel_version("garbage") == (0, 0)


def test_missing_binding_or_old_kernel_falls_back_to_the_pool(data_file, monkeypatch):
    from tierstore.io.readers import choice

    path, _ = data_file
    monkeypatch.setattr(choice, "load_liburing", lambda: (_ for _ in ()).throw(ReadError("no liburing")))
    chosen_backend.cache_clear()
    try:
        assert uring_unavailable_reason() == "no liburing"
        assert chosen_backend("auto") == "preadv-pool"
        with pytest.raises(ReadError, match="io_uring was requested but is unavailable"):
            chosen_backend("io_uring")
        monkeypatch.setattr(choice.platform, "release", lambda: "5.15.0")
        assert "older than 6.14" in uring_unavailable_reason()
    finally:
        chosen_backend.cache_clear()
