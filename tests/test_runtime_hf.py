"""The runtime on real model code: transformers models (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3)
with their MoE experts swapped for tierstore's tiered layer, served from a pack built from the
saved checkpoint, on the CPU device."""

import json
import warnings

import pytest
import torch
from checkpoint_fixtures import save_hf_checkpoint
from test_runtime_fixtures import runtime_hf_model

from tierstore.checkpoint import open_checkpoint
from tierstore.errors import CapacityError
from tierstore.kernels.layout import unpack_matrix_ref
from tierstore.runtime import RuntimeConfig, TieredRuntime
from tierstore.runtime.generation import TieredGenerator
from tierstore.runtime.hf import install_tiered_experts, load_full_model, load_model, moe_blocks
from tierstore.runtime.packs import ensure_base_pack, open_base_rows

pytest.importorskip("transformers")
warnings.filterwarnings("ignore", category=FutureWarning)

PROMPT = [5, 17, 33, 8, 60, 12]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """model_type -> (checkpoint dir, pack dir), built once per module."""
    built = {}

    def get(model_type, **overrides):
        key = (model_type, tuple(sorted(overrides.items())))
        if key not in built:
            root = tmp_path_factory.mktemp(model_type)
            ckpt = save_hf_checkpoint(runtime_hf_model(model_type, seed=3), root / "ckpt")
            if overrides:
                config = json.loads((ckpt / "config.json").read_text())
                (ckpt / "config.json").write_text(json.dumps({**config, **overrides}))
            ensure_base_pack(ckpt, root / "packs", device="cpu")
            built[key] = (ckpt, root / "packs")
        return built[key]

    return get


def tiered(ckpt, packs, fraction, **config):
    with open_checkpoint(ckpt) as c:
        geometry = c.geometry
    runtime = TieredRuntime(geometry, open_base_rows(ckpt, packs), pool_slots=max(1, round(fraction * geometry.total_routed_experts)),
                            arena_slots=16, config=RuntimeConfig(kpi_every=0, **config))
    model = load_model(ckpt, torch.float32)
    install_tiered_experts(model, runtime)
    return runtime, model


def generate(ckpt, packs, fraction, steps, prefill_chunk=None, **config):
    runtime, model = tiered(ckpt, packs, fraction, **config)
    with runtime:
        if fraction == 1.0:
            runtime.preload()
        out = TieredGenerator(model, runtime, max_length=len(PROMPT) + steps + 1).generate(
            PROMPT, steps, keep_logits=True, prefill_chunk=prefill_chunk)
        return out, runtime.stats()


