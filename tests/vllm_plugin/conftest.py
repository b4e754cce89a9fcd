"""Fixtures of the `vllm`-marked tests. Nothing here imports vLLM at collection time, so this
folder is collected (and skipped) cleanly where vLLM is not installed."""

import pytest

from tierstore.checkpoint.synthetic import write_synthetic_checkpoint

from moe_helpers import E, FORMATS, H, I, K


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
def fresh_tiers():
    """Each test builds its own models: drop the process's runtime and pack handles around it."""
    from tierstore.vllm_adapter.pack_boot import forget_pack_boots
    from tierstore.vllm_adapter.tiered import forget_tiered_model

    forget_tiered_model()
    forget_pack_boots()
    yield
    forget_tiered_model()
    forget_pack_boots()
