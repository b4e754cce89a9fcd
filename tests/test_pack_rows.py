"""PackRows verifies each row's checksum as soon as its read finishes, while later reads of the
batch are still outstanding (the last read's row on the thread that read it), and returns only
when every read and verification is done."""

import hashlib
import threading

import pytest

from tierstore.errors import PackFormatError, ReadError
from tierstore.io import pack_rows
from tierstore.io.layout import PackSpec
from tierstore.io.pack import Pack
from tierstore.io.pack_rows import PackRows
from tierstore.io.pack_writer import PackWriter
from tierstore.io.readers import MemoryReader, PreadvPoolReader

SPEC = PackSpec(tag="base", num_layers=2, num_experts=4, row_bytes=5000, checkpoint_id="rows-test",
                abi_tag="w2-test", zero_mode="auto")


def row(layer, expert):
    return hashlib.shake_128(f"{layer},{expert}".encode()).digest(SPEC.row_bytes)


@pytest.fixture
def pack(tmp_path):
    with PackWriter(tmp_path, SPEC) as writer:
        for layer in range(SPEC.num_layers):
            writer.write_layer(layer, (row(layer, e) for e in range(SPEC.num_experts)))
    return Pack(tmp_path, SPEC)


class SteppedReader(MemoryReader):
    """Serves reads one at a time; before read i > 0 it waits until row i - 1 was checksummed,
    which can only happen if verification overlaps the batch's reads."""

    def __init__(self, path, verified: list[threading.Event]):
        with open(path, "rb") as handle:
            image = handle.read()
        super().__init__(image, identity=MemoryReader.from_file(path).file_identity())
        self.verified = verified

    def submit(self, ops, on_read=None):
        for index, op in enumerate(ops):
            if index and not self.verified[index - 1].wait(timeout=10):
                raise ReadError(f"row {index - 1} was not verified before read {index} started")
            super().submit([op], on_read=lambda _, index=index: on_read(index))
        return super().submit([])


def test_rows_are_verified_while_later_reads_are_outstanding(pack, monkeypatch):
    keys = [(1, 0), (0, 3), (1, 2)]
    verified = [threading.Event() for _ in keys]
    expected = {row(*key): index for index, key in enumerate(keys)}
    real_checksum = pack_rows.row_checksum

    def checksum(payload):
        digest = real_checksum(payload)
        verified[expected[bytes(payload)]].set()
        return digest

    monkeypatch.setattr(pack_rows, "row_checksum", checksum)
    source = PackRows(pack, SteppedReader(pack.path, verified))
    dests = [memoryview(bytearray(SPEC.stride)) for _ in keys]
    source.read_rows(keys, dests)
    assert [bytes(d[:SPEC.row_bytes]) for d in dests] == [row(*key) for key in keys]
    source.close()


def test_a_corrupt_row_fails_the_batch_after_every_verification_finished(pack):
    image = bytearray(pack.path.read_bytes())
    image[SPEC.row_offset(0, 2) + 17] ^= 0x04
    identity = MemoryReader.from_file(pack.path).file_identity()
    source = PackRows(pack, MemoryReader(image, identity=identity), verify_threads=3)
    keys = [(0, 1), (0, 2), (1, 1)]
    with pytest.raises(PackFormatError, match=r"1 row\(s\) .* fail their checksum: \(0, 2\)"):
        source.read_rows(keys, [memoryview(bytearray(SPEC.stride)) for _ in keys])
    with pytest.raises(ValueError, match="verify_threads"):
        PackRows(pack, MemoryReader(image, identity=identity), verify_threads=0)
    source.close()


def _hashing_threads(monkeypatch) -> list[str]:
    """Patch PackRows' checksum to record the name of each thread that runs it."""
    names: list[str] = []
    real_checksum = pack_rows.row_checksum

    def checksum(payload):
        names.append(threading.current_thread().name)
        return real_checksum(payload)

    monkeypatch.setattr(pack_rows, "row_checksum", checksum)
    return names


def test_the_last_read_of_a_batch_is_verified_where_it_was_read_and_the_others_on_the_pool(pack, monkeypatch):
    names = _hashing_threads(monkeypatch)
    source = PackRows(pack, PreadvPoolReader(pack.path, threads=4))
    keys = [(0, 0), (1, 3), (0, 2), (1, 1)]
    dests = [memoryview(bytearray(SPEC.stride)) for _ in keys]
    source.read_rows(keys, dests)
    assert [bytes(d[:SPEC.row_bytes]) for d in dests] == [row(*key) for key in keys]
    assert len(names) == len(keys)
    assert sum(not name.startswith("tierstore-verify") for name in names) == 1
    names.clear()
    source.read_rows([(1, 2)], dests[:1])  # one row: on the calling thread (the pool reads <= 2 rows there)
    assert names == [threading.current_thread().name]
    assert bytes(dests[0][:SPEC.row_bytes]) == row(1, 2)
    source.close()


@pytest.mark.parametrize("keys", [[(0, 2)], [(0, 1), (0, 2)], [(0, 2), (0, 1)]])
def test_a_corrupt_row_fails_its_batch_whichever_thread_verified_it(pack, keys):
    image = bytearray(pack.path.read_bytes())
    image[SPEC.row_offset(0, 2) + 4999] ^= 0x80
    identity = MemoryReader.from_file(pack.path).file_identity()
    source = PackRows(pack, MemoryReader(image, identity=identity))
    with pytest.raises(PackFormatError, match=r"1 row\(s\) .* fail their checksum: \(0, 2\)"):
        source.read_rows(keys, [memoryview(bytearray(SPEC.stride)) for _ in keys])
    source.close()
