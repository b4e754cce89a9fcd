"""Pinned hit counts on the committed golden trace (regenerate: python -m tierstore.sim.golden)."""

import json
from pathlib import Path

import numpy as np

from tierstore.sim import load_trace, simulate
from tierstore.sim.golden import golden_trace, pinned_counts

GOLDEN = Path(__file__).parent / "golden"


def test_golden_trace_is_what_the_generator_makes():
    assert np.array_equal(load_trace(GOLDEN / "trace.npz").experts, golden_trace().experts)


def test_pinned_hit_counts_unchanged():
    expected = json.loads((GOLDEN / "hits.json").read_text())
    trace = load_trace(GOLDEN / "trace.npz")
    assert trace.num_events == expected["routed_pairs"]
    assert pinned_counts(trace) == expected["counts"]


def test_fast_path_agrees_with_golden():
    expected = json.loads((GOLDEN / "hits.json").read_text())["counts"]
    trace = load_trace(GOLDEN / "trace.npz")
    for key, want in expected.items():
        policy, slots = key.split("@")
        if policy in ("lru", "belady"):
            r = simulate(trace, gpu_slots=int(slots), policy=policy, fast=True)
            assert int(r.counters["hit_pairs"].sum()) == want["hit_pairs"], key
