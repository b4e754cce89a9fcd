"""Fetch benchmark: pack -> arena per reader backend and queue depth, next to a plain O_DIRECT
baseline read of the same bytes in the same run; then (with CUDA) arena -> GPU next to a plain
pinned `copy_` baseline.

Rows are the ds4-flash base row (6.75 MiB). The pack file is written once (`rows * 2` rows, so
every batch reads rows the previous batch did not) and read with O_DIRECT: the page cache is not
measured. Paths per backend: `raw` (reader only), `read-then-verify` (all reads, then every
row's checksum: the arena path before checksums overlapped the reads) and `arena` (fetch of all
misses: checksums overlapped with the reads, then publish). Used by `tierstore bench io` and by
the checkout's `benchmarks/io_fetch.py`.
"""

from __future__ import annotations

import errno
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from tierstore.bench.provenance import filesystem_of, provenance
from tierstore.cache.arena import Arena
from tierstore.errors import ConfigError
from tierstore.geometry import get_preset
from tierstore.io.checksum import row_checksum
from tierstore.io.layout import PackSpec
from tierstore.io.pack import Pack
from tierstore.io.pack_rows import PackRows
from tierstore.io.pack_writer import PackWriter
from tierstore.io.readers import PreadvPoolReader, ReadOp, UringReader
from tierstore.io.readers.choice import uring_unavailable_reason
from tierstore.io.row_codec import row_bytes, row_segments

PATHS = ("raw", "read-then-verify", "arena")
MEMORY_FILESYSTEMS = {"tmpfs", "ramfs", "hugetlbfs", "devtmpfs"}
Log = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def check_direct_io(directory: Path) -> str | None:
    """Raise ConfigError when `directory` cannot serve O_DIRECT reads (with what to do instead);
    return a warning when it can but is memory-backed (the numbers are then RAM, not a disk)."""
    fs = filesystem_of(directory)
    where = f"{directory} ({fs['fstype'] or 'unknown filesystem'})"
    probe = directory / f".tierstore-odirect-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"\0" * mmap.PAGESIZE)
        try:
            fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
                raise ConfigError(f"{where} does not support O_DIRECT, which this benchmark needs to measure the "
                                  "disk rather than the page cache; pass --dir on a disk-backed filesystem "
                                  "(ext4, xfs, btrfs), e.g. the one holding your packs") from exc
            raise ConfigError(f"cannot open a file in {where} with O_DIRECT: {exc.strerror}") from exc
        try:
            buffer = mmap.mmap(-1, mmap.PAGESIZE)  # page-aligned
            try:
                os.preadv(fd, [buffer], 0)
            except OSError as exc:
                raise ConfigError(f"O_DIRECT reads fail in {where}: {exc.strerror}; pass --dir on a "
                                  "disk-backed filesystem (ext4, xfs, btrfs)") from exc
            finally:
                buffer.close()
        finally:
            os.close(fd)
    finally:
        probe.unlink(missing_ok=True)
    if fs["fstype"] in MEMORY_FILESYSTEMS:
        return (f"{where} is memory-backed: O_DIRECT is accepted but these numbers measure RAM, not a disk; "
                "pass --dir on the disk that will hold your packs")
    return None


