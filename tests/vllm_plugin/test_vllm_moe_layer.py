"""tierstore's FusedMoE method inside vLLM's real MoE layer on CPU: weights from tiny real-format
checkpoints through vLLM's loader, `apply` against tierstore's reference, TP rank geometry."""

import pytest
import torch

from tierstore.checkpoint import open_checkpoint
from tierstore.errors import ConfigError
from tierstore.reference_moe import reference_moe

from moe_helpers import E, FORMATS, H, I, apply, built_layer, reference_tier, routing

pytestmark = pytest.mark.vllm


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


@pytest.mark.parametrize("knobs", [{"DELTA_GB": "2"}, {"DELTA_GB": "2", "GATE": "1"},
                                   {"BASE_CACHE_GB": "1", "EXECUTION": "graph"}])
def test_knobs_needing_the_runner_hook_are_refused_without_tierstores_worker(harness, checkpoints, monkeypatch,
                                                                              knobs):
    for name, value in knobs.items():
        monkeypatch.setenv(f"VLLM_MOE_W2_{name}", value)
    with harness.cpu_vllm(), pytest.raises(ConfigError, match="--worker-cls tierstore.vllm_adapter.worker.TieredWorker"):
        built_layer(harness, checkpoints["bf16"], process=False)
    with harness.cpu_vllm(tiered_worker=True):
        built_layer(harness, checkpoints["bf16"], process=False)  # accepted with the worker


def test_cuda_kernels_knob_is_refused_for_a_layer_on_the_cpu(harness, checkpoints, monkeypatch):
    monkeypatch.setenv("VLLM_MOE_W2_CUDA_W2", "1")
    with harness.cpu_vllm():
        _, routed = built_layer(harness, checkpoints["bf16"], process=False)
        with pytest.raises(ConfigError, match="CUDA_W2=1 runs CUDA C.. kernels; .* lives on cpu: unset the knob"):
            routed.quant_method.process_weights_after_loading(routed)


def test_shard_cutting_a_w2_block_is_refused(harness, checkpoints):
    with harness.cpu_vllm(), harness.tensor_parallel_rank(8, 0), pytest.raises(ConfigError, match="multiples of 32"):
        built_layer(harness, checkpoints["bf16"], process=False)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_kernel_backend_matches_the_reference_in_the_triton_interpreter(harness, checkpoints, fmt):
    """The CUDA path's glue (slot packing, tier pools, workspaces, moe_mm call) on CPU tensors
    through Triton's interpreter (tests/conftest.py turns it on where there is no GPU)."""
    import os

    from tierstore.vllm_adapter.expert_compute import KernelBackend, ReferenceBackend
    from tierstore.vllm_adapter.residency import resident_layer
    from tierstore.vllm_adapter.source_formats import requantize_expert

    if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs the kernels in Triton's CPU interpreter")
    with harness.cpu_vllm():
        _, routed = built_layer(harness, checkpoints[fmt], process=False)
        method = routed.quant_method
        params = {name: getattr(routed, name).data for name in method._param_names}
        experts = [requantize_expert(method.source_format, params, e, "auto") for e in range(E)]
    x, _, weights, ids = routing(harness, seed=11)
    outputs = []
    for backend in (KernelBackend(H, I, E), ReferenceBackend(H, I, E)):
        rows = [torch.stack(parts) for parts in zip(*(backend.expert_rows(*w2) for w2 in experts))]
        slots = resident_layer(rows, torch.device("cpu"))
        outputs.append(backend.run(x, ids, weights, slots.table, slots.slots, None))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-4, atol=1e-5)
