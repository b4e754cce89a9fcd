"""Pack writes: resumable, crash-safe at any point, concurrent writers merge, stale packs rebuilt,
corrupt rows never served."""

import hashlib
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_helpers import Watched

from tierstore.errors import CapacityError, PackFormatError
from tierstore.io import pack_writer
from tierstore.io.layout import PackSpec
from tierstore.io.pack import Pack, PackPaths
from tierstore.io.pack_rows import PackRows
from tierstore.io.pack_writer import PackWriter
from tierstore.io.readers import MemoryReader, PreadvPoolReader

SPEC_FIELDS = dict(tag="base", num_layers=6, num_experts=4, row_bytes=5000, checkpoint_id="ckpt-a",
                   abi_tag="w2-test", zero_mode="auto")

# A writer process: writes the given layers of the SPEC_FIELDS pack (with an overridable row size),
# one row per `delay` seconds, printing each committed layer (and "writing" on stderr once the pack is open).
WRITER_SCRIPT = """
import hashlib, json, sys, time
from tierstore.io.layout import PackSpec
from tierstore.io.pack_writer import PackWriter
fields, directory, layers, delay = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4])
spec = PackSpec(**fields)
def rows(layer):
    for expert in range(spec.num_experts):
        time.sleep(delay)
        yield hashlib.shake_128(f"{layer},{expert}".encode()).digest(spec.row_bytes)
with PackWriter(directory, spec) as writer:
    print("writing", file=sys.stderr, flush=True)
    for layer in layers:
        if layer in writer.written_layers():
            continue
        writer.write_layer(layer, rows(layer))
        print(layer, flush=True)
"""


def make_spec(**overrides) -> PackSpec:
    return PackSpec(**{**SPEC_FIELDS, **overrides})


def row(layer: int, expert: int, row_bytes: int = 5000) -> bytes:
    return hashlib.shake_128(f"{layer},{expert}".encode()).digest(row_bytes)


def write_layers(directory, spec, layers):
    with PackWriter(directory, spec) as writer:
        for layer in layers:
            writer.write_layer(layer, (row(layer, e, spec.row_bytes) for e in range(spec.num_experts)))


def read_all_written(directory, spec) -> dict:
    """Every written row of the pack, read and checksum-verified."""
    pack = Pack(directory, spec)
    rows = {}
    with PreadvPoolReader(pack.path) as reader:
        source = PackRows(pack, reader)
        for layer in sorted(pack.layers):
            for expert in range(spec.num_experts):
                dest = memoryview(bytearray(spec.stride))
                source.read_rows([(layer, expert)], [dest])
                rows[layer, expert] = bytes(dest[:spec.row_bytes])
    return rows


def writer_args(directory, spec_fields, layers, delay=0.0) -> list[str]:
    return [sys.executable, "-P", "-c", WRITER_SCRIPT, json.dumps(spec_fields), str(directory), json.dumps(layers),
            str(delay)]


def run_writer(directory, spec_fields, layers, delay=0.0, **popen):
    return subprocess.Popen(writer_args(directory, spec_fields, layers, delay), stdout=subprocess.PIPE, text=True,
                            **popen)


def test_written_layers_read_back_exactly_and_unwritten_layers_are_refused(tmp_path):
    spec = make_spec()
    write_layers(tmp_path, spec, [0, 4])
    rows = read_all_written(tmp_path, spec)
    assert set(rows) == {(l, e) for l in (0, 4) for e in range(4)}
    assert all(rows[k] == row(*k) for k in rows)
    pack = Pack(tmp_path, spec)
    assert os.stat(pack.path).st_size == spec.file_bytes
    assert os.stat(pack.path).st_blocks * 512 < spec.file_bytes  # sparse: unwritten layers are holes
    with PreadvPoolReader(pack.path) as reader:
        with pytest.raises(PackFormatError, match="layer 1 is not written"):
            PackRows(pack, reader).read_rows([(1, 0)], [memoryview(bytearray(spec.stride))])


def test_bad_rows_are_refused(tmp_path):
    spec = make_spec()
    with PackWriter(tmp_path, spec) as writer:
        with pytest.raises(PackFormatError, match="row is 4999 bytes"):
            writer.write_layer(0, [b"x" * 4999] * 4)
        with pytest.raises(PackFormatError, match="3 rows given, 4 needed"):
            writer.write_layer(0, [b"x" * 5000] * 3)
        with pytest.raises(PackFormatError, match="expert 4 is outside"):
            writer.write_layer(0, [b"x" * 5000] * 5)
        with pytest.raises(PackFormatError, match="outside"):
            writer.write_layer(6, [])
        assert writer.written_layers() == frozenset()


