"""End to end on real model code: a checkpoint saved by transformers, read back by tierstore's
reader and run through the reference MoE, equals the transformers MoE block itself."""

import pytest
import torch
from checkpoint_fixtures import save_hf_checkpoint, tiny_hf_model

from tierstore.checkpoint import open_checkpoint
from tierstore.reference_moe import ExpertPool, ExpertTier, reference_moe

pytest.importorskip("transformers")


def _moe_block(model, decoder_layer: int):
    layer = model.model.layers[decoder_layer]
    return getattr(layer, "block_sparse_moe", None) or layer.mlp


def _route(hidden, router_weight, top_k, norm_topk_prob):
    probs = torch.softmax(hidden @ router_weight.T, dim=-1)  # [T, E]
    weights, ids = probs.topk(top_k, dim=-1)  # [T, k]
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "olmoe"])
def test_reader_plus_reference_equals_transformers_block(model_type, tmp_path):
    model = tiny_hf_model(model_type, seed=7, dtype=torch.float32)
    path = save_hf_checkpoint(model, tmp_path / model_type)
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(1))

    with open_checkpoint(path) as ckpt:
        g = ckpt.geometry
        for moe_layer, decoder_layer in enumerate(g.moe_layers):
            layer = ckpt.layer(moe_layer)
            pool = ExpertPool.from_experts([(e.w13.dequantize(), e.w2.dequantize()) for e in layer.experts])
            table = torch.full((g.num_moe_layers, g.num_experts), -1, dtype=torch.int32)
            table[moe_layer] = torch.arange(g.num_experts, dtype=torch.int32)
            router = ckpt.router_weight(moe_layer).to(torch.float32)
            ids, weights = _route(hidden, router, g.top_k, g.norm_topk_prob)

            got = reference_moe(hidden, ids, weights, layer=moe_layer, tiers=[ExpertTier("bf16", table, pool)])

            with torch.no_grad():
                expected = _moe_block(model, decoder_layer)(hidden[None])
            expected = expected[0] if isinstance(expected, tuple) else expected
            torch.testing.assert_close(got.output, expected[0], rtol=2e-5, atol=2e-6)
            assert got.missing_pairs == 0
