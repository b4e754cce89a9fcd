"""The FP4 pool (DELTA_GB) and the confidence gate (GATE) inside vLLM's MoE layers on CPU, driven
the way tierstore's worker drives them (`step_hook.hooked_forward`): pool-served experts equal
the FP4 reference, a gate at tau 1.0 gives the all-FP4 result, packs carry the FP4 rows."""

import pytest
import torch

from tierstore.kernels.layout import fp4_slot_layout
from tierstore.reference_moe import reference_moe
from tierstore.vllm_adapter.step_hook import StepBatch, hooked_forward

from moe_helpers import E, H, I, apply, built_layer, reference_tier, routing

pytestmark = pytest.mark.vllm

FP4_SLOT = fp4_slot_layout(H, I).slot_bytes
VOCAB = 64


def use_tier(monkeypatch, fp4_slots, **knobs):
    monkeypatch.setenv("VLLM_MOE_W2_DELTA_GB", f"{fp4_slots * FP4_SLOT}B")
    for name, value in knobs.items():
        monkeypatch.setenv(f"VLLM_MOE_W2_{name}", str(value))


def two_layers(harness, path):
    return [built_layer(harness, path, layer=layer)[1] for layer in (0, 1)]


def model_forward(layers, x, weights, ids):
    """A two-layer "model": layer 1 reads layer 0's output; returns the final hidden states."""
    first = x + apply(layers[0], x, weights, ids)
    return first + apply(layers[1], first, weights, ids)


def reference_forward(path, precision, x, weights, ids):
    tiers = [reference_tier(path, layer=layer, precision=precision) for layer in (0, 1)]
    first = x + reference_moe(x, ids, weights, layer=0, tiers=[tiers[0]]).output
    return first + reference_moe(first, ids, weights, layer=0, tiers=[tiers[1]]).output


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_fp4_pool_serves_the_fp4_reference(harness, checkpoints, monkeypatch, fmt):
    from tierstore.vllm_adapter.tiered import current_runtime

    x, _, weights, ids = routing(harness, tokens=6, seed=11)
    fp4 = reference_forward(checkpoints[fmt], "fp4", x, weights, ids)
    w2 = reference_forward(checkpoints[fmt], "w2", x, weights, ids)
    assert not torch.equal(fp4, w2)  # the tiers differ on this checkpoint
    use_tier(monkeypatch, 2 * E)
    with harness.cpu_vllm(tiered_worker=True):
        layers = two_layers(harness, checkpoints[fmt])
        assert torch.equal(model_forward(layers, x, weights, ids), w2)  # empty FP4 pool: the W2 base
        runtime = current_runtime()
        assert runtime.pool.num_slots == 2 * E  # without BASE_CACHE_GB every base expert is resident
        runtime.preload_fp4()
        assert torch.equal(model_forward(layers, x, weights, ids), fp4)


def test_prefill_step_promotes_its_routed_experts(harness, checkpoints, monkeypatch):
    from tierstore.vllm_adapter.tiered import runtime_for_step

    x, _, weights, ids = routing(harness, tokens=6, seed=12)
    use_tier(monkeypatch, 2 * E)
    with harness.cpu_vllm(tiered_worker=True):
        layers = two_layers(harness, checkpoints["bf16"])
        runtime = runtime_for_step()
        out = hooked_forward(runtime, lambda: model_forward(layers, x, weights, ids), StepBatch(False, 6),
                             compute_logits=None)
        routed = {(layer, int(e)) for layer in (0, 1) for e in ids.unique()}
        assert all(runtime.fp4.pool.is_resident(key) for key in routed)
        assert runtime.fp4_stats().promoted_prefill == len(routed)
    assert torch.equal(out, reference_forward(checkpoints["bf16"], "fp4", x, weights, ids))


def test_gate_at_tau_one_gives_the_all_fp4_result(harness, checkpoints, monkeypatch):
    from tierstore.vllm_adapter.tiered import runtime_for_step

    x, _, weights, ids = routing(harness, tokens=4, seed=13)
    lm_head = torch.randn(H, VOCAB, generator=torch.Generator().manual_seed(1))
    rows_seen = []

    def compute_logits(hidden):
        rows_seen.append(hidden.shape[0])
        return hidden @ lm_head

    use_tier(monkeypatch, 2 * E, GATE=1, GATE_TAU="1.0")
    with harness.cpu_vllm(tiered_worker=True):
        layers = two_layers(harness, checkpoints["nvfp4"])
        runtime = runtime_for_step()
        padded = torch.cat([x, torch.zeros(2, H)])  # two padding rows, as CUDA-graph batches have
        padded_ids = torch.cat([ids, ids[:2]])
        padded_weights = torch.cat([weights, weights[:2]])
        out = hooked_forward(runtime, lambda: model_forward(layers, padded, padded_weights, padded_ids),
                             StepBatch(True, 4), compute_logits)
        stats = runtime.gate_stats()
    assert stats.fired == 1 and rows_seen[0] == 4  # the gate saw the sampled rows only
    expected = reference_forward(checkpoints["nvfp4"], "fp4", padded, padded_weights, padded_ids)
    assert torch.equal(out, expected)
    assert not torch.equal(out, reference_forward(checkpoints["nvfp4"], "w2", padded, padded_weights, padded_ids))


def test_store_dir_builds_the_fp4_pack_and_serves_it(harness, checkpoints, monkeypatch, tmp_path):
    from tierstore.vllm_adapter.pack_boot import pack_boot
    from tierstore.vllm_adapter.tiered import current_runtime

    x, _, weights, ids = routing(harness, tokens=6, seed=14)
    use_tier(monkeypatch, 2 * E, STORE_DIR=tmp_path)
    with harness.cpu_vllm(model=checkpoints["fp8_block"], tiered_worker=True):
        layers = two_layers(harness, checkpoints["fp8_block"])
        boot = pack_boot(checkpoints["fp8_block"], tmp_path, "auto", False, fp4=True)
        assert boot.report.written == {"base": [0, 1], "fp4": [0, 1]}
        model_forward(layers, x, weights, ids)
        current_runtime().preload_fp4()
        out = model_forward(layers, x, weights, ids)
    assert torch.equal(out, reference_forward(checkpoints["fp8_block"], "fp4", x, weights, ids))
