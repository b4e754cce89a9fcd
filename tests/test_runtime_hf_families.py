"""Issue 5 §2(b) on every transformers family the integration supports: with a device pool of 25% of
the experts, every decode step's logits after replay equal the all-resident run bit for bit over
64 steps. test_runtime_hf covers qwen3_moe and deepseek_v3; this module runs the other four through
the same check."""

import pytest
import torch
from checkpoint_fixtures import save_hf_checkpoint
from test_runtime_fixtures import runtime_hf_model
from test_runtime_hf import PROMPT, generate
from test_runtime_hf import test_quarter_pool_is_bit_identical_to_all_resident_over_64_steps as quarter_pool_check

from tierstore.errors import CapacityError
from tierstore.runtime.packs import ensure_base_pack

pytest.importorskip("transformers")

# qwen2_moe and deepseek_v2 keep their dense first layer: 25% of their 32 routed experts is 8 slots,
# fewer than the 6-token prompt may route in one layer (12), so their prefill runs in steps of 4 tokens
# (`TieredGenerator.prefill_chunk`), and the resident run repeats those steps.


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory):
    """model_type -> (checkpoint dir, pack dir) of a seeded tiny model of that family."""
    def build(model_type):
        root = tmp_path_factory.mktemp(model_type)
        model = runtime_hf_model(model_type, seed=3)
        ckpt = save_hf_checkpoint(model, root / "ckpt")
        ensure_base_pack(ckpt, root / "packs", device="cpu")
        return ckpt, root / "packs"

    return build


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "olmoe", "deepseek_v2"])
def test_quarter_pool_is_bit_identical_over_64_steps_for_the_other_families(model_type, family_checkpoints):
    """64 decode steps at 25% coverage replay (and fetch more rows than the pool holds) and return the
    all-resident logits and tokens exactly."""
    quarter_pool_check(model_type=model_type, pass_pair=False, checkpoints=family_checkpoints)


def test_a_prompt_whose_layer_cannot_fit_the_pool_prefills_in_steps(family_checkpoints, monkeypatch):
    """qwen2_moe at 25% (8 slots, top-2): the 6-token prompt runs in prefill steps of 4 tokens and the run
    matches the resident one (test above). The same prompt in one prefill step runs too: each layer that routes
    more than 8 experts runs in token chunks (`TieredRuntime.moe`), within rounding of the resident one-step
    prefill (not bit for bit: the chunks' GEMMs run over fewer tokens). Negative control: one chunk per layer cannot
    fit and is refused, as the one-step prefill was before the chunks."""
    from tierstore.runtime import engine

    ckpt, packs = family_checkpoints("qwen2_moe")
    small, _ = generate(ckpt, packs, 0.25, 2)
    assert small.prefill_chunk == 4 < len(PROMPT)
    one_step, _ = generate(ckpt, packs, 0.25, 2, prefill_chunk=len(PROMPT))
    resident, _ = generate(ckpt, packs, 1.0, 2, prefill_chunk=len(PROMPT))
    assert one_step.prefill_chunk == len(PROMPT)
    torch.testing.assert_close(one_step.step_logits[0], resident.step_logits[0], rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(engine, "token_chunks", lambda ids, slots: [(0, len(ids))])
    with pytest.raises(CapacityError, match="cannot hold"):
        generate(ckpt, packs, 0.25, 2, prefill_chunk=len(PROMPT))
