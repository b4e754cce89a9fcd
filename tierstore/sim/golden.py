"""Regenerate the golden trace and pinned hit counts: ``python -m tierstore.sim.golden [DIR]``.

Writes ``DIR/trace.npz`` (a small seeded synthetic trace) and ``DIR/hits.json`` (hit pairs and
zero-miss steps per policy and capacity, default semantics). tests/test_sim_golden.py fails on
any change; regenerate only on purpose, and say why in the commit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tierstore.cache.policy import policy_names
from tierstore.sim.importers import load_trace
from tierstore.sim.simulation import simulate
from tierstore.sim.synthetic import synthetic_trace
from tierstore.sim.trace import save_trace

CAPACITIES = (6, 16, 32, 48)
POLICIES = ("lru", "lfu", "freq", "class-lru", "s3fifo", "sieve", "static-hot", "belady")


def golden_trace():
    return synthetic_trace(240, 4, 16, 2, skew=1.0, layer_skew=0.5, locality=0.25, burst_len=80, seed=2024)


def pinned_counts(trace) -> dict:
    out = {}
    for policy in POLICIES:
        for slots in CAPACITIES:
            r = simulate(trace, gpu_slots=slots, policy=policy, fast=False)
            out[f"{policy}@{slots}"] = {"hit_pairs": int(r.counters["hit_pairs"].sum()),
                                        "zero_miss_steps": int((r.counters["miss_keys"] == 0).sum())}
    return out


def main(directory: str = "tests/golden") -> None:
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_trace(golden_trace(), d / "trace.npz")
    trace = load_trace(d / "trace.npz")
    doc = {"regenerate": "python -m tierstore.sim.golden", "routed_pairs": trace.num_events,
           "registered_policies": policy_names(), "counts": pinned_counts(trace)}
    (d / "hits.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {d / 'trace.npz'} and {d / 'hits.json'} ({len(doc['counts'])} pinned counts)")


if __name__ == "__main__":
    main(*sys.argv[1:])
