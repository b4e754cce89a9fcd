"""GPU-as-expert-cache and pack boot inside vLLM's layer on CPU: the process's tiered runtime
(eager fetch before compute; graph execution driven by runtime.step), start-up refusals, and
STORE_DIR boots that read the pack instead of requantizing."""

import pytest
import torch

from tierstore.errors import CapacityError, ConfigError
from tierstore.vllm_adapter.expert_compute import w2_slot_bytes

from moe_helpers import E, H, I, apply, built_layer, routing

pytestmark = pytest.mark.vllm

SLOT = w2_slot_bytes(H, I)


def two_layers(harness, path):
    return [built_layer(harness, path, layer=layer)[1] for layer in (0, 1)]


def chained_step(layers, x, weights, ids):
    """A "model step": layer 1 consumes layer 0's output."""
    first = apply(layers[0], x, weights, ids)
    return first, apply(layers[1], x + first, weights, ids)


def resident_step(harness, path, inputs):
    with harness.cpu_vllm():
        return chained_step(two_layers(harness, path), *inputs)


def use_cache(monkeypatch, slots, execution="eager", **knobs):
    monkeypatch.setenv("VLLM_MOE_W2_BASE_CACHE_GB", f"{slots * SLOT}B")
    monkeypatch.setenv("TIERSTORE_EXECUTION", execution)
    for name, value in knobs.items():
        monkeypatch.setenv(f"VLLM_MOE_W2_{name}", str(value))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_eager_cache_smaller_than_the_model_gives_the_resident_result(harness, checkpoints, monkeypatch, fmt):
    from tierstore.vllm_adapter.tiered import current_runtime

    x, _, weights, ids = routing(harness, tokens=8, seed=4)
    expected = resident_step(harness, checkpoints[fmt], (x, weights, ids))
    use_cache(monkeypatch, E)  # one layer's worth of slots for two layers
    with harness.cpu_vllm():
        layers = two_layers(harness, checkpoints[fmt])
        for _ in range(2):  # the second round refetches what the other layer pushed out
            got = chained_step(layers, x, weights, ids)
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        runtime = current_runtime()
    assert runtime.pool.num_slots == E
    assert runtime.stats().fetched_rows > len(ids.unique())


def test_eager_prefill_routing_more_experts_than_the_cache_runs_in_chunks(harness, checkpoints, monkeypatch):
    """5 slots pass the start-up check (2 layers x top-2 x 1 token x 1.15 = 4.6) but a 12-token batch routes more
    experts than that in each layer: before, the fetch raised CapacityError; now the batch runs in token chunks that
    fit. Not bit-identical to one batch (a chunk's GEMMs over fewer tokens round differently): within 1e-6 of the
    resident result, where the unchunked cache (8 slots) is exact."""
    x, _, weights, ids = routing(harness, tokens=12, seed=7)
    assert len(ids.unique()) > 5
    expected = resident_step(harness, checkpoints["bf16"], (x, weights, ids))
    from tierstore.vllm_adapter.tiered import forget_tiered_model

    for slots in (5, 8):
        forget_tiered_model()  # a fresh process's runtime per cache size
        use_cache(monkeypatch, slots)
        with harness.cpu_vllm():
            got = chained_step(two_layers(harness, checkpoints["bf16"]), x, weights, ids)
        if slots == 8:
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        else:
            for g, e in zip(got, expected):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)


def test_cache_below_the_working_set_is_refused_at_the_first_forward(harness, checkpoints, monkeypatch):
    x, _, weights, ids = routing(harness)
    use_cache(monkeypatch, 2)
    with harness.cpu_vllm():
        layers = two_layers(harness, checkpoints["bf16"])
        with pytest.raises(CapacityError, match="would work"):
            apply(layers[0], x, weights, ids)


def test_eager_cache_under_cuda_graphs_is_refused(harness, checkpoints, monkeypatch):
    from tierstore.vllm_adapter import moe_method

    use_cache(monkeypatch, E)
    monkeypatch.setattr(moe_method.torch.cuda, "is_available", lambda: True)
    with harness.cpu_vllm(), pytest.raises(ConfigError, match="--enforce-eager"):
        built_layer(harness, checkpoints["bf16"], process=False)
    with harness.cpu_vllm(model=checkpoints["bf16"], enforce_eager=True):
        built_layer(harness, checkpoints["bf16"], process=False)  # accepted with --enforce-eager