def test_flipped_byte_in_a_row_is_detected_and_never_served(tmp_path):
    spec = make_spec()
    write_layers(tmp_path, spec, [2])
    pack = Pack(tmp_path, spec)
    with open(pack.path, "r+b") as handle:
        handle.seek(spec.row_offset(2, 3) + 1234)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x10]))
    with PreadvPoolReader(pack.path) as reader:
        source = PackRows(pack, reader)
        with pytest.raises(PackFormatError, match=r"fail their checksum: \(2, 3\)"):
            source.read_rows([(2, 2), (2, 3)], [memoryview(bytearray(spec.stride)) for _ in range(2)])
        good = memoryview(bytearray(spec.stride))
        source.read_rows([(2, 2)], [good])
        assert bytes(good[:spec.row_bytes]) == row(2, 2)


def test_another_checkpoint_of_identical_geometry_gets_its_own_pack(tmp_path):
    spec_a, spec_b = make_spec(checkpoint_id="model-a"), make_spec(checkpoint_id="model-b")
    write_layers(tmp_path, spec_a, [0])
    with pytest.raises(PackFormatError, match="no sidecar"):
        Pack(tmp_path, spec_b)
    # Even a sidecar of model A renamed into model B's place is stale, never served as B.
    paths_a, paths_b = PackPaths.for_spec(tmp_path, spec_a), PackPaths.for_spec(tmp_path, spec_b)
    os.link(paths_a.sidecar, paths_b.sidecar)
    os.link(paths_a.pack, paths_b.pack)
    with pytest.raises(PackFormatError, match="another configuration"):
        Pack(tmp_path, spec_b)
    with PackWriter(tmp_path, spec_b) as writer:  # a new generation: nothing of A is trusted
        assert writer.written_layers() == frozenset()
    assert Pack(tmp_path, spec_b).layers == frozenset()
    assert read_all_written(tmp_path, spec_a)[0, 1] == row(0, 1)  # A untouched


@pytest.mark.parametrize("damage", ["truncated json", "hostile json", "pack truncated", "pack deleted",
                                    "sidecar deleted"])
def test_damaged_packs_start_a_new_generation(tmp_path, damage):
    spec = make_spec()
    write_layers(tmp_path, spec, [0, 1])
    paths = PackPaths.for_spec(tmp_path, spec)
    if damage == "truncated json":
        paths.sidecar.write_bytes(paths.sidecar.read_bytes()[:50])
    elif damage == "hostile json":
        body = json.loads(paths.sidecar.read_bytes())
        body["layers"] = [0, 1, 99]
        paths.sidecar.write_text(json.dumps(body))
    elif damage == "pack truncated":
        os.truncate(paths.pack, spec.file_bytes - 4096)
    elif damage == "pack deleted":
        paths.pack.unlink()
    else:
        paths.sidecar.unlink()
    with pytest.raises(PackFormatError):
        Pack(tmp_path, spec)
    before = set(os.listdir(tmp_path))
    write_layers(tmp_path, spec, [1])
    assert Pack(tmp_path, spec).layers == frozenset({1})
    assert read_all_written(tmp_path, spec)[1, 3] == row(1, 3)
    assert set(os.listdir(tmp_path)) <= before | {paths.pack.name, paths.sidecar.name}


def test_failure_between_steps_leaves_the_layer_unrecorded_and_a_rerun_completes_it(tmp_path, monkeypatch):
    spec = make_spec()
    write_layers(tmp_path, spec, [0])
    real_write = pack_writer.atomic_write_bytes

    def fail_commit(*args):
        raise OSError(5, "injected failure during sidecar commit")

    monkeypatch.setattr(pack_writer, "atomic_write_bytes", fail_commit)
    with pytest.raises(OSError, match="injected"):
        write_layers(tmp_path, spec, [1])
    monkeypatch.setattr(pack_writer, "atomic_write_bytes", real_write)
    assert Pack(tmp_path, spec).layers == frozenset({0})
    write_layers(tmp_path, spec, [1])
    assert Pack(tmp_path, spec).layers == frozenset({0, 1})
    assert read_all_written(tmp_path, spec)[1, 2] == row(1, 2)


