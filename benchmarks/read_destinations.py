"""A step's few pack rows read into pinned against pageable memory, with and without checksums, through the arena or
not, with nothing, an idle gap or GPU work before each batch: side by side in one process on one pack.

Without an arena the runtime reads a step's missing rows (often 1-4) into the arena's pinned staging buffer through
`PackRows` (checksums verified as rows land), once per step, right after the pass-log read that synchronised the GPU.
In issue #5's runs such a read took 1.3-1.7x as long per row as the floor's probe, which reads 64-row batches back
to back into pageable memory. This times, for each batch size, every combination of

- destination (`--destinations`): `pinned` (page-locked, as the staging buffer and the arena are on CUDA) or
  `pageable` (page-aligned, as the probe's);
- path (`--paths`): `arena` (`Arena.fetch` of an arena of no slots: the runtime's path, rows through its pinned
  staging buffer, whatever the destination), `checked` (`PackRows.read_rows`: each row's checksum on the
  verification thread as it lands, the last one's where it was read), `pooled` (the same reads, every checksum
  handed to a verification thread as it lands: `PackRows` before the thirtieth session), `inline` (the same reads,
  then each checksum on the calling thread) or `raw` (the same reads, no checksums);
- before each batch, off the clock (`--before`): `none` (batches back to back, as the probe), `sleep` (`--gap-ms`
  idle) or `gpu` (about `--gap-ms` of matrix products on the GPU, then a stream synchronisation, as a step's
  pass-log read does before its fetch; CUDA only);

the variants in a fresh random order each round (after reads32b; there the list rotated, so each variant mostly
followed the same one), every batch drawing rows that no earlier batch read (the pack holds all
the preset's layers). It also times one row's checksum alone. The table gives the median ms per batch (GB/s), one
line per variant.

    python3 benchmarks/read_destinations.py --preset ds-v2-lite --pack-dir /tmp/rd --json out.json
    python3 benchmarks/read_destinations.py --destinations pinned --paths arena,checked,raw --before none,sleep,gpu
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from tierstore.cache.arena import Arena, aligned_host_buffer
from tierstore.geometry import get_preset
from tierstore.io.checksum import row_checksum
from tierstore.io.readers.base import ReadOp
from tierstore.io.readers.choice import chosen_backend
from tierstore.runtime.replay import ensure_synthetic_pack, open_synthetic_rows

DESTINATIONS = ("pinned", "pageable")
PATHS = ("arena", "checked", "pooled", "inline", "raw")
BEFORE = ("none", "sleep", "gpu")


class Before:
    """What runs before a timed batch, off the clock."""

    def __init__(self, gap_ms: float):
        self.gap_s = gap_ms / 1e3
        self.matrices = None
        self.products = 1
        if torch.cuda.is_available():
            self.matrices = torch.randn(2, 4096, 4096, device="cuda", dtype=torch.bfloat16)
            self._gpu()
            started = time.perf_counter()
            self._gpu()
            one = time.perf_counter() - started
            self.products = max(1, round(self.gap_s / max(one, 1e-6)))

    def _gpu(self) -> None:
        a, b = self.matrices
        for _ in range(self.products):
            a @ b
        torch.cuda.current_stream().synchronize()

    def __call__(self, kind: str) -> None:
        if kind == "sleep":
            time.sleep(self.gap_s)
        elif kind == "gpu":
            self._gpu()


def timed_batch(rows, arena: Arena, keys: list[tuple[int, int]], dests: list[memoryview], path: str,
                verifier: ThreadPoolExecutor) -> float:
    """Seconds to read `keys` into `dests` (the arena's staging buffer for path `arena`) by `path`."""
    started = time.perf_counter()
    if path == "arena":
        arena.fetch(keys)
        return time.perf_counter() - started
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


def listed(text: str, choices: tuple[str, ...], what: str) -> list[str]:
    picked = text.split(",")
    unknown = [name for name in picked if name not in choices]
    if unknown:
        raise SystemExit(f"unknown {what} {', '.join(unknown)}; choose from {', '.join(choices)}")
    return picked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="ds-v2-lite")
    parser.add_argument("--layers", type=int, default=0, help="MoE layers of the pack (0: the preset's all)")
    parser.add_argument("--pack-dir", type=Path, default=Path("/tmp/rd"))
    parser.add_argument("--batches", default="1,2,4", help="rows per batch")
    parser.add_argument("--destinations", default="pinned,pageable")
    parser.add_argument("--paths", default="checked,pooled,inline,raw")
    parser.add_argument("--before", default="none,sleep", help="none, sleep, gpu (what runs before each batch)")
    parser.add_argument("--gap-ms", type=float, default=3.0, help="the sleep's length, and about the GPU work's")
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
    destinations = listed(args.destinations, DESTINATIONS, "destination")
    paths = listed(args.paths, PATHS, "path")
    befores = listed(args.before, BEFORE, "--before")
    if "gpu" in befores and not torch.cuda.is_available():
        raise SystemExit("--before gpu needs a CUDA device")
    variants = list(itertools.product(destinations, paths, befores))
    total = spec.num_layers * spec.num_experts
    needed = len(paths) * max(sizes) + args.rounds * len(variants) * sum(sizes)
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
    arena = Arena(rows, 0)
    before = Before(args.gap_ms)
    for path in paths:  # warms the reader, the verification threads and the arena's staging, off the clock
        timed_batch(rows, arena, draw(max(sizes)), dests["pageable"], path, verifier)
    seconds: dict[tuple, list[float]] = {(b, *v): [] for b in sizes for v in variants}
    shuffler = np.random.default_rng(1)
    for _ in range(args.rounds):
        turn = [variants[i] for i in shuffler.permutation(len(variants))]  # no variant always follows the same one
        for size in sizes:
            for dest, path, kind in turn:
                before(kind)
                seconds[(size, dest, path, kind)].append(
                    timed_batch(rows, arena, draw(size), dests[dest][:size], path, verifier))
    payload = dests["pageable"][0][:rows.row_bytes]
    hash_s = []
    for _ in range(20):
        started = time.perf_counter()
        row_checksum(payload)
        hash_s.append(time.perf_counter() - started)
    arena.close()
    rows.close()
    verifier.shutdown()
    mb = rows.row_bytes / 1e6
    print(f"{args.preset} rows of {mb:.2f} MB ({spec.num_layers} layers), {chosen_backend()} reader, "
          f"{'O_DIRECT' if rows.reader.direct else 'buffered'}, pinned memory {'page-locked' if pin else 'pageable (no CUDA)'};"
          f" ms per batch, median of {args.rounds} rounds (GB/s); one row's checksum alone "
          f"{1e3 * statistics.median(hash_s):.3f} ms; before: sleep {args.gap_ms:g} ms, gpu "
          f"{before.products} product(s)")
    print(f"{'destination path before':>26s} " + " ".join(f"{f'{b} row(s)':>16s}" for b in sizes))
    for dest, path, kind in variants:
        cells = []
        for b in sizes:
            ms = 1e3 * statistics.median(seconds[(b, dest, path, kind)])
            cells.append(f"{ms:7.3f} ({b * mb / ms:4.2f})")
        print(f"{f'{dest} {path} {kind}':>26s} " + " ".join(f"{c:>16s}" for c in cells))
    if args.json:
        table = [{"rows": b, "destination": d, "path": p, "before": k,
                  "ms_median": 1e3 * statistics.median(seconds[(b, d, p, k)]),
                  "ms": [1e3 * s for s in seconds[(b, d, p, k)]]} for b in sizes for d, p, k in variants]
        report = {"provenance": {"commit": args.commit, "preset": args.preset, "layers": spec.num_layers,
                                 "row_bytes": rows.row_bytes, "backend": chosen_backend(), "direct": rows.reader.direct,
                                 "pinned_is_page_locked": pin, "rounds": args.rounds, "gap_ms": args.gap_ms,
                                 "gpu_products": before.products},
                  "checksum_ms_median": 1e3 * statistics.median(hash_s), "rows": table}
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
