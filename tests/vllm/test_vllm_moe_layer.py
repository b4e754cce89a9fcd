"""tierstore's FusedMoE method inside vLLM's real MoE layer on CPU: weights from tiny real-format
checkpoints through vLLM's loader, `apply` against tierstore's reference, TP rank geometry."""

import json

import pytest
import torch

from tierstore.checkpoint import open_checkpoint
from tierstore.checkpoint.synthetic import write_synthetic_checkpoint
from tierstore.errors import ConfigError
from tierstore.formats import quantize_w2, w2_from_mxfp4
from tierstore.reference_moe import ExpertPool, ExpertTier, reference_moe

pytestmark = pytest.mark.vllm

FORMATS = ("bf16", "nvfp4", "fp8_block", "mxfp4")
E, K, H, I = 8, 2, 128, 128
PREFIX = "model.layers.0.mlp"


@pytest.fixture(scope="module")
def harness():
    import vllm_harness

    return vllm_harness


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {fmt: write_synthetic_checkpoint(root / fmt, arch="qwen3_moe", num_layers=2, num_experts=E, top_k=K,
                                            hidden=H, expert_inter=I, fmt=fmt, fp8_block=(32, 32), seed=3)
            for fmt in FORMATS}


@pytest.fixture(autouse=True)
def fresh_cache():
    from tierstore.vllm_adapter.residency import reset_process_cache

    reset_process_cache()
    yield
    reset_process_cache()


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


def reference_tier(path, layer=0, row_slice=slice(None), col_slice=slice(None), zero_mode="auto") -> ExpertTier:
    """W2 of the checkpoint's experts computed independently of vLLM: tierstore's checkpoint
    reader, then the requantizer on the (TP-sliced) float64 values."""
    experts = []
    with open_checkpoint(path) as checkpoint:
        for expert in checkpoint.layer(layer).experts:
            if checkpoint.source_format == "mxfp4":
                w13, w2 = (w2_from_mxfp4(*m.mxfp4_parts()) for m in (expert.w13, expert.w2))
                w13_values, w2_values = w13.dequantize(), w2.dequantize()
                inter = w13_values.shape[0] // 2
                gate, up = w13_values[:inter][row_slice], w13_values[inter:][row_slice]
                experts.append((torch.cat([gate, up]), w2_values[:, col_slice]))
                continue
            w13_full, w2_full = expert.w13.dequantize(), expert.w2.dequantize()
            inter = w13_full.shape[0] // 2
            w13_shard = torch.cat([w13_full[:inter][row_slice], w13_full[inter:][row_slice]])
            experts.append((quantize_w2(w13_shard, zero_mode=zero_mode).dequantize(),
                            quantize_w2(w2_full[:, col_slice], zero_mode=zero_mode).dequantize()))
    table = torch.arange(len(experts), dtype=torch.int32).view(1, -1)
    return ExpertTier("w2", table, ExpertPool.from_experts(experts))


def routing(harness, tokens=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen)
    logits = torch.randn(tokens, E, generator=gen)
    weights, ids = harness.softmax_topk(x, logits, K, True)
    return x, logits, weights, ids


def apply(routed, x, weights, ids):
    return routed.quant_method.apply(layer=routed, x=x, topk_weights=weights, topk_ids=ids, shared_experts=None,
                                     shared_experts_input=None)


@pytest.mark.parametrize("fmt", FORMATS)
def test_vllm_loader_fills_the_checkpoint_values(harness, checkpoints, fmt):
    from tierstore.vllm_adapter.source_formats import dequantize_expert

    with harness.cpu_vllm():
        _, routed = built_layer(harness, checkpoints[fmt], process=False)
        method = routed.quant_method
        params = {name: getattr(routed, name).data for name in method._param_names}
        with open_checkpoint(checkpoints[fmt]) as checkpoint:
            for expert in checkpoint.layer(0).experts:
                w13, w2 = dequantize_expert(method.source_format, params, expert.expert)
                assert torch.equal(w13, expert.w13.dequantize()), f"{fmt} expert {expert.expert} w13"
                assert torch.equal(w2, expert.w2.dequantize()), f"{fmt} expert {expert.expert} w2"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("keyword_style", [False, True])
