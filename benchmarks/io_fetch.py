"""Fetch benchmark: pack -> arena per reader backend and queue depth, next to a plain O_DIRECT
baseline read of the same bytes in the same run; then (with CUDA) arena -> GPU next to a plain
pinned copy_ baseline.

    .venv/bin/python benchmarks/io_fetch.py --dir /path/on/the/disk [--rows 64] [--repeats 3]

Rows are the ds4-flash base row (6.75 MiB). The pack file is written once (`rows * 2` rows, so
every batch reads rows the previous batch did not) and read with O_DIRECT: the page cache is not
measured. Paths per backend: `raw` (reader only), `read-then-verify` (all reads, then every
row's checksum: the arena path before checksums overlapped the reads) and `arena` (fetch of all
misses: checksums overlapped with the reads, then publish). Writes JSON with provenance to
benchmarks/results/io_fetch_<host>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from tierstore.cache.arena import Arena
from tierstore.geometry import get_preset
from tierstore.io.checksum import row_checksum
from tierstore.io.layout import PackSpec
from tierstore.io.pack import Pack
from tierstore.io.pack_rows import PackRows
from tierstore.io.pack_writer import PackWriter
from tierstore.io.readers import PreadvPoolReader, ReadOp, UringReader
from tierstore.io.readers.choice import uring_unavailable_reason
from tierstore.io.row_codec import row_bytes, row_segments

ROOT = Path(__file__).resolve().parents[1]


def provenance() -> dict:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit, "host": platform.node(), "kernel": platform.release(),
            "python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()}
    try:
        import liburing  # noqa: F401
        from importlib.metadata import version
        info["liburing"] = version("liburing")
    except ImportError:
        info["liburing"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def make_pack(directory: Path, num_rows: int) -> Pack:
    segments = row_segments("base", get_preset("ds4-flash"))
    spec = PackSpec(tag="base", num_layers=num_rows // 8, num_experts=8, row_bytes=row_bytes(segments),
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


def disk_section(pack: Pack, rows: int, repeats: int, depths: list[int]) -> list[dict]:
    """Per queue depth and backend, each repeat runs the baseline and the backend's paths back to
    back, so drift of the shared disk hits all of them alike; the best repeat of each is reported.
    Readers, thread pools and arenas are made and warmed once per depth (steady state: no thread
    start-up or first-touch page faults are timed). Batches alternate between two key sets, so
    every arena fetch is all misses. All paths of a backend read into that arena's own slot
    memory: on the dev VM, read speed depended on the destination allocation by up to 2x.
    The raw and baseline reads overwrite slots of the previous batch's keys, which the next fetch
    (all misses) evicts and rereads: no row is ever served from them."""
    spec = pack.spec
    backends = ["preadv-pool"] + (["io_uring"] if uring_unavailable_reason() is None else [])
    results = []
    batches = [[(i // 8, i % 8) for i in range(start, start + rows)] for start in (0, rows)]
    batch_bytes = rows * spec.stride
    pin = torch.cuda.is_available()
    fd = os.open(pack.path, os.O_RDONLY | os.O_DIRECT)
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
            assert arena.stats().hit_rows == 0  # every arena fetch was all misses
            reader.close()
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
                print(f"{backend:12s} {path:16s} qd={depth:3d}: {batch_bytes / best / 1e9:6.2f} GB/s "
                      f"(baseline {batch_bytes / base_s / 1e9:6.2f} GB/s, {100 * base_s / best:5.1f}%)")
        pool.shutdown()
    os.close(fd)
    return results


def ops_for(spec, keys, view: memoryview) -> list[ReadOp]:
    return [ReadOp(spec.row_offset(*k), view[i * spec.stride:(i + 1) * spec.stride]) for i, k in enumerate(keys)]


def gpu_section(pack: Pack, rows: int, repeats: int) -> list[dict]:
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
    nbytes = rows * spec.row_bytes
    results.append({"path": "arena->gpu", "rows": rows, "bytes": nbytes, "seconds": arena_s,
                    "gb_per_s": nbytes / arena_s / 1e9, "baseline_gb_per_s": nbytes / base_s / 1e9,
                    "pct_of_baseline": 100 * base_s / arena_s})
    print(f"arena->gpu: {nbytes / arena_s / 1e9:.2f} GB/s (pinned copy_ {nbytes / base_s / 1e9:.2f} GB/s)")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="directory on the disk to measure")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--depths", default="1,8,32")
    parser.add_argument("--out", default=None, help="result JSON (default benchmarks/results/io_fetch_<host>.json)")
    args = parser.parse_args()
    pack = make_pack(Path(args.dir), 2 * args.rows)
    result = {"provenance": provenance(), "row_bytes": pack.spec.row_bytes, "stride": pack.spec.stride,
              "disk": disk_section(pack, args.rows, args.repeats, [int(d) for d in args.depths.split(",")])}
    if torch.cuda.is_available():
        result["gpu"] = gpu_section(pack, args.rows, args.repeats)
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"io_fetch_{platform.node() or 'host'}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
