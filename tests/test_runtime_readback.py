"""The decoder's readback folded into the pass-log read, the replay benchmark's readback variants,
its per-step breakdown, the warm-arena option and the interleaved no-miss overhead (CPU device)."""

import numpy as np
import pytest
import torch
from test_runtime_fixtures import memory_source, toy_geometry
from test_runtime_replay import skewed_routing

from tierstore.runtime import RuntimeConfig, TieredRuntime
from tierstore.runtime.passlog import PassLog
from tierstore.runtime.replay import run_replay, trace_steps
from tierstore.runtime.replay_drive import NOMISS_VARIANTS, UNREAD_VARIANTS

try:
    from test_runtime_hf import checkpoints  # noqa: F401 (the fixture, for the generation test)
except pytest.skip.Exception:  # no transformers: only the generation test needs it
    pass


def test_published_values_come_back_with_the_pass_log_read():
    log = PassLog(2, 4, top_k=2, capacity=3, device="cpu", output_words=3)
    log.reset()
    log.record(1, torch.tensor([[0, 3]]))
    log.publish(torch.tensor([7, 1], dtype=torch.int64))
    report = log.read()
    assert report.outputs.tolist()[:2] == [7, 1] and report.outputs.dtype == np.int32
    assert report.routed_ids.tolist() == [4, 7] and report.missing_pairs == 0
    log.publish(torch.tensor([5]))
    again = log.read()
    assert again.outputs[0] == 5 and report.outputs[0] == 7  # a report keeps its own copy
    with pytest.raises(ValueError, match="do not fit 3 output words"):
        log.publish(torch.arange(4))
    assert PassLog(2, 4, top_k=2, capacity=3, device="cpu").read().outputs is None
    with pytest.raises(ValueError, match="output_words"):
        PassLog(2, 4, top_k=2, capacity=3, device="cpu").publish(torch.tensor([1]))


def test_a_step_returns_the_token_of_its_last_pass_after_a_replay():
    g = toy_geometry()
    runtime = TieredRuntime(g, memory_source(g), pool_slots=12, device="cpu",
                            config=RuntimeConfig(kpi_every=0), output_words=1)
    ids = torch.tensor([[[0, 1], [2, 3], [4, 5]]])  # [T=1, L, k]: nothing resident, the first pass misses
    h = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(0))
    w = torch.full((1, g.top_k), 0.5)
    tokens_seen = []

    def forward():
        x = h
        for layer in range(g.num_moe_layers):
            x = x + runtime.moe(layer, x, ids[:, layer], w)
        token = x.argmax(-1)
        tokens_seen.append(int(token[0]))
        runtime.publish(token)
        return x

    out, outcome = runtime.step(forward, lambda: None)
    assert outcome.replays >= 1
    assert outcome.last_pass.outputs[0] == tokens_seen[-1] == int(out.argmax(-1)[0])
    runtime.close()


def test_replay_reports_readback_variants_breakdown_and_matching_tokens():
    g = toy_geometry()
    steps = trace_steps(skewed_routing(g, 12), None, g.num_moe_layers, None)
    result = run_replay(g, lambda: memory_source(g), steps, pool_slots=12, arena_slots=16, device="cpu", warmup=4)
    runs = result["runs"]
    assert [runs[k]["readback"] for k in ("resident", "resident_readback", "tiered", "naive")] == \
        ["none", "separate", "folded", "separate"]
    assert runs["resident"]["tokens"] == [None] * 12
    assert result["tokens_match_resident"] and runs["naive"]["tokens"] == runs["resident_readback"]["tokens"]
    assert result["floor_readback_step_ms"] >= result["floor_fetch_ms"]
    assert result["naive_over_floor"] == pytest.approx(runs["naive"]["steady"]["step_ms"] / result["floor_step_ms"])
    cold = runs["tiered"]["cold"]
    per = cold["per_step"]
    assert len(per["ms"]) == 4 and sum(per["replays"]) >= cold["replayed_steps"] > 0
    assert sum(per["arena_miss_rows"]) * memory_source(g).row_bytes == cold["arena_miss_bytes"]
    assert cold["breakdown"]["disk_steps"] == sum(1 for m in per["arena_miss_rows"] if m)
    assert "nomiss_overhead" not in result  # only when the pool holds every expert


def test_a_preloaded_arena_leaves_no_pack_reads_in_the_timed_steps():
    g = toy_geometry()
    steps = trace_steps(skewed_routing(g, 8), None, g.num_moe_layers, None)
    result = run_replay(g, lambda: memory_source(g), steps, pool_slots=12, arena_slots=48, device="cpu", warmup=2,
                        arena_preload=True)
    for run in ("tiered", "naive"):
        assert result["runs"][run]["arena_preloaded_rows"] == 48
        for window in ("cold", "steady"):
            assert result["runs"][run][window]["arena_miss_bytes"] == 0
    assert result["runs"]["tiered"]["cold"]["arena_hit_bytes"] > 0