def test_graph_execution_replays_to_the_resident_result(harness, checkpoints, monkeypatch):
    from tierstore.vllm_adapter.tiered import current_runtime

    x, _, weights, ids = routing(harness, tokens=8, seed=5)
    expected = resident_step(harness, checkpoints["bf16"], (x, weights, ids))
    use_cache(monkeypatch, 2 * E, execution="graph")
    with harness.cpu_vllm(tiered_worker=True):
        layers = two_layers(harness, checkpoints["bf16"])
        first_pass = chained_step(layers, x, weights, ids)  # builds the runtime; everything misses
        assert torch.equal(first_pass[0], torch.zeros_like(first_pass[0]))
        runtime = current_runtime()
        result, outcome = runtime.step(lambda: chained_step(layers, x, weights, ids), rewind=lambda: None)
        assert outcome.replays == 1 and outcome.residue_pairs == 0
        assert torch.equal(result[0], expected[0]) and torch.equal(result[1], expected[1])
        _, again = runtime.step(lambda: chained_step(layers, x, weights, ids), rewind=lambda: None)
        assert again.replays == 0 and again.first_pass_missing_pairs == 0


def test_graph_execution_strict_mode_refuses_after_fp_max(harness, checkpoints, monkeypatch):
    """Each replay routes to experts the last fetch did not bring (as re-routing after upgraded
    early layers can): strict refuses after FP_MAX replays."""
    from tierstore.runtime import ReplayLimitError
    from tierstore.vllm_adapter.tiered import current_runtime

    x, _, weights, _ = routing(harness, tokens=2, seed=7)
    use_cache(monkeypatch, E, execution="graph", FP_MAX=3)
    calls = [0]

    def step():
        calls[0] += 1
        ids = torch.tensor([[calls[0] % E, (calls[0] + 1) % E]] * 2, dtype=torch.int32)
        return [apply(layer, x, weights, ids) for layer in layers]

    with harness.cpu_vllm(tiered_worker=True):
        layers = two_layers(harness, checkpoints["bf16"])
        step()
        with pytest.raises(ReplayLimitError, match="after 3 replays"):
            current_runtime().step(step, rewind=lambda: None)


def test_store_dir_boots_resident_layers_from_the_pack(harness, checkpoints, monkeypatch, tmp_path):
    from tierstore.vllm_adapter.pack_boot import forget_pack_boots, pack_boot

    x, _, weights, ids = routing(harness, seed=9)
    with harness.cpu_vllm():
        expected = apply(built_layer(harness, checkpoints["fp8_block"])[1], x, weights, ids)
    monkeypatch.setenv("TIERSTORE_STORE_DIR", str(tmp_path))
    with harness.cpu_vllm(model=checkpoints["fp8_block"]):
        out = apply(built_layer(harness, checkpoints["fp8_block"])[1], x, weights, ids)
        first_boot = pack_boot(checkpoints["fp8_block"], tmp_path, "auto", False)
        assert first_boot.requantized_layers == [0, 1]
    assert torch.equal(out, expected)
    forget_pack_boots()
    with harness.cpu_vllm(model=checkpoints["fp8_block"]):
        again = apply(built_layer(harness, checkpoints["fp8_block"])[1], x, weights, ids)
        assert pack_boot(checkpoints["fp8_block"], tmp_path, "auto", False).requantized_layers == []
    assert torch.equal(again, expected)


def test_store_dir_with_expert_cache_serves_from_the_pack(harness, checkpoints, monkeypatch, tmp_path):
    x, _, weights, ids = routing(harness, tokens=8, seed=10)
    expected = resident_step(harness, checkpoints["nvfp4"], (x, weights, ids))
    use_cache(monkeypatch, E, STORE_DIR=tmp_path, BASE_RAM_GB="auto")
    with harness.cpu_vllm(model=checkpoints["nvfp4"]):
        got = chained_step(two_layers(harness, checkpoints["nvfp4"]), x, weights, ids)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
