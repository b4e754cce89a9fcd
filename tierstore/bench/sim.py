"""Simulator speed: routing events per second on one core, fast path (numba) and reference engine.
Used by `tierstore bench sim` and by the checkout's `benchmarks/sim_speed.py`.

Set NUMBA_NUM_THREADS=1 before numba is first imported to hold the run to one core (the callers do).
"""

from __future__ import annotations

import datetime
import os
import platform
import time
from typing import Callable

TARGETS = {"lru": 20e6, "belady": 5e6}  # DESIGN.md: events/s on one core
POLICIES = ("lru", "belady")


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def run_sim(tokens: int = 20000, preset: str = "ds-v2-lite", repeats: int = 3, reference: bool = True,
            coverage: float = 0.25, log: Callable[[str], None] = lambda _: None,
            commit: str | None = None) -> dict:
    """Events/s of `simulate` on a synthetic Zipf(1.0), locality-0.3 trace shaped like `preset`.
    The reference engine runs on a trace of max(200, tokens // 20) tokens (it is slow)."""
    import numpy as np

    from tierstore.bench.provenance import provenance
    from tierstore.errors import ConfigError
    from tierstore.geometry import get_preset
    from tierstore.sim import simulate, synthetic_for

    if tokens < 1 or repeats < 1 or not 0 < coverage <= 1:
        raise ConfigError("tokens and repeats must be >= 1 and coverage in (0, 1]")
    geometry = get_preset(preset)
    trace = synthetic_for(geometry, tokens, skew=1.0, locality=0.3, seed=0)
    events = trace.num_events
    slots = max(1, int(trace.num_keys * coverage))
    rows = []
    for policy in POLICIES:
        started = time.perf_counter()
        simulate(trace, gpu_slots=slots, policy=policy)  # compile / load the numba cache
        first = time.perf_counter() - started
        seconds = best_of(lambda: simulate(trace, gpu_slots=slots, policy=policy), repeats)
        rate = events / seconds
        rows.append({"policy": policy, "engine": "fast", "events_per_s": rate, "target": TARGETS[policy],
                     "meets_target": rate >= TARGETS[policy], "seconds": seconds, "first_call_s": first})
        log(f"{policy:7s} fast      {rate / 1e6:8.2f} M events/s")
    if reference:
        small = synthetic_for(geometry, max(200, tokens // 20), skew=1.0, locality=0.3, seed=0)
        for policy in POLICIES:
            seconds = best_of(lambda: simulate(small, gpu_slots=slots, policy=policy, fast=False), 1)
            rows.append({"policy": policy, "engine": "reference", "events_per_s": small.num_events / seconds,
                         "seconds": seconds, "events": small.num_events})
            log(f"{policy:7s} reference {small.num_events / seconds / 1e6:8.2f} M events/s")
    info = provenance(commit=commit)
    return {
        "benchmark": "sim_speed", "date": datetime.date.today().isoformat(), "commit": info["commit"],
        "machine": f"{platform.machine()} {platform.processor() or ''} ({os.cpu_count()} cores visible, 1 used)".strip(),
        "python": platform.python_version(), "numpy": np.__version__,
        "numba": __import__("numba").__version__,
        "trace": {"preset": preset, "tokens": tokens, "events": events, "gpu_slots": slots,
                  "note": f"synthetic Zipf(1.0), locality 0.3, {coverage:.0%} coverage; events = routed "
                          "(token, layer, expert) pairs; time includes step grouping (numpy) and the kernel, "
                          "not numba compilation"},
        "results": rows,
        "provenance": info,
    }