def test_full_pool_reports_the_interleaved_no_miss_overhead():
    g = toy_geometry()
    steps = trace_steps(skewed_routing(g, 10), None, g.num_moe_layers, None)
    result = run_replay(g, lambda: memory_source(g), steps, pool_slots=48, arena_slots=0, device="cpu", warmup=2)
    overhead = result["nomiss_overhead"]
    assert set(overhead["variants"]) == set(NOMISS_VARIANTS + UNREAD_VARIANTS) and overhead["steps"] == 8
    assert overhead["variants"]["plain"]["minus_plain_us"] == 0.0
    assert all(v["mean_ms"] > 0 for v in overhead["variants"].values())


def test_the_pool_policy_hears_of_a_step_at_the_next_read_in_the_same_order():
    """`step` defers the pool's policy update to the next pass's read (or a fetch, stats, settle):
    the policy sees the same calls in the same order as when it is settled after every step."""
    g = toy_geometry()
    routing = skewed_routing(g, 40, seed=3)
    h = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(0))
    w = torch.full((1, g.top_k), 0.5)
    orders, outputs = [], []
    for eager in (False, True):
        runtime = TieredRuntime(g, memory_source(g), pool_slots=8, device="cpu",
                                config=RuntimeConfig(kpi_every=0, force_pool=True, policy="lru"))  # hook order
        order, outs = [], []
        for step in routing:
            ids = torch.as_tensor(step[None], dtype=torch.int64)  # [1, L, k]

            def forward(ids=ids):
                x = h
                for layer in range(g.num_moe_layers):
                    x = x + runtime.moe(layer, x, ids[:, layer], w)
                return x

            out, _ = runtime.step(forward, lambda: None)
            outs.append(out)
            if eager:
                runtime.settle()
            else:
                assert runtime._untouched is not None  # deferred until something needs the policy
            order.append(list(runtime.pool.policy.eviction_order()) if eager else None)
        runtime.settle()
        order[-1] = list(runtime.pool.policy.eviction_order())
        orders.append(order[-1])
        outputs.append(outs)
        assert runtime.stats().steps == 40
        runtime.pool.check_coherent()
        runtime.close()
    assert orders[0] == orders[1]
    assert all(torch.equal(a, b) for a, b in zip(*outputs))


def test_generation_reads_the_next_token_from_the_pass_log_with_the_same_result(checkpoints):
    """A runtime with output_words folds the decoder's argmax into the step's read: same tokens and
    bit-identical logits as the separate `int(logits.argmax())` path, at a 25% pool with replays."""
    pytest.importorskip("transformers")
    from test_runtime_hf import PROMPT

    from tierstore.checkpoint import open_checkpoint
    from tierstore.runtime.generation import TieredGenerator
    from tierstore.runtime.hf import install_tiered_experts, load_model
    from tierstore.runtime.packs import open_base_rows

    ckpt, packs = checkpoints("qwen3_moe")
    with open_checkpoint(ckpt) as c:
        geometry = c.geometry
    outs = []
    for words in (0, 1):
        runtime = TieredRuntime(geometry, open_base_rows(ckpt, packs), pool_slots=round(0.25 * geometry.total_routed_experts),
                                arena_slots=16, config=RuntimeConfig(kpi_every=0, force_pool=True), output_words=words)
        model = load_model(ckpt, torch.float32)
        install_tiered_experts(model, runtime)
        with runtime:
            generator = TieredGenerator(model, runtime, max_length=len(PROMPT) + 13)
            assert generator._fold == bool(words)
            outs.append((generator.generate(PROMPT, 12, keep_logits=True), runtime.stats().replayed_steps))
    (separate, replayed), (folded, _) = outs
    assert replayed > 0
    assert folded.new_ids == separate.new_ids
    assert all(torch.equal(a, b) for a, b in zip(folded.step_logits, separate.step_logits))


def test_replay_runs_every_variant_at_the_requested_activation_dtype(monkeypatch):
    import tierstore.runtime.replay as replay_module

    seen = []
    real_drive, real_overhead = replay_module.drive, replay_module.nomiss_overhead
    monkeypatch.setattr(replay_module, "drive", lambda *a, **kw: seen.append(kw["dtype"]) or real_drive(*a, **kw))
    monkeypatch.setattr(replay_module, "nomiss_overhead",
                        lambda *a, **kw: seen.append(kw["dtype"]) or real_overhead(*a, **kw))
    g = toy_geometry()
    steps = trace_steps(skewed_routing(g, 6), None, g.num_moe_layers, None)
    everything = g.total_routed_experts
    result = run_replay(g, lambda: memory_source(g), steps, pool_slots=everything, arena_slots=0, device="cpu",
                        warmup=2, dtype=torch.float16)
    assert result["dtype"] == "float16" and result["tokens_match_resident"]
    assert seen == [torch.float16] * 5  # resident, resident_readback, tiered, naive, the no-miss variants
