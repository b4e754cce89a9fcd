"""Where should the preadv pool's row checksums run? An ablation next to io_fetch.py.

    .venv/bin/python benchmarks/io_verify_placement.py --dir /path/on/the/disk --out result.json

Two arenas over the same pack, both reading with `PreadvPoolReader` (O_DIRECT, `depth` threads):

- `verify-pool` (the library's PackRows): each worker's `on_read` hands its row's xxh3 to a
  one-thread verification pool and goes on to its next read;
- `verify-in-worker`: the worker hashes its row itself, right after its read, before taking its
  next read (xxh3 releases the GIL, so workers hash in parallel).

Each repeat runs, for each variant, a plain O_DIRECT baseline into that arena's slot memory and
then an all-miss `fetch` of 64 rows (the io_fetch.py method; batches alternate between two key
sets). The best repeat is reported as GB/s and % of the same variant's baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tierstore.bench.io import baseline_direct, make_pack  # the fetch benchmark's pack and baseline
from tierstore.bench.provenance import provenance as run_provenance
from tierstore.cache.arena import Arena
from tierstore.errors import PackFormatError
from tierstore.io.checksum import row_checksum
from tierstore.io.pack_rows import PackRows
from tierstore.io.readers import PreadvPoolReader, ReadOp


class VerifyInWorkerRows(PackRows):
    """PackRows whose checksums run inside `on_read`, i.e. on the reader's worker thread."""

    def read_rows(self, keys, dests):
        spec = self.pack.spec
        digests: list[str | None] = [None] * len(keys)

        def verify(index: int) -> None:
            digests[index] = row_checksum(dests[index][:self.row_bytes])

        self.reader.read([ReadOp(spec.row_offset(*key), dest) for key, dest in zip(keys, dests)], on_read=verify)
        bad = [key for key, digest in zip(keys, digests) if digest != self.pack.checksum(*key)]
        if bad:
            raise PackFormatError(f"rows fail their checksum: {bad}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--depths", default="1,8,32")
    parser.add_argument("--out", required=True)
    parser.add_argument("--note", default=None, help="recorded in the provenance (e.g. which machine this is)")
    args = parser.parse_args()
    pack = make_pack(Path(args.dir), 2 * args.rows)
    spec, rows = pack.spec, args.rows
    batches = [[(i // 8, i % 8) for i in range(start, start + rows)] for start in (0, rows)]
    batch_bytes = rows * spec.stride
    fd = os.open(pack.path, os.O_RDONLY | os.O_DIRECT)
    results = []
    for depth in [int(d) for d in args.depths.split(",")]:
        pool = ThreadPoolExecutor(depth)
        arenas = {name: Arena(kind(pack, PreadvPoolReader(pack.path, direct=True, threads=depth)), rows, pin=False)
                  for name, kind in (("verify-pool", PackRows), ("verify-in-worker", VerifyInWorkerRows))}
        times = {name: {"baseline": [], "arena": []} for name in arenas}
        for r in range(2 + args.repeats):  # two warm-up rounds
            keys = batches[r % 2]
            offsets = [spec.row_offset(*key) for key in keys]
            for name, arena in arenas.items():
                base_s = baseline_direct(fd, pool, offsets, arena.slot_memory(), spec.stride)
                started = time.perf_counter()
                arena.fetch(keys)
                fetch_s = time.perf_counter() - started
                if r >= 2:
                    times[name]["baseline"].append(base_s)
                    times[name]["arena"].append(fetch_s)
        for name, arena in arenas.items():
            assert arena.stats().hit_rows == 0  # every timed fetch was all misses
            arena.source.close()
            base_s, best = min(times[name]["baseline"]), min(times[name]["arena"])
            results.append({"backend": "preadv-pool", "variant": name, "queue_depth": depth, "rows": rows,
                            "bytes": batch_bytes, "seconds": best, "gb_per_s": batch_bytes / best / 1e9,
                            "baseline_gb_per_s": batch_bytes / base_s / 1e9, "pct_of_baseline": 100 * base_s / best,
                            "samples_s": times[name]["arena"], "baseline_samples_s": times[name]["baseline"]})
            print(f"qd={depth:3d} {name:16s}: {batch_bytes / best / 1e9:6.2f} GB/s "
                  f"(baseline {batch_bytes / base_s / 1e9:6.2f} GB/s, {100 * base_s / best:5.1f}%)", flush=True)
        pool.shutdown()
    os.close(fd)
    provenance = run_provenance()
    if args.note:
        provenance["note"] = args.note
    Path(args.out).write_text(json.dumps({"provenance": provenance, "row_bytes": spec.row_bytes,
                                          "stride": spec.stride, "disk": results}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
