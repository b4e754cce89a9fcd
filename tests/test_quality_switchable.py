"""SwitchableExperts' forced rows on multi-token forwards (CPU, a tiny random Qwen3-MoE).

Regression for the H200 crash: `force_rows` is bool [B] (one flag per batch row) while the experts
see T = B x P tokens; a prefill with `fp4_prefill` and B > 1 prompts of length P > 1 failed with a
shape error before the flags were expanded over each row's positions.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.quality import switchable
from benchmarks.quality.decoding import GatedDecoder
from benchmarks.quality.switchable import PrecisionControl, install

transformers = pytest.importorskip("transformers")

EXPERTS, HIDDEN, INTERMEDIATE, LAYERS = 8, 32, 32, 2


def _tiny_model():
    config = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=HIDDEN, moe_intermediate_size=INTERMEDIATE, intermediate_size=INTERMEDIATE,
        num_experts=EXPERTS, num_experts_per_tok=2, num_hidden_layers=LAYERS, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, norm_topk_prob=True,
        tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(config).float().eval()
    control = PrecisionControl()
    layers = install(model, control)
    generator = torch.Generator().manual_seed(1)

    def bank():
        return (0.2 * torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator),
                0.2 * torch.randn(EXPERTS, HIDDEN, INTERMEDIATE, generator=generator))

    banks = [(bank(), bank()) for _ in layers]  # (base, upgrade) per layer
    return model, control, layers, banks


def _configure(layers, banks, pool_all: bool) -> None:
    for layer, (base, upgrade) in zip(layers, banks):
        layer.configure(base, upgrade, torch.full((EXPERTS,), pool_all))


def _prefill_logits(model, control, prompts, fp4_prefill: bool) -> torch.Tensor:
    """float32 [B, V]: the logits after the prompt (the first scored step), no gate."""
    return GatedDecoder(model, control, None, fp4_prefill).score(prompts, prompts.shape[1]).logits[:, 0]


@pytest.mark.parametrize("gather_pairs", [switchable.GATHER_PAIRS, 0], ids=["gather", "per-expert-loop"])
def test_forced_multi_token_prefill_equals_every_expert_on_the_upgrade_bank(monkeypatch, gather_pairs):
    monkeypatch.setattr(switchable, "GATHER_PAIRS", gather_pairs)
    model, control, layers, banks = _tiny_model()
    prompts = torch.randint(2, 96, (3, 7), generator=torch.Generator().manual_seed(2))  # B = 3 rows, P = 7

    _configure(layers, banks, pool_all=False)
    forced = _prefill_logits(model, control, prompts, fp4_prefill=True)  # force_rows = ones [3] over 21 tokens
    base = _prefill_logits(model, control, prompts, fp4_prefill=False)
    _configure(layers, banks, pool_all=True)
    upgrade = _prefill_logits(model, control, prompts, fp4_prefill=False)

    assert torch.equal(forced, upgrade)
    assert not torch.allclose(forced, base)  # the banks differ, so forcing changed something
    assert control.force_rows is None  # the decoder clears the flags after the forward


def test_forced_rows_apply_to_their_own_positions_only():
    model, control, layers, banks = _tiny_model()
    prompts = torch.randint(2, 96, (2, 5), generator=torch.Generator().manual_seed(3))

    def forward(force_rows):
        control.force_rows = force_rows
        try:
            with torch.no_grad():
                return model(input_ids=prompts).logits.float()  # [B, P, V]
        finally:
            control.force_rows = None

    _configure(layers, banks, pool_all=False)
    mixed = forward(torch.tensor([True, False]))
    base = forward(None)
    _configure(layers, banks, pool_all=True)
    upgrade = forward(None)

    torch.testing.assert_close(mixed[0], upgrade[0], rtol=1e-5, atol=1e-6)  # every position of row 0
    torch.testing.assert_close(mixed[1], base[1], rtol=1e-5, atol=1e-6)  # none of row 1
    assert not torch.allclose(mixed[0], base[0])


def test_token_by_token_decode_equals_the_full_forward():
    """The decode slice's scoring path (1-token prefill, then one cached step per token) gives the
    logits of one full forward over the same window, so the two slices differ only by their text."""
    model, control, layers, banks = _tiny_model()
    _configure(layers, banks, pool_all=False)
    ids = torch.randint(2, 96, (2, 24), generator=torch.Generator().manual_seed(3))  # [B, S]
    with torch.no_grad():
        full = model(input_ids=ids).logits[:, :-1].float()  # [B, S-1, V]
    stepped = GatedDecoder(model, control, None).score(ids, 1).logits  # [B, S-1, V]
    assert stepped.shape == full.shape
    torch.testing.assert_close(stepped, full, rtol=1e-4, atol=1e-4)