def test_disk_full_during_a_build_is_a_clear_error_and_keeps_committed_layers(tmp_path, monkeypatch):
    spec = make_spec()
    write_layers(tmp_path, spec, [0, 1])
    calls = []

    def full_disk(fd, data, offset):
        calls.append(offset)
        if len(calls) > 3:
            raise OSError(28, "No space left on device")
        real(fd, data, offset)

    real = pack_writer.write_all
    monkeypatch.setattr(pack_writer, "write_all", full_disk)
    with pytest.raises(CapacityError, match="disk full while writing layer 2"):
        write_layers(tmp_path, spec, [2])
    monkeypatch.setattr(pack_writer, "write_all", real)
    rows = read_all_written(tmp_path, spec)
    assert set(rows) == {(l, e) for l in (0, 1) for e in range(4)}
    assert all(rows[k] == row(*k) for k in rows)


def test_pack_replaced_mid_write_is_not_recorded(tmp_path):
    spec = make_spec()
    with PackWriter(tmp_path, spec) as writer:
        PackPaths.for_spec(tmp_path, spec).pack.unlink()  # e.g. another process rebuilt it
        with pytest.raises(PackFormatError, match="invalidated|replaced"):
            writer.write_layer(0, (row(0, e) for e in range(4)))
    with pytest.raises(PackFormatError):
        Pack(tmp_path, spec)


def test_two_writer_processes_merge_their_layers(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    first = run_writer(tmp_path, SPEC_FIELDS, [0, 2, 4], delay=0.002, env=env)
    second = run_writer(tmp_path, SPEC_FIELDS, [1, 3, 5], delay=0.002, env=env)
    assert first.wait(60) == 0 and second.wait(60) == 0
    rows = read_all_written(tmp_path, make_spec())
    assert set(rows) == {(l, e) for l in range(6) for e in range(4)}
    assert all(rows[k] == row(*k) for k in rows)


@pytest.mark.slow
def test_kill_9_at_random_moments_never_serves_a_wrong_row_and_reruns_finish_only_what_is_missing(tmp_path):
    fields = {**SPEC_FIELDS, "num_layers": 24, "row_bytes": 128 << 10}
    spec = make_spec(num_layers=24, row_bytes=128 << 10)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    rng = random.Random(4)
    delay = 0.025  # per row: a layer takes >= 4 * delay, so a kill within that much per layer left lands mid-write
    fractions = [(i + rng.random()) / 10 for i in range(10)]  # one per tenth of the write window
    rng.shuffle(fractions)
    for fraction in fractions:
        before = Pack(tmp_path, spec).layers if PackPaths.for_spec(tmp_path, spec).sidecar.exists() else frozenset()
        writer = Watched(writer_args(tmp_path, fields, list(range(24)), delay), b"writing", env=env)
        began = writer.wait_started()  # counted from here, not from the interpreter's start (slow when loaded)
        time.sleep(max(0.0, began + fraction * (24 - len(before)) * 4 * delay - time.monotonic()))
        assert writer.kill() == -9, "the writer finished before its kill"
        rows = read_all_written(tmp_path, spec)  # the generation exists: "writing" comes after it was created
        assert before <= Pack(tmp_path, spec).layers
        assert all(rows[k] == row(*k, spec.row_bytes) for k in rows)
    recorded = Pack(tmp_path, spec).layers
    assert 0 < len(recorded) < 24
    finisher = run_writer(tmp_path, fields, list(range(24)), env=env)
    out, _ = finisher.communicate(timeout=60)
    assert sorted(int(line) for line in out.split()) == sorted(set(range(24)) - recorded)
    rows = read_all_written(tmp_path, spec)
    assert len(rows) == 24 * 4 and all(rows[k] == row(*k, spec.row_bytes) for k in rows)


def test_memory_reader_over_a_pack_image_serves_the_same_rows(tmp_path):
    spec = make_spec()
    write_layers(tmp_path, spec, [3])
    pack = Pack(tmp_path, spec)
    source = PackRows(pack, MemoryReader.from_file(pack.path))
    dest = memoryview(bytearray(spec.stride))
    source.read_rows([(3, 1)], [dest])
    assert bytes(dest[:spec.row_bytes]) == row(3, 1)
    with pytest.raises(PackFormatError, match="another file"):
        PackRows(pack, MemoryReader(pack.path.read_bytes()))
