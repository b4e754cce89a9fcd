"""GPU-as-expert-cache inside vLLM's layer on CPU: eager fetch before compute, graph-mode miss
record + batched fetch + replay to a fixed point, and the start-up refusals."""

import pytest
import torch

from tierstore.errors import CapacityError
from tierstore.vllm_adapter.expert_compute import w2_slot_bytes

from moe_helpers import E, H, I, apply, built_layer, routing

pytestmark = pytest.mark.vllm

SLOT = w2_slot_bytes(H, I)


def two_layers(harness, path):
    return [built_layer(harness, path, layer=layer)[1] for layer in (0, 1)]


def resident_outputs(harness, path, inputs):
    with harness.cpu_vllm():
        layers = two_layers(harness, path)
        return [apply(layer, *inputs) for layer in layers]


def test_eager_cache_smaller_than_the_model_gives_the_resident_result(harness, checkpoints, monkeypatch):
    from tierstore.vllm_adapter.residency import current_cache

    x, _, weights, ids = routing(harness, tokens=8, seed=4)
    expected = resident_outputs(harness, checkpoints["nvfp4"], (x, weights, ids))
    monkeypatch.setenv("VLLM_MOE_W2_BASE_CACHE_GB", f"{E * SLOT}B")  # one layer's worth for two layers
    with harness.cpu_vllm():
        layers = two_layers(harness, checkpoints["nvfp4"])
        cache = current_cache()
        assert cache.num_slots == E
        for _ in range(2):  # the second round evicts and refetches what the other layer pushed out
            for layer, want in zip(layers, expected):
                assert torch.equal(apply(layer, x, weights, ids), want)
    assert cache.fetched > len(ids.unique())


def test_cache_below_one_layers_experts_is_refused_at_load(harness, checkpoints, monkeypatch):
    monkeypatch.setenv("TIERSTORE_BASE_CACHE_GB", f"{(E - 1) * SLOT}B")
    with harness.cpu_vllm(), pytest.raises(CapacityError, match="set BASE_CACHE_GB to at least"):
        built_layer(harness, checkpoints["bf16"])


def graph_mode(monkeypatch, slots, **knobs):
    monkeypatch.setenv("TIERSTORE_BASE_CACHE_GB", f"{slots * SLOT}B")
    monkeypatch.setenv("TIERSTORE_EXECUTION", "graph")
    for name, value in knobs.items():
        monkeypatch.setenv(f"TIERSTORE_{name}", str(value))


def test_graph_mode_records_misses_and_the_replay_equals_the_resident_run(harness, checkpoints, monkeypatch):
    from tierstore.vllm_adapter.residency import current_cache
    from tierstore.vllm_adapter.settings import AdapterSettings
    from tierstore.vllm_adapter.step_replay import run_step

    x, _, weights, ids = routing(harness, tokens=8, seed=5)

    def step(layers):  # layer 1 consumes layer 0's output, as in a model
        first = apply(layers[0], x, weights, ids)
        return first, apply(layers[1], x + first, weights, ids)

    with harness.cpu_vllm():
        expected = step(two_layers(harness, checkpoints["bf16"]))
    graph_mode(monkeypatch, 2 * E)
    with harness.cpu_vllm():
        layers = two_layers(harness, checkpoints["bf16"])
        cache = current_cache()
        result, report = run_step(lambda: step(layers), cache, AdapterSettings.from_environ())
        assert report.replays == 1 and report.fetched == 2 * len(ids.unique()) and report.residual_pairs == 0
        assert torch.equal(result[0], expected[0]) and torch.equal(result[1], expected[1])
        _, again = run_step(lambda: step(layers), cache, AdapterSettings.from_environ())
        assert again.replays == 0 and again.fetched == 0


def test_first_graph_pass_zeroes_missing_pairs_exactly(harness, checkpoints, monkeypatch):
    from tierstore.vllm_adapter.residency import current_cache

    x, _, weights, ids = routing(harness, tokens=3, seed=6)
    graph_mode(monkeypatch, E)
    with harness.cpu_vllm():
        (layer,) = [built_layer(harness, checkpoints["bf16"])[1]]
        out = apply(layer, x, weights, ids)
        cache = current_cache()
    assert torch.equal(out, torch.zeros_like(out))
    assert cache.pending_pairs == ids.numel()
    assert cache.pending == {(layer.quant_method.prefix, e) for e in ids.unique().tolist()}


def test_a_batch_of_misses_larger_than_the_cache_is_refused(harness, checkpoints, monkeypatch):
    from tierstore.vllm_adapter.residency import current_cache
    from tierstore.vllm_adapter.settings import AdapterSettings
    from tierstore.vllm_adapter.step_replay import run_step

    x, _, weights, ids = routing(harness, tokens=16, seed=7)
    graph_mode(monkeypatch, E)
    with harness.cpu_vllm():
        layers = two_layers(harness, checkpoints["bf16"])
        step = lambda: [apply(layer, x, weights, ids) for layer in layers]  # noqa: E731
        with pytest.raises(CapacityError, match="exceed the 8 cache slots"):
            run_step(step, current_cache(), AdapterSettings.from_environ())


def test_strict_mode_raises_when_fp_max_replays_do_not_converge(harness, checkpoints, monkeypatch):
    """Each replay routes to experts the last fetch did not bring (as re-routing after upgraded
    early layers can): strict refuses after FP_MAX replays, approximate reports the residue."""
    from tierstore.vllm_adapter.residency import current_cache
    from tierstore.vllm_adapter.settings import AdapterSettings
    from tierstore.vllm_adapter.step_replay import run_step

    x, _, weights, _ = routing(harness, tokens=2, seed=7)
    graph_mode(monkeypatch, E)
    calls = [0]

    def step():
        calls[0] += 1
        ids = torch.tensor([[calls[0] % E, (calls[0] + 1) % E]] * 2, dtype=torch.int32)
        return [apply(layer, x, weights, ids) for layer in layers]

    with harness.cpu_vllm():
        layers = two_layers(harness, checkpoints["bf16"])
        cache = current_cache()
        with pytest.raises(CapacityError, match="still missing after 3 replays"):
            run_step(step, cache, AdapterSettings.from_environ({"TIERSTORE_FP_MAX": "3"}))
        _, report = run_step(step, cache, AdapterSettings.from_environ(
            {"TIERSTORE_FP_MAX": "2", "TIERSTORE_REPLAY_MODE": "approximate"}))
        assert report.replays == 2 and report.residual_pairs > 0


def test_miss_tolerance_keeps_the_result_but_still_fetches(harness, checkpoints, monkeypatch):
    from tierstore.vllm_adapter.residency import current_cache
    from tierstore.vllm_adapter.settings import AdapterSettings
    from tierstore.vllm_adapter.step_replay import run_step

    x, _, weights, ids = routing(harness, tokens=1, seed=8)
    graph_mode(monkeypatch, E)
    with harness.cpu_vllm():
        (layer,) = [built_layer(harness, checkpoints["bf16"])[1]]
        cache = current_cache()
        out, report = run_step(lambda: apply(layer, x, weights, ids), cache,
                               AdapterSettings.from_environ({"TIERSTORE_BASE_MISS_TOL": "2"}))
    assert report.replays == 0 and report.fetched == 2
    assert torch.equal(out, torch.zeros_like(out))
    assert (layer.quant_method.slots.table[0, ids[0].long()] >= 0).all()
