"""Issue 5 §2(b) on every transformers family the integration supports: with a device pool of 25% of
the experts, every decode step's logits after replay equal the all-resident run bit for bit over
64 steps. test_runtime_hf covers qwen3_moe and deepseek_v3; this module runs the other four through
the same check."""

import pytest
from checkpoint_fixtures import save_hf_checkpoint
from test_runtime_fixtures import runtime_hf_model
from test_runtime_hf import test_quarter_pool_is_bit_identical_to_all_resident_over_64_steps as quarter_pool_check

from tierstore.runtime.packs import ensure_base_pack

pytest.importorskip("transformers")

# With one dense layer of three, 25% of these families' 32 routed experts is 8 slots, fewer than the
# 6-token prompt may route in one layer (12): the prefill then refuses (CapacityError, strict).
# Built with every layer MoE, 25% is 12 slots.
ALL_MOE = {"qwen2_moe": dict(mlp_only_layers=[]), "deepseek_v2": dict(first_k_dense_replace=0)}


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory):
    """model_type -> (checkpoint dir, pack dir) of a seeded tiny model of that family."""
    def build(model_type):
        root = tmp_path_factory.mktemp(model_type)
        model = runtime_hf_model(model_type, seed=3, **ALL_MOE.get(model_type, {}))
        ckpt = save_hf_checkpoint(model, root / "ckpt")
        ensure_base_pack(ckpt, root / "packs", device="cpu")
        return ckpt, root / "packs"

    return build


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe", "olmoe", "deepseek_v2"])
def test_quarter_pool_is_bit_identical_over_64_steps_for_the_other_families(model_type, family_checkpoints):
    """64 decode steps at 25% coverage replay (and fetch more rows than the pool holds) and return the
    all-resident logits and tokens exactly."""
    quarter_pool_check(model_type, family_checkpoints)
