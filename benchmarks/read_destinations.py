"""A step's few pack rows read into pinned against pageable memory, with and without checksums, back to back or
after an idle gap: side by side in one process on one pack.

Without an arena the runtime reads a step's missing rows (often 1-4) into the arena's pinned staging buffer through
`PackRows` (checksums verified as rows land), once per step, with the GPU's pass between reads. In issue #5's runs
such a read took 1.3-1.7x as long per row as the floor's probe, which reads 64-row batches back to back into pageable
memory. This times, for each batch size, every combination of

- destination: `pinned` (page-locked, as the staging buffer and the arena are on CUDA) or `pageable` (page-aligned,
  as the probe's);
- path: `checked` (`PackRows.read_rows`, the runtime's reads: each row's checksum on the verification thread as it
  lands, the last one's where it was read), `pooled` (the same reads, every checksum handed to a verification thread
  as it lands: `PackRows` before the thirtieth session), `inline` (the same reads, then each checksum on the calling
  thread) or `raw` (the same reads, no checksums);
- gap: `0` (batches back to back, as the probe) or the `--gap-ms` idle time before each batch (as between steps);

the variants taking turns round by round, every batch drawing rows that no earlier batch read (the pack holds all
the preset's layers). It also times one row's checksum alone. The table gives the median ms per batch
(GB/s), one line per variant.

    python3 benchmarks/read_destinations.py --preset ds-v2-lite --pack-dir /tmp/rd --json out.json
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tierstore.cache.arena import aligned_host_buffer  # noqa: E402
from tierstore.geometry import get_preset  # noqa: E402
from tierstore.io.checksum import row_checksum  # noqa: E402
from tierstore.io.readers.base import ReadOp  # noqa: E402
from tierstore.io.readers.choice import chosen_backend  # noqa: E402
from tierstore.runtime.replay import ensure_synthetic_pack, open_synthetic_rows  # noqa: E402

DESTINATIONS = ("pinned", "pageable")
PATHS = ("checked", "pooled", "inline", "raw")


def timed_batch(rows, keys: list[tuple[int, int]], dests: list[memoryview], path: str, gap_s: float,
                verifier: ThreadPoolExecutor) -> float:
    """Seconds to read `keys` into `dests` by `path`, after sleeping `gap_s` (off the clock)."""
    if gap_s:
        time.sleep(gap_s)
    started = time.perf_counter()
    if path == "checked":
        rows.read_rows(keys, dests)
        return time.perf_counter() - started
    spec = rows.pack.spec
    ops = [ReadOp(spec.row_offset(layer, expert), dest) for (layer, expert), dest in zip(keys, dests)]
    checks: dict[int, Future] = {}
    on_read = None
    if path == "pooled":
        def on_read(index: int) -> None:
            checks[index] = verifier.submit(row_checksum, dests[index][:rows.row_bytes])
    rows.reader.read(ops, on_read=on_read)
    if path == "raw":
        return time.perf_counter() - started
    sums = ([checks[i].result() for i in range(len(keys))] if path == "pooled"
            else [row_checksum(dest[:rows.row_bytes]) for dest in dests])
    seconds = time.perf_counter() - started
    if sums != [rows.pack.checksum(*key) for key in keys]:
        raise SystemExit(f"a row of {keys} fails its checksum")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="ds-v2-lite")
    parser.add_argument("--layers", type=int, default=0, help="MoE layers of the pack (0: the preset's all)")
    parser.add_argument("--pack-dir", type=Path, default=Path("/tmp/rd"))
    parser.add_argument("--batches", default="1,2,4", help="rows per batch")
    parser.add_argument("--gap-ms", type=float, default=3.0, help="idle time before each batch of the gap variants")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    geometry = get_preset(args.preset)
    if args.layers:
        geometry = geometry.with_layers(args.layers)
    spec = ensure_synthetic_pack(geometry, args.pack_dir)
    rows = open_synthetic_rows(spec, args.pack_dir)
    sizes = [int(b) for b in args.batches.split(",")]
    gaps = (0.0, args.gap_ms / 1e3)
    variants = list(itertools.product(DESTINATIONS, PATHS, gaps))
    total = spec.num_layers * spec.num_experts
    needed = len(PATHS) * max(sizes) + args.rounds * len(variants) * sum(sizes)
    if needed > total:
        raise SystemExit(f"{needed} rows would be read but the pack holds {total}: fewer --rounds or --batches")
    pin = torch.cuda.is_available()
    buffers = {"pinned": aligned_host_buffer(max(sizes) * rows.stride, pin=pin),
               "pageable": aligned_host_buffer(max(sizes) * rows.stride, pin=False)}
    dests = {name: [memoryview(buf[i * rows.stride:(i + 1) * rows.stride].numpy()) for i in range(max(sizes))]
             for name, buf in buffers.items()}
    fresh = iter(np.random.default_rng(0).permutation(total).tolist())  # no row is read twice

    def draw(count: int) -> list[tuple[int, int]]:
        return [divmod(next(fresh), spec.num_experts) for _ in range(count)]

    verifier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bench-verify")
    for path in PATHS:  # warms the reader and the verification threads, off the clock
        timed_batch(rows, draw(max(sizes)), dests["pageable"], path, 0.0, verifier)
    seconds: dict[tuple, list[float]] = {(b, *v): [] for b in sizes for v in variants}
    for round_ in range(args.rounds):
        turn = variants[round_ % len(variants):] + variants[:round_ % len(variants)]
        for size in sizes:
            for dest, path, gap in turn:
                seconds[(size, dest, path, gap)].append(
                    timed_batch(rows, draw(size), dests[dest][:size], path, gap, verifier))
    payload = dests["pageable"][0][:rows.row_bytes]
    hash_s = []
    for _ in range(20):
        started = time.perf_counter()
        row_checksum(payload)
        hash_s.append(time.perf_counter() - started)
    rows.close()
    verifier.shutdown()
    mb = rows.row_bytes / 1e6
    print(f"{args.preset} rows of {mb:.2f} MB ({spec.num_layers} layers), {chosen_backend()} reader, "
          f"{'O_DIRECT' if rows.reader.direct else 'buffered'}, pinned memory {'page-locked' if pin else 'pageable (no CUDA)'};"
          f" ms per batch, median of {args.rounds} rounds (GB/s); one row's checksum alone "
          f"{1e3 * statistics.median(hash_s):.3f} ms")
    print(f"{'destination path gap':>26s} " + " ".join(f"{f'{b} row(s)':>16s}" for b in sizes))
    for dest, path, gap in variants:
        cells = []
        for b in sizes:
            ms = 1e3 * statistics.median(seconds[(b, dest, path, gap)])
            cells.append(f"{ms:7.3f} ({b * mb / ms:4.2f})")
        print(f"{f'{dest} {path} {1e3 * gap:g} ms':>26s} " + " ".join(f"{c:>16s}" for c in cells))
    if args.json:
        table = [{"rows": b, "destination": d, "path": p, "gap_ms": 1e3 * g,
                  "ms_median": 1e3 * statistics.median(seconds[(b, d, p, g)]),
                  "ms": [1e3 * s for s in seconds[(b, d, p, g)]]} for b in sizes for d, p, g in variants]
        report = {"provenance": {"commit": args.commit, "preset": args.preset, "layers": spec.num_layers,
                                 "row_bytes": rows.row_bytes, "backend": chosen_backend(), "direct": rows.reader.direct,
                                 "pinned_is_page_locked": pin, "rounds": args.rounds, "gap_ms": args.gap_ms},
                  "checksum_ms_median": 1e3 * statistics.median(hash_s), "rows": table}
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
