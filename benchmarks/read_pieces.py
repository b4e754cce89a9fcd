"""Pack read rate by batch size, each row read whole against rows cut into pieces in flight together (the reader's
`piece_bytes`), side by side in one process on one pack.

The runtime reads a step's missing rows as one batch through `PackRows` (checksums verified as rows land). Without an
arena a step often misses only 1-4 rows, and a batch of one or two rows is one or two reads of a whole row each, one
after the other; a 64-row batch keeps many reads in flight. This times `PackRows.read_rows` on a synthetic pack at a
preset's shapes (`replay.ensure_synthetic_pack`, O_DIRECT where the filesystem takes it) for each batch size and each
piece size, the piece sizes taking turns round by round; every batch draws rows at random, and the page cache is
dropped for the file before each batch when the reads are buffered. The table gives the median over rounds of GB/s.

    python3 benchmarks/read_pieces.py --preset ds-v2-lite --pack-dir /tmp/rp --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tierstore.cache.arena import aligned_host_buffer  # noqa: E402
from tierstore.geometry import get_preset  # noqa: E402
from tierstore.io.pack import Pack  # noqa: E402
from tierstore.io.pack_rows import PackRows  # noqa: E402
from tierstore.io.readers.choice import chosen_backend, direct_io_supported, make_reader  # noqa: E402
from tierstore.runtime.replay import ensure_synthetic_pack  # noqa: E402


def batch_gbps(rows: PackRows, keys: list[tuple[int, int]], dests: list[memoryview]) -> float:
    if not rows.reader.direct:
        os.posix_fadvise(rows.reader.fd, 0, 0, os.POSIX_FADV_DONTNEED)
    started = time.perf_counter()
    rows.read_rows(keys, dests[:len(keys)])
    return len(keys) * rows.row_bytes / (time.perf_counter() - started) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="ds-v2-lite")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--pack-dir", type=Path, default=Path("/tmp/rp"))
    parser.add_argument("--batches", default="1,2,4,16,64", help="rows per batch")
    parser.add_argument("--pieces-kib", default="0,1024,512,256,128", help="piece sizes, KiB (0: rows whole)")
    parser.add_argument("--threads", type=int, default=8, help="the preadv pool's threads (make_reader's default)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    geometry = get_preset(args.preset).with_layers(args.layers)
    spec = ensure_synthetic_pack(geometry, args.pack_dir)
    pack = Pack(args.pack_dir, spec)
    direct = direct_io_supported(pack.path)
    pieces = [int(p) << 10 for p in args.pieces_kib.split(",")]
    sizes = [int(b) for b in args.batches.split(",")]
    readers = {p: PackRows(pack, make_reader(pack.path, direct=direct, threads=args.threads, piece_bytes=p))
               for p in pieces}
    stride = readers[pieces[0]].stride
    buffer = aligned_host_buffer(max(sizes) * stride, pin=False)
    dests = [memoryview(buffer[i * stride:(i + 1) * stride].numpy()) for i in range(max(sizes))]
    total = spec.num_layers * spec.num_experts
    rng = np.random.default_rng(0)
    for rows in readers.values():  # warm each reader (threads) on a batch outside the clock
        batch_gbps(rows, [divmod(int(i), spec.num_experts) for i in rng.choice(total, 8, replace=False)], dests)
    rates: dict[tuple[int, int], list[float]] = {(b, p): [] for b in sizes for p in pieces}
    for round_ in range(args.rounds):
        turn = pieces[round_ % len(pieces):] + pieces[:round_ % len(pieces)]
        for size in sizes:
            for piece in turn:
                keys = [divmod(int(i), spec.num_experts) for i in rng.choice(total, size, replace=False)]
                rates[(size, piece)].append(batch_gbps(readers[piece], keys, dests))
    for rows in readers.values():
        rows.close()
    table = [{"rows": b, "piece_kib": p >> 10, "gbps_median": statistics.median(rates[(b, p)]),
              "gbps_best": max(rates[(b, p)]), "gbps": rates[(b, p)]} for b in sizes for p in pieces]
    print(f"{args.preset} rows of {spec.row_bytes / 1e6:.2f} MB, {chosen_backend()} reader, "
          f"{'O_DIRECT' if direct else 'buffered'}, {args.threads} threads; GB/s, median of {args.rounds} rounds")
    print(f"{'rows':>5s} " + " ".join(f"{('whole' if p == 0 else f'{p >> 10} KiB'):>9s}" for p in pieces))
    for b in sizes:
        print(f"{b:5d} " + " ".join(f"{statistics.median(rates[(b, p)]):9.2f}" for p in pieces))
    if args.json:
        report = {"provenance": {"commit": args.commit, "preset": args.preset, "layers": args.layers,
                                 "row_bytes": spec.row_bytes, "backend": chosen_backend(), "direct": direct,
                                 "threads": args.threads, "rounds": args.rounds}, "rows": table}
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
