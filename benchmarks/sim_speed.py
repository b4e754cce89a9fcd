"""Simulator speed: routing events per second on one core, fast path and reference engine.

Run: .venv/bin/python benchmarks/sim_speed.py [--tokens N] [--out benchmarks/results/sim_speed.json]
Targets (DESIGN.md): >= 20 M events/s for LRU, >= 5 M for exact Belady.

The measuring code lives in the installed package (`tierstore.bench.sim`, also behind
`tierstore bench sim`); this script keeps the checkout's command line and JSON file.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--preset", default="ds-v2-lite")
    parser.add_argument("--out", default="benchmarks/results/sim_speed.json")
    args = parser.parse_args()
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")  # before numba is imported
    from tierstore.bench.sim import run_sim

    result = run_sim(tokens=args.tokens, preset=args.preset)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for row in result["results"]:
        target = f" (target {row['target'] / 1e6:.0f} M/s: {'met' if row['meets_target'] else 'MISSED'})" if "target" in row else ""
        print(f"{row['policy']:7s} {row['engine']:9s} {row['events_per_s'] / 1e6:8.2f} M events/s{target}")


if __name__ == "__main__":
    main()
