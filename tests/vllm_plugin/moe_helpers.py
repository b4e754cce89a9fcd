"""Shared steps of the MoE-layer tests: build vLLM's layer with tierstore's config, compute the
expected output independently of vLLM, and call `apply` the way vLLM's runner does."""

import json

import torch

from tierstore.checkpoint import open_checkpoint
from tierstore.formats import quantize_w2, w2_from_mxfp4
from tierstore.reference_moe import ExpertPool, ExpertTier

FORMATS = ("bf16", "nvfp4", "fp8_block", "mxfp4")
E, K, H, I = 8, 2, 128, 128


def make_config(path):
    from tierstore.vllm_adapter.quant_config import TierstoreConfig

    quant = json.loads((path / "config.json").read_text()).get("quantization_config")
    return TierstoreConfig.from_config(quant) if quant else TierstoreConfig()


def built_layer(harness, path, layer=0, keyword_style=False, process=True, swiglu_limit=None):
    """(runner, routed_experts) of decoder layer `layer`, loaded through vLLM's loader."""
    runner = harness.build_moe(make_config(path), num_experts=E, top_k=K, hidden=H, inter=I,
                               prefix=f"model.layers.{layer}.mlp.experts", swiglu_limit=swiglu_limit)
    routed = runner.routed_experts
    count = harness.load_layer(routed, harness.checkpoint_tensors(path), f"model.layers.{layer}.mlp", E,
                               keyword_style=keyword_style)
    assert count >= 3 * E
    if process:
        routed.quant_method.process_weights_after_loading(routed)
    return runner, routed


def reference_tier(path, layer=0, row_slice=slice(None), col_slice=slice(None), zero_mode="auto",
                   precision="w2") -> ExpertTier:
    """W2 (or, with precision "fp4", the FP4 tier) of the checkpoint's experts computed
    independently of vLLM: tierstore's checkpoint reader, then the requantizer on the (TP-sliced)
    float64 values."""
    values = (lambda t: t.dequantize()) if precision == "w2" else (lambda t: t.dequantize_fp4())
    experts = []
    with open_checkpoint(path) as checkpoint:
        for expert in checkpoint.layer(layer).experts:
            if checkpoint.source_format == "mxfp4":
                w13, w2 = (w2_from_mxfp4(*m.mxfp4_parts()) for m in (expert.w13, expert.w2))
                w13_values, w2_values = values(w13), values(w2)
                inter = w13_values.shape[0] // 2
                gate, up = w13_values[:inter][row_slice], w13_values[inter:][row_slice]
                experts.append((torch.cat([gate, up]), w2_values[:, col_slice]))
                continue
            w13_full, w2_full = expert.w13.dequantize(), expert.w2.dequantize()
            inter = w13_full.shape[0] // 2
            w13_shard = torch.cat([w13_full[:inter][row_slice], w13_full[inter:][row_slice]])
            experts.append((values(quantize_w2(w13_shard, zero_mode=zero_mode)),
                            values(quantize_w2(w2_full[:, col_slice], zero_mode=zero_mode))))
    table = torch.arange(len(experts), dtype=torch.int32).view(1, -1)
    return ExpertTier(precision, table, ExpertPool.from_experts(experts))


def routing(harness, tokens=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen)
    logits = torch.randn(tokens, E, generator=gen)
    weights, ids = harness.softmax_topk(x, logits, K, True)
    return x, logits, weights, ids


def apply(routed, x, weights, ids):
    return routed.quant_method.apply(layer=routed, x=x, topk_weights=weights, topk_ids=ids, shared_experts=None,
                                     shared_experts_input=None)