def make_pack(directory: Path, num_rows: int) -> Pack:
    """A pack of at least `num_rows` random ds4-flash base rows, 8 experts per layer (reused when
    `directory` already holds it)."""
    segments = row_segments("base", get_preset("ds4-flash"))
    spec = PackSpec(tag="base", num_layers=-(-num_rows // 8), num_experts=8, row_bytes=row_bytes(segments),
                    checkpoint_id="io-benchmark", abi_tag="bench", zero_mode="auto", segments=segments)
    with PackWriter(directory, spec) as writer:
        generator = torch.Generator().manual_seed(0)
        for layer in range(spec.num_layers):
            if layer not in writer.written_layers():
                rows = (torch.randint(0, 256, (spec.row_bytes,), dtype=torch.uint8, generator=generator).numpy()
                        for _ in range(spec.num_experts))
                writer.write_layer(layer, rows)
    return Pack(directory, spec)


def baseline_direct(fd: int, pool: ThreadPoolExecutor, offsets: list[int], view: memoryview, stride: int) -> float:
    """A minimal O_DIRECT loop: plain os.preadv on a thread pool, no tierstore code."""
    started = time.perf_counter()
    list(pool.map(lambda i: os.preadv(fd, [view[i * stride:(i + 1) * stride]], offsets[i]), range(len(offsets))))
    return time.perf_counter() - started


def available_backends() -> list[str]:
    return ["preadv-pool"] + (["io_uring"] if uring_unavailable_reason() is None else [])


def open_reader(backend: str, path: Path, depth: int, registered: memoryview | None):
    if backend == "io_uring":
        return UringReader(path, direct=True, depth=depth, registered=registered)
    return PreadvPoolReader(path, direct=True, threads=depth)


def read_then_verify(pack: Pack, reader, keys, ops) -> None:
    """The pre-overlap arena path: every read of the batch, then every checksum."""
    reader.read(ops)
    for key, op in zip(keys, ops):
        if row_checksum(op.dest[:pack.spec.row_bytes]) != pack.checksum(*key):
            raise RuntimeError(f"row {key} fails its checksum")


def ops_for(spec, keys, view: memoryview) -> list[ReadOp]:
    return [ReadOp(spec.row_offset(*k), view[i * spec.stride:(i + 1) * spec.stride]) for i, k in enumerate(keys)]


def disk_section(pack: Pack, rows: int, repeats: int, depths: list[int], backends: list[str] | None = None,
                 log: Log = _quiet) -> list[dict]:
    """Per queue depth and backend, each repeat runs the baseline and the backend's paths back to
    back, so drift of the shared disk hits all of them alike; the best repeat of each is reported.
    Readers, thread pools and arenas are made and warmed once per depth (steady state: no thread
    start-up or first-touch page faults are timed). Batches alternate between two key sets, so
    every arena fetch is all misses. All paths of a backend read into that arena's own slot
    memory: on the dev VM, read speed depended on the destination allocation by up to 2x.
    The raw and baseline reads overwrite slots of the previous batch's keys, which the next fetch
    (all misses) evicts and rereads: no row is ever served from them."""
    spec = pack.spec
    backends = backends or available_backends()
    results = []
    batches = [[(i // 8, i % 8) for i in range(start, start + rows)] for start in (0, rows)]
    batch_bytes = rows * spec.stride
    pin = torch.cuda.is_available()
    fd = os.open(pack.path, os.O_RDONLY | os.O_DIRECT)
    try:
        for depth in depths:
            pool = ThreadPoolExecutor(depth)
            for backend in backends:
                reader = open_reader(backend, pack.path, depth, None)
                arena = Arena(PackRows(pack, open_reader(backend, pack.path, depth, None)), rows, pin=pin)
                view = arena.slot_memory()
                times = {"baseline": [], "raw": [], "read-then-verify": [], "arena": []}
                for r in range(2 + repeats):  # two warm-up rounds: threads started, memory touched
                    keys = batches[r % 2]
                    ops = ops_for(spec, keys, view)
                    for path, run in (("baseline", lambda: baseline_direct(fd, pool, [op.offset for op in ops], view,
                                                                          spec.stride)),
                                      ("raw", lambda: reader.read(ops)),
                                      ("read-then-verify", lambda: read_then_verify(pack, reader, keys, ops)),
                                      ("arena", lambda: arena.fetch(keys))):
                        started = time.perf_counter()
                        run()
                        if r >= 2:
                            times[path].append(time.perf_counter() - started)
                if arena.stats().hit_rows != 0:
                    raise RuntimeError("an arena fetch of the benchmark hit rows it should have missed")
                reader.close()
                arena.close()
                arena.source.close()
                base_samples = times.pop("baseline")
                base_s = min(base_samples)
                for path, samples in times.items():
                    best = min(samples)
                    results.append({"backend": backend, "path": path, "queue_depth": depth, "rows": rows,
                                    "bytes": batch_bytes, "seconds": best, "gb_per_s": batch_bytes / best / 1e9,
                                    "baseline_gb_per_s": batch_bytes / base_s / 1e9,
                                    "pct_of_baseline": 100 * base_s / best, "samples_s": samples,
                                    "baseline_samples_s": base_samples})
                    log(f"{backend:12s} {path:16s} qd={depth:3d}: {batch_bytes / best / 1e9:6.2f} GB/s "
                        f"(baseline {batch_bytes / base_s / 1e9:6.2f} GB/s, {100 * base_s / best:5.1f}%)")
            pool.shutdown()
    finally:
        os.close(fd)
    return results


def gpu_section(pack: Pack, rows: int, repeats: int, log: Log = _quiet) -> list[dict]:
    """Arena -> GPU, one copy per row, next to one plain pinned `copy_` of the same bytes."""
    spec = pack.spec
    keys = [(i // 8, i % 8) for i in range(rows)]
    arena = Arena(PackRows(pack, PreadvPoolReader(pack.path, direct=True, threads=16)), rows, pin=True)
    views = arena.fetch(keys)
    pinned = torch.empty(rows * spec.row_bytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(rows * spec.row_bytes, dtype=torch.uint8, device="cuda")
    results = []

    def timed(fn) -> float:
        best = float("inf")
        for _ in range(repeats + 1):
            torch.cuda.synchronize()
            started = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - started)
        return best

    def from_arena():
        for i, view in enumerate(views):
            device[i * spec.row_bytes:(i + 1) * spec.row_bytes].copy_(view, non_blocking=True)

    base_s = timed(lambda: device.copy_(pinned, non_blocking=True))
    arena_s = timed(from_arena)
    arena.close()
    arena.source.close()
    nbytes = rows * spec.row_bytes
    results.append({"path": "arena->gpu", "rows": rows, "bytes": nbytes, "seconds": arena_s,
                    "gb_per_s": nbytes / arena_s / 1e9, "baseline_gb_per_s": nbytes / base_s / 1e9,
                    "pct_of_baseline": 100 * base_s / arena_s})
    log(f"arena->gpu: {nbytes / arena_s / 1e9:.2f} GB/s (pinned copy_ {nbytes / base_s / 1e9:.2f} GB/s)")
    return results


def run_io(directory: Path | str, rows: int = 64, repeats: int = 3, depths: tuple[int, ...] = (1, 8, 32),
           backends: list[str] | None = None, gpu: bool | None = None, log: Log = _quiet,
           commit: str | None = None) -> dict:
    """The whole benchmark in `directory` (the pack is written there and left for the caller to
    remove). Returns {"provenance", "settings", "row_bytes", "stride", "disk", "gpu"?}."""
    if rows < 1 or repeats < 1 or not depths or min(depths) < 1:
        raise ConfigError("rows, repeats and every queue depth must be >= 1")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    warning = check_direct_io(directory)
    if warning:
        log(f"warning: {warning}")
    uring_reason = uring_unavailable_reason()
    known = ["preadv-pool"] + (["io_uring"] if uring_reason is None else [])
    if backends:
        missing = [b for b in backends if b not in known]
        if missing:
            reason = uring_reason if "io_uring" in missing else None
            raise ConfigError(f"reader backend(s) {', '.join(missing)} not available here"
                              + (f" (io_uring: {reason}; `pip install tierstore[uring]` adds the binding)"
                                 if reason else "") + f"; available: {', '.join(known)}")
    pack = make_pack(directory, 2 * rows)
    result = {"provenance": provenance(disk=directory, commit=commit),
              "settings": {"rows": rows, "repeats": repeats, "depths": list(depths),
                           "backends": backends or known, "row": "ds4-flash base",
                           "io_uring_unavailable": uring_reason},
              "row_bytes": pack.spec.row_bytes, "stride": pack.spec.stride}
    if warning:
        result["warning"] = warning
    result["disk"] = disk_section(pack, rows, repeats, list(depths), backends or known, log)
    use_gpu = torch.cuda.is_available() if gpu is None else gpu
    if use_gpu:
        result["gpu"] = gpu_section(pack, rows, repeats, log)
    else:
        result["gpu_skipped"] = "no CUDA device" if not torch.cuda.is_available() else "disabled"
    return result
