"""The reference MoE against an independent per-pair float64 loop, plus its exact miss semantics."""

import math

import pytest
import torch

from tierstore.errors import FormatError
from tierstore.reference_moe import DenseMLP, ExpertPool, ExpertTier, reference_moe, swiglu

LAYERS, EXPERTS, HIDDEN, INTER, TOP_K = 3, 10, 48, 24, 4


def _random_pool(slots: int, gen: torch.Generator) -> ExpertPool:
    w13 = torch.randn(slots, 2 * INTER, HIDDEN, generator=gen) / math.sqrt(HIDDEN)
    w2 = torch.randn(slots, HIDDEN, INTER, generator=gen) / math.sqrt(INTER)
    return ExpertPool(w13=w13, w2=w2)


def _random_routing(tokens: int, gen: torch.Generator):
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)])  # [T, k]
    weights = torch.softmax(torch.randn(tokens, TOP_K, generator=gen), dim=-1)  # [T, k]
    return ids, weights


def _full_table(slot_of_expert) -> torch.Tensor:
    table = torch.full((LAYERS, EXPERTS), -1, dtype=torch.int32)
    for (layer, expert), slot in slot_of_expert.items():
        table[layer, expert] = slot
    return table


def _loop_reference(hidden, ids, weights, layer, tiers, limit=None):
    """Independent float64 oracle: one token, one routed pair at a time."""
    out = torch.zeros(hidden.shape, dtype=torch.float64)
    for t in range(hidden.shape[0]):
        x = hidden[t].to(torch.float64)
        for j in range(ids.shape[1]):
            expert = int(ids[t, j])
            for tier in tiers:
                slot = int(tier.table[layer, expert])
                if slot >= 0:
                    w13 = tier.pool.w13[slot].to(torch.float64)
                    w2 = tier.pool.w2[slot].to(torch.float64)
                    gate, up = (w13 @ x).split(INTER)
                    if limit is not None:
                        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
                    out[t] += float(weights[t, j]) * (w2 @ (gate * torch.sigmoid(gate) * up))
                    break
    return out


@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("limit", [None, 0.5])
def test_matches_per_pair_loop_with_mixed_tiers(tokens, limit):
    gen = torch.Generator().manual_seed(tokens * 7 + (limit is not None))
    fp4 = ExpertTier("fp4", _full_table({(1, e): i for i, e in enumerate(range(0, EXPERTS, 3))}), _random_pool(4, gen))
    w2 = ExpertTier("w2", _full_table({(1, e): e for e in range(EXPERTS) if e != 5}), _random_pool(EXPERTS, gen))
    hidden = torch.randn(tokens, HIDDEN, generator=gen)
    ids, weights = _random_routing(tokens, gen)

    result = reference_moe(hidden, ids, weights, layer=1, tiers=[fp4, w2], swiglu_limit=limit)

    expected = _loop_reference(hidden, ids, weights, 1, [fp4, w2], limit)
    torch.testing.assert_close(result.output.to(torch.float64), expected, rtol=1e-5, atol=1e-5)
    assert result.output.dtype == torch.float32
    # Priority: experts 0, 3, 6, 9 are in both tiers and must be served by fp4 (tier 0).
    assert torch.equal(result.served_by == 0, (ids % 3 == 0))
    assert torch.equal(result.served_by == -1, ids == 5)


def test_missing_pair_contributes_exactly_zero_and_is_counted():
    gen = torch.Generator().manual_seed(11)
    pool = _random_pool(EXPERTS, gen)
    resident = ExpertTier("w2", _full_table({(0, e): e for e in range(EXPERTS)}), pool)
    absent = {2, 7}
    partial = ExpertTier("w2", _full_table({(0, e): e for e in range(EXPERTS) if e not in absent}), pool)
    hidden = torch.randn(9, HIDDEN, generator=gen)
    ids, weights = _random_routing(9, gen)
    ids[0, 0], ids[1, 1] = 2, 7  # make sure both absent experts are routed

    got = reference_moe(hidden, ids, weights, layer=0, tiers=[partial])

    is_missing = (ids == 2) | (ids == 7)
    masked = reference_moe(hidden, ids, weights.masked_fill(is_missing, 0.0), layer=0, tiers=[resident])
    assert torch.equal(got.output, masked.output)
    assert got.missing_pairs == int(is_missing.sum())
    assert got.missing_experts == ((0, 2), (0, 7))
    assert resident_is_complete(reference_moe(hidden, ids, weights, layer=0, tiers=[resident]))