def w2_reference_model(ckpt, packs):
    """The original transformers model with its experts' weights set to the pack's W2 values."""
    model = load_full_model(ckpt, torch.float32)
    rows = open_base_rows(ckpt, packs, direct=False)
    with open_checkpoint(ckpt) as c:
        geometry = c.geometry
    from tierstore.kernels.layout import w2_slot_layout

    layout = w2_slot_layout(geometry.hidden, geometry.expert_inter)
    dest = bytearray(rows.stride)
    with torch.no_grad():
        for dense, (_, block) in enumerate(moe_blocks(model)):
            for expert in range(geometry.num_experts):
                rows.read_rows([(dense, expert)], [memoryview(dest)])
                slot = torch.frombuffer(dest, dtype=torch.uint8)[:layout.slot_bytes].clone()
                block.experts.gate_up_proj[expert] = unpack_matrix_ref(slot, layout, "w13")
                block.experts.down_proj[expert] = unpack_matrix_ref(slot, layout, "w2")
    rows.close()
    return model


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3"])
def test_all_resident_equals_the_original_model_on_w2_weights(model_type, checkpoints):
    """(a) attention, norms, routing and shared experts are the original code; greedy tokens match."""
    ckpt, packs = checkpoints(model_type)
    steps = 8
    got, stats = generate(ckpt, packs, 1.0, steps)
    reference = w2_reference_model(ckpt, packs)
    with torch.no_grad():
        want = reference.generate(torch.tensor([PROMPT]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                                  output_logits=True, return_dict_in_generate=True)
    assert got.new_ids == want.sequences[0, len(PROMPT):].tolist()
    for step, (a, b) in enumerate(zip(got.step_logits, want.logits)):
        torch.testing.assert_close(a, b[0].float(), rtol=1e-4, atol=1e-4, msg=f"step {step}")
    assert stats.replayed_steps == 0
    assert stats.unread_steps == len(got.new_ids) - 1  # a preloaded full pool reads no decode pass


@pytest.mark.parametrize("pass_pair", [False, True], ids=["single", "pass_pair"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_quarter_pool_is_bit_identical_to_all_resident_over_64_steps(model_type, pass_pair, checkpoints):
    """(b) with 25% of the experts on the device, every step's logits equal the all-resident run; with config
    pass_pair too (the decode steps' pairs step the cache's position back between their passes)."""
    ckpt, packs = checkpoints(model_type)
    steps = 64
    small, stats = generate(ckpt, packs, 0.25, steps, pass_pair=pass_pair, pass_pair_choice="always")
    resident, _ = generate(ckpt, packs, 1.0, steps, prefill_chunk=small.prefill_chunk)  # the same prefill steps
    assert small.new_ids == resident.new_ids
    assert len(small.step_logits) == steps
    for step, (a, b) in enumerate(zip(small.step_logits, resident.step_logits)):
        assert torch.equal(a, b), f"step {step} differs"
    assert stats.replayed_steps > 0 and stats.fetched_rows > stats.pool_slots
    if pass_pair:
        assert stats.pair_steps > 0 and stats.gathered_rows > 0


def test_strict_mode_raises_when_a_step_cannot_fit(checkpoints):
    """(c) a pool too small for one step fails loudly instead of returning degraded logits."""
    ckpt, packs = checkpoints("qwen3_moe")
    runtime, model = tiered(ckpt, packs, 3 / 48, force_pool=True)
    with runtime, pytest.raises(CapacityError, match="cannot hold"):
        TieredGenerator(model, runtime, max_length=16).generate(PROMPT, 4)


def test_swiglu_clamp_of_the_checkpoint_is_honoured(checkpoints):
    """(d) config.json's swiglu_limit clamps gate (above) and up (both sides) in the tiered layer."""
    ckpt, packs = checkpoints("qwen3_moe", swiglu_limit=0.05)
    runtime, model = tiered(ckpt, packs, 1.0)
    with runtime:
        assert runtime.geometry.swiglu_limit == 0.05
        runtime.preload()
        hidden = torch.randn(3, 64, generator=torch.Generator().manual_seed(0)) * 30
        ids = torch.tensor([[0, 1], [2, 3], [4, 5]])
        weights = torch.full((3, 2), 0.5)
        runtime.log.reset()
        clamped = runtime.moe(0, hidden, ids, weights)
        runtime.experts.swiglu_limit = None
        unclamped = runtime.moe(0, hidden, ids, weights)
    from tierstore.reference_moe import swiglu

    assert not torch.equal(clamped, unclamped)
    layout = runtime.layout
    slot = lambda e: runtime_slot_bytes(ckpt, packs, e)  # noqa: E731
    expected = torch.zeros(3, 64)
    for t in range(3):
        for j in range(2):
            raw = slot(int(ids[t, j]))
            w13, w2 = unpack_matrix_ref(raw, layout, "w13"), unpack_matrix_ref(raw, layout, "w2")
            expected[t] += 0.5 * (swiglu(hidden[t] @ w13.T, 0.05) @ w2.T)
    torch.testing.assert_close(clamped, expected, rtol=1e-5, atol=1e-6)


def runtime_slot_bytes(ckpt, packs, expert, layer=0):
    rows = open_base_rows(ckpt, packs, direct=False)
    dest = bytearray(rows.stride)
    rows.read_rows([(layer, expert)], [memoryview(dest)])
    rows.close()
    return torch.frombuffer(dest, dtype=torch.uint8)[:rows.row_bytes].clone()


def test_a_prefill_in_steps_continues_the_cache_like_one_prefill_step(checkpoints):
    """The prompt in prefill steps of 2 tokens (the KV cache rewound to each step's first position) gives the
    logits of one prefill step within float32 rounding, and the same greedy tokens."""
    ckpt, packs = checkpoints("qwen3_moe")
    whole, _ = generate(ckpt, packs, 1.0, 8, prefill_chunk=len(PROMPT))
    steps, _ = generate(ckpt, packs, 1.0, 8, prefill_chunk=2)
    assert (whole.prefill_chunk, steps.prefill_chunk) == (len(PROMPT), 2)
    assert steps.new_ids == whole.new_ids
    for a, b in zip(steps.step_logits, whole.step_logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
