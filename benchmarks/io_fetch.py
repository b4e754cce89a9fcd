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

The measuring code lives in the installed package (`tierstore.bench.io`, also behind
`tierstore bench io`); this script keeps the checkout's command line, console output and JSON
file, and leaves the pack in --dir for the next run.
"""

from __future__ import annotations

import argparse
import json
import platform
from pathlib import Path

from tierstore.bench.io import run_io

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="directory on the disk to measure")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--depths", default="1,8,32")
    parser.add_argument("--out", default=None, help="result JSON (default benchmarks/results/io_fetch_<host>.json)")
    args = parser.parse_args()
    result = run_io(Path(args.dir), rows=args.rows, repeats=args.repeats,
                    depths=tuple(int(d) for d in args.depths.split(",")), log=print)
    out = Path(args.out or ROOT / "benchmarks" / "results" / f"io_fetch_{platform.node() or 'host'}.json")
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
