"""Simulator speed: routing events per second on one core, fast path and reference engine.

Run: .venv/bin/python benchmarks/sim_speed.py [--tokens N] [--out benchmarks/results/sim_speed.json]
Targets (DESIGN.md): >= 20 M events/s for LRU, >= 5 M for exact Belady.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import numpy as np

from tierstore.sim import simulate, synthetic_for
from tierstore.geometry import get_preset

TARGETS = {"lru": 20e6, "belady": 5e6}


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--preset", default="ds-v2-lite")
    parser.add_argument("--out", default="benchmarks/results/sim_speed.json")
    args = parser.parse_args()
    os.environ.setdefault("NUMBA_NUM_THREADS", "1")
    geometry = get_preset(args.preset)
    trace = synthetic_for(geometry, args.tokens, skew=1.0, locality=0.3, seed=0)
    events = trace.num_events
    slots = trace.num_keys // 4  # 25% coverage
    rows = []
    for policy in ("lru", "belady"):
        simulate(trace, gpu_slots=slots, policy=policy)  # compile / load the numba cache
        seconds = best_of(lambda: simulate(trace, gpu_slots=slots, policy=policy), 3)
        rate = events / seconds
        rows.append({"policy": policy, "engine": "fast", "events_per_s": rate, "target": TARGETS[policy],
                     "meets_target": rate >= TARGETS[policy], "seconds": seconds})
    small = synthetic_for(geometry, max(200, args.tokens // 20), skew=1.0, locality=0.3, seed=0)
    for policy in ("lru", "belady"):
        seconds = best_of(lambda: simulate(small, gpu_slots=slots, policy=policy, fast=False), 1)
        rows.append({"policy": policy, "engine": "reference", "events_per_s": small.num_events / seconds,
                     "seconds": seconds})
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {
        "benchmark": "sim_speed", "date": datetime.date.today().isoformat(), "commit": commit,
        "machine": f"{platform.machine()} {platform.processor() or ''} ({os.cpu_count()} cores visible, 1 used)".strip(),
        "python": platform.python_version(), "numpy": np.__version__,
        "numba": __import__("numba").__version__,
        "trace": {"preset": args.preset, "tokens": args.tokens, "events": events, "gpu_slots": slots,
                  "note": "synthetic Zipf(1.0), locality 0.3, 25% coverage; events = routed (token, layer, expert) pairs; "
                          "time includes step grouping (numpy) and the kernel, not numba compilation"},
        "results": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for row in rows:
        target = f" (target {row['target'] / 1e6:.0f} M/s: {'met' if row['meets_target'] else 'MISSED'})" if "target" in row else ""
        print(f"{row['policy']:7s} {row['engine']:9s} {row['events_per_s'] / 1e6:8.2f} M events/s{target}")


if __name__ == "__main__":
    main()
