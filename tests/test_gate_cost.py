"""The gate-cost benchmark's machinery on the CPU device: synthetic confidence, fire schedule, runs."""

import numpy as np
import pytest
import torch
from test_runtime_fixtures import toy_geometry

from tierstore.runtime.gate import ConfidenceGate
from tierstore.runtime.replay import trace_steps
from tierstore.runtime.replay_gate import confidence_logits, fire_schedule, gate_cost
from tierstore.runtime.synthetic import tiled_rows


def random_steps(g, count: int, seed: int) -> list:
    """trace_steps of count one-token steps, each layer routed to top_k distinct experts drawn uniformly."""
    rng = np.random.default_rng(seed)
    routing = np.stack([[rng.choice(g.num_experts, g.top_k, replace=False) for _ in range(g.num_moe_layers)]
                        for _ in range(count)])  # [steps, L, k]
    return trace_steps(routing, None, g.num_moe_layers, None)


def test_confidence_logits_put_exactly_the_confidence_on_top():
    confidence = np.array([0.3, 0.59, 0.61, 0.99])
    logits = confidence_logits(confidence, tokens=2, vocab=1000, device="cpu")  # [4, 2, 1000]
    top = torch.softmax(logits.double(), dim=-1)[..., 0]
    assert torch.allclose(top, torch.as_tensor(confidence)[:, None].expand(4, 2), atol=1e-5)
    gate = ConfidenceGate(tau=0.6)
    assert [gate.decide(row).fires for row in logits] == [True, True, False, False]


def test_fire_schedule():
    assert fire_schedule(6, 0).tolist() == [0.99] * 6
    assert fire_schedule(7, 3).tolist() == [0.99, 0.99, 0.3, 0.99, 0.99, 0.3, 0.99]


def test_tiled_rows_repeat_a_few_experts():
    g = toy_geometry()
    rows = tiled_rows(g, fp4=True, distinct=3)
    assert rows.shape[:2] == (g.num_moe_layers, g.num_experts) and rows.dtype == torch.uint8
    assert torch.equal(rows[0, 0], rows[0, 3]) and torch.equal(rows[1, 0], rows[0, 1])  # key 16: 16 % 3 == 1
    assert not torch.equal(rows[0, 0], rows[0, 1])


def test_gate_cost_runs_and_counts_fires():
    g = toy_geometry()
    steps = random_steps(g, 12, seed=0)
    result = gate_cost(g, steps, fp4_fractions=(0.25, 1.0), gate_fraction=0.5, fire_every=4, device="cpu", warmup=4)
    runs = result["runs"]
    assert set(runs) == {"w2", "fp4@0.25", "fp4@1", "unarmed", "armed", "firing"}
    assert runs["w2"]["fp4_slots"] == 0 and runs["fp4@1"]["fp4_slots"] == g.total_routed_experts
    assert runs["armed"]["steady"]["gate_fired"] == 0 and runs["unarmed"]["steady"]["gate_fired"] == 0
    assert runs["firing"]["cold"]["gate_fired"] == 1 and result["fires"] == 2  # steps 4 | 8, 12
    assert runs["firing"]["fp4_pair_share"] > 0
    for run in runs.values():
        assert run["steady"]["steps"] == 8 and run["steady"]["replay_rate"] == 0.0  # the base pool holds everything
    assert result["armed_cost"] == pytest.approx(runs["armed"]["steady"]["step_ms"] / runs["unarmed"]["steady"]["step_ms"] - 1)


def test_armed_cost_is_measured_at_held_residency():
    g = toy_geometry()
    steps = random_steps(g, 8, seed=1)
    result = gate_cost(g, steps, fp4_fractions=(), gate_fraction=0.5, fire_every=4, device="cpu", warmup=2,
                       repetitions=3)
    held = result["held"]
    assert result["armed_cost"] == held["armed_cost_median"] and "armed_cost_live" in result
    assert [r["order"] for r in held["repetitions"]] == [["unarmed", "armed"], ["armed", "unarmed"],
                                                         ["unarmed", "armed"]]
    residency = held["residency"]
    assert residency["unchanged"] and residency["mapped"] == residency["fp4_slots"] == g.total_routed_experts // 2
    assert 0.5 <= residency["fp4_pair_share"] <= 1.0  # the hottest half of the experts
    assert all(r["armed"]["gate_fired"] == 0 for r in held["repetitions"])
    assert held["gate_steps"] >= 3 * len(steps[2:])  # the armed blocks went through the gate


def test_hottest_keys_counts_every_routed_pair():
    from tierstore.runtime.replay_gate import hottest_keys
    g = toy_geometry()
    steps = [np.array([[[1, 2]] * g.num_moe_layers]), np.array([[[1, 3]] * g.num_moe_layers])]  # [1, L, k]
    assert hottest_keys(g, steps, 2)[:1] == [(0, 1)] and set(hottest_keys(g, steps, g.num_moe_layers)) == {
        (layer, 1) for layer in range(g.num_moe_layers)}


def test_gate_cost_runs_its_forward_in_the_given_activation_dtype(monkeypatch):
    import tierstore.runtime.replay_gate as replay_gate
    seen = []
    drive = replay_gate.drive

    def recording(*args, **kwargs):
        seen.append(kwargs["dtype"])
        return drive(*args, **kwargs)
    monkeypatch.setattr(replay_gate, "drive", recording)
    g = toy_geometry()
    steps = random_steps(g, 4, seed=2)
    result = gate_cost(g, steps, fp4_fractions=(), gate_fraction=0.5, fire_every=2, device="cpu", warmup=1,
                       repetitions=1, dtype=torch.bfloat16)
    assert result["dtype"] == "bfloat16" and seen and set(seen) == {torch.bfloat16}