def resident_is_complete(result) -> bool:
    return result.missing_pairs == 0 and result.missing_experts == () and bool((result.served_by >= 0).all())


def test_combine_is_deterministic_and_independent_of_other_tokens():
    gen = torch.Generator().manual_seed(5)
    tier = ExpertTier("w2", _full_table({(2, e): e for e in range(EXPERTS)}), _random_pool(EXPERTS, gen))
    hidden = torch.randn(12, HIDDEN, generator=gen)
    ids, weights = _random_routing(12, gen)
    first = reference_moe(hidden, ids, weights, layer=2, tiers=[tier]).output
    again = reference_moe(hidden, ids, weights, layer=2, tiers=[tier]).output
    alone = reference_moe(hidden[4:5], ids[4:5], weights[4:5], layer=2, tiers=[tier]).output
    assert torch.equal(first, again)
    torch.testing.assert_close(alone[0], first[4], rtol=1e-6, atol=1e-6)


def test_shared_expert_is_added_outside_tiering():
    gen = torch.Generator().manual_seed(3)
    tier = ExpertTier("w2", _full_table({}), _random_pool(1, gen))  # nothing resident
    shared = DenseMLP(w13=torch.randn(2 * INTER, HIDDEN, generator=gen), w2=torch.randn(HIDDEN, INTER, generator=gen),
                      gate=torch.randn(1, HIDDEN, generator=gen))
    hidden = torch.randn(4, HIDDEN, generator=gen)
    ids, weights = _random_routing(4, gen)
    got = reference_moe(hidden, ids, weights, layer=0, tiers=[tier], shared=shared)
    expected = (swiglu(hidden @ shared.w13.T) @ shared.w2.T) * torch.sigmoid(hidden @ shared.gate.T)
    torch.testing.assert_close(got.output, expected, rtol=1e-6, atol=1e-6)
    assert got.missing_pairs == 4 * TOP_K


def test_swiglu_clamp_limits_gate_above_and_up_both_sides():
    gate_up = torch.tensor([[10.0, -10.0, 10.0, -10.0]])
    clamped = swiglu(gate_up, limit=2.0)
    expected = torch.nn.functional.silu(torch.tensor([2.0, -10.0])) * torch.tensor([2.0, -2.0])
    assert torch.equal(clamped[0], expected)
    assert not torch.equal(swiglu(gate_up), clamped)


def test_bad_inputs_are_named():
    gen = torch.Generator().manual_seed(0)
    tier = ExpertTier("w2", _full_table({(0, 0): 0}), _random_pool(1, gen))
    hidden = torch.randn(2, HIDDEN)
    ids = torch.zeros(2, TOP_K, dtype=torch.int64)
    weights = torch.ones(2, TOP_K)
    with pytest.raises(FormatError, match="outside the slot tables"):
        reference_moe(hidden, ids, weights, layer=LAYERS, tiers=[tier])
    with pytest.raises(FormatError, match=r"topk_ids must lie in \[0, 10\)"):
        reference_moe(hidden, ids + EXPERTS, weights, layer=0, tiers=[tier])
    with pytest.raises(FormatError, match="must both be"):
        reference_moe(hidden, ids[:, :2], weights, layer=0, tiers=[tier])
    with pytest.raises(FormatError, match="outside the pool's 1 slots"):
        ExpertTier("w2", _full_table({(0, 0): 3}), tier.pool)
    with pytest.raises(FormatError, match="pool shapes disagree"):
        ExpertPool(w13=torch.zeros(2, 8, 4), w2=torch.zeros(2, 4, 3))
