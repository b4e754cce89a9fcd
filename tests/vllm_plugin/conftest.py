"""Fixtures of the `vllm`-marked tests. Nothing here imports vLLM at collection time, so this
folder is collected (and skipped) cleanly where vLLM is not installed."""

import pytest

from tierstore.checkpoint.synthetic import write_synthetic_checkpoint

from moe_helpers import E, FORMATS, H, I, K


@pytest.fixture(scope="module", autouse=True)
def children_keep_the_cwd_off_their_path(tmp_path_factory):
    """vLLM inspects a model in a child Python (`python -m vllm.model_executor.models.registry`) started in the
    cwd, the repository root under pytest, where `kernels/` would shadow PyPI's `kernels` for that child's
    transformers (tests/conftest.py says why): PYTHONSAFEPATH keeps the cwd off its path. Only while these tests
    run: elsewhere it would also keep a benchmark script's own folder off the path of the scripts tests start.
    vLLM's cache of inspected models starts empty in each module, so that child runs here as on a new machine."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONSAFEPATH", "1")
        patch.setenv("VLLM_CACHE_ROOT", str(tmp_path_factory.mktemp("vllm-cache")))
        yield


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