def test_apply_equals_tierstore_reference(harness, checkpoints, fmt, keyword_style):
    with harness.cpu_vllm():
        _, routed = built_layer(harness, checkpoints[fmt], keyword_style=keyword_style)
        x, _, weights, ids = routing(harness)
        out = apply(routed, x, weights, ids)
    expected = reference_moe(x, ids, weights, layer=0, tiers=[reference_tier(checkpoints[fmt])]).output
    assert out.shape == (6, H) and out.dtype == x.dtype
    assert torch.equal(out, expected)
    assert not hasattr(routed, "w13_weight"), "checkpoint-format parameters should be freed after requantization"


def test_full_runner_forward_routes_and_applies(harness, checkpoints):
    from vllm.forward_context import set_forward_context

    with harness.cpu_vllm() as vllm_config:
        runner, _ = built_layer(harness, checkpoints["bf16"])
        x, logits, weights, ids = routing(harness, tokens=4, seed=1)
        with set_forward_context(None, vllm_config):
            out = runner(x, logits)
    expected = reference_moe(x, ids, weights, layer=0, tiers=[reference_tier(checkpoints["bf16"])]).output
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_swiglu_clamp_of_the_layer_is_honoured(harness, checkpoints):
    limit = 0.002
    with harness.cpu_vllm():
        _, routed = built_layer(harness, checkpoints["bf16"], swiglu_limit=limit)
        x, _, weights, ids = routing(harness)
        out = apply(routed, x * 50, weights, ids)
    tier = reference_tier(checkpoints["bf16"])
    clamped = reference_moe(x * 50, ids, weights, layer=0, tiers=[tier], swiglu_limit=limit).output
    unclamped = reference_moe(x * 50, ids, weights, layer=0, tiers=[tier]).output
    assert torch.equal(out, clamped)
    assert not torch.allclose(out, unclamped)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tensor_parallel_rank_geometry(harness, checkpoints, fmt, tp, monkeypatch):
    """Each rank's shard is its slice of the checkpoint; the ranks' outputs sum to the TP-1 output.

    ZERO_MODE=sign: `auto` decides zero signs per tensor, and a rank's tensor is its shard, so
    with `auto` a shard with one-signed exact zeros may choose differently from the whole matrix.
    """
    monkeypatch.setenv("TIERSTORE_ZERO_MODE", "sign")
    x, _, weights, ids = routing(harness, seed=2)
    shard = I // tp
    total = torch.zeros(6, H)
    for rank in range(tp):
        with harness.cpu_vllm(), harness.tensor_parallel_rank(tp, rank):
            _, routed = built_layer(harness, checkpoints[fmt])
            assert routed.quant_method.inter == shard
            out = apply(routed, x, weights, ids)
        rows = cols = slice(rank * shard, (rank + 1) * shard)
        tier = reference_tier(checkpoints[fmt], row_slice=rows, col_slice=cols, zero_mode="sign")
        assert torch.equal(out, reference_moe(x, ids, weights, layer=0, tiers=[tier]).output), f"rank {rank}"
        total += out
    full = reference_moe(x, ids, weights, layer=0, tiers=[reference_tier(checkpoints[fmt], zero_mode="sign")]).output
    torch.testing.assert_close(total, full, rtol=1e-4, atol=1e-6)


def test_expert_parallel_is_refused(harness, checkpoints):
    import dataclasses

    from vllm.model_executor.layers.fused_moe import layer as fused_moe_layer
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig

    original = fused_moe_layer.make_parallel_config
    ep = dataclasses.replace(FusedMoEParallelConfig.make_no_parallel(), use_ep=True)
    fused_moe_layer.make_parallel_config = lambda *a, **k: ep
    try:
        with harness.cpu_vllm(), pytest.raises(ConfigError, match="expert parallelism"):
            built_layer(harness, checkpoints["bf16"], process=False)
    finally:
        fused_moe_layer.make_parallel_config = original


def test_knobs_needing_the_runtime_are_refused_at_layer_creation(harness, checkpoints, monkeypatch):
    monkeypatch.setenv("VLLM_MOE_W2_DELTA_GB", "2")
    with harness.cpu_vllm(), pytest.raises(ConfigError, match="DELTA_GB"):
        built_layer(harness, checkpoints["bf16"], process=False)


def test_shard_cutting_a_w2_block_is_refused(harness, checkpoints):
    with harness.cpu_vllm(), harness.tensor_parallel_rank(8, 0), pytest.raises(ConfigError, match="multiples of 32"):
        built_layer(harness, checkpoints["bf16"], process=False)
