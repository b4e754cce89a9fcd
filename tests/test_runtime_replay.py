"""Trace replay through the runtime (the engine of `tierstore replay`), on the CPU device."""

import numpy as np
import pytest
from test_runtime_fixtures import memory_source, toy_geometry

from tierstore.runtime.replay import ensure_synthetic_pack, open_synthetic_rows, run_replay, trace_steps


def skewed_routing(geometry, tokens, seed=0):
    rng = np.random.default_rng(seed)
    probs = 1.0 / np.arange(1, geometry.num_experts + 1) ** 1.2
    probs /= probs.sum()
    out = np.empty((tokens, geometry.num_moe_layers, geometry.top_k), np.int32)
    for t in range(tokens):
        for layer in range(geometry.num_moe_layers):
            out[t, layer] = rng.choice(geometry.num_experts, geometry.top_k, replace=False, p=probs)
    return out


def test_trace_steps_groups_tokens_by_step():
    experts = np.arange(5 * 2 * 2).reshape(5, 2, 2)
    steps = trace_steps(experts, np.array([0, 0, 1, 2, 2]), layers=1, limit=None)
    assert [s.shape for s in steps] == [(2, 1, 2), (1, 1, 2), (2, 1, 2)]
    assert len(trace_steps(experts, None, layers=2, limit=3)) == 3
    with pytest.raises(ValueError, match="has 2 layers, the replay needs 3"):
        trace_steps(experts, None, layers=3, limit=None)


def test_replay_reports_tiered_resident_naive_and_floor(tmp_path):
    g = toy_geometry()
    spec = ensure_synthetic_pack(g, tmp_path)
    assert ensure_synthetic_pack(g, tmp_path) == spec  # reused
    steps = trace_steps(skewed_routing(g, 30), None, g.num_moe_layers, None)
    result = run_replay(g, lambda: open_synthetic_rows(spec, tmp_path), steps, pool_slots=12, arena_slots=16,
                        device="cpu")
    runs = result["runs"]
    assert runs["resident"]["replay_rate"] == 0.0
    assert 0 < runs["tiered"]["replay_rate"] <= 1 and runs["tiered"]["fetched_bytes"] > 0
    assert runs["naive"]["replay_rate"] == 0.0 and runs["naive"]["fetched_bytes"] > 0
    assert result["floor_step_ms"] > 0 and result["coverage"] == 12 / 48
    again = run_replay(g, lambda: memory_source(g), steps[:5], pool_slots=48, arena_slots=0, device="cpu")
    assert again["runs"]["tiered"]["replay_rate"] > 0  # cold pool: the first steps miss
