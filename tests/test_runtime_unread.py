"""A pool that holds every expert, once all are installed, reads no decode pass (config full_pool_reads off): the
step launches its forward and returns, with results equal bit for bit to the step that reads; wherever the read
brings something back, or the pool can still miss, the step reads as before."""

import logging

import numpy as np
import pytest
import torch
from test_runtime_fixtures import ToyMoE, graph_replayer, memory_source, toy_geometry

from tierstore.runtime import RuntimeConfig, TieredRuntime
from tierstore.runtime.engine import COUNTERS, UNREAD_OUTCOME
from tierstore.runtime.passlog import UNREAD_PASS
from tierstore.runtime.replay import run_replay, trace_steps
from tierstore.runtime.replay_drive import NOMISS_VARIANTS, UNREAD_VARIANTS, drive
from test_runtime_replay import skewed_routing


def full_runtime(g, device="cpu", preload=True, **config) -> TieredRuntime:
    rt = TieredRuntime(g, memory_source(g, seed=3), pool_slots=g.total_routed_experts, device=device,
                       config=RuntimeConfig(kpi_every=0, **config))
    if preload:
        rt.preload()
    return rt


def decode(rt: TieredRuntime, model: ToyMoE, steps: int, device="cpu", seed: int = 0):
    """(outputs, outcomes) of `steps` single-token decode steps on seeded inputs."""
    g = rt.geometry
    outs, outcomes = [], []
    for step in range(steps):
        x = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(seed + step)).to(device) * 3  # [1, H]
        out, outcome = rt.step(lambda x=x: model.forward(rt, x), lambda: None)
        outs.append(out.clone())
        outcomes.append(outcome)
    return outs, outcomes


def test_a_complete_full_pool_reads_no_pass_and_returns_the_read_steps_results():
    g = toy_geometry()
    model = ToyMoE(g)
    with full_runtime(g) as unread, full_runtime(g, full_pool_reads=True) as reads:
        got, got_outcomes = decode(unread, model, 12)
        want, want_outcomes = decode(reads, model, 12)
        assert all(o is UNREAD_OUTCOME for o in got_outcomes)
        assert all(o.last_pass.read and o.last_pass.missing_pairs == 0 for o in want_outcomes)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        stats = unread.stats()
        assert (stats.steps, stats.unread_steps, stats.replayed_steps, stats.failed_steps) == (12, 12, 0, 0)
        assert reads.stats().unread_steps == 0
        counters = dict(zip(COUNTERS, unread.counters()))
        assert counters["read_s"] == 0 and counters["forward_s"] > 0  # their host time is all forward time
        assert "12 steps not read" in unread.kpi_line() and "no step read" in unread.kpi_line()
        assert "not read" not in reads.kpi_line()
        unread.pool.check_coherent()


def test_an_unread_pass_refuses_to_name_its_routed_experts():
    assert not UNREAD_PASS.read and UNREAD_PASS.missing_pairs == 0 and UNREAD_PASS.missing_ids == ()
    with pytest.raises(RuntimeError, match="was not read.*full_pool_reads"):
        UNREAD_PASS.routed_ids


def test_a_full_pool_reads_until_its_last_expert_is_installed():
    g = toy_geometry(experts=4)  # 12 experts: a few decode steps route them all
    model = ToyMoE(g)
    with full_runtime(g, preload=False) as rt, full_runtime(g, full_pool_reads=True) as reference:
        got, outcomes = decode(rt, model, 40)
        want, _ = decode(reference, model, 40)
        read = [o.last_pass.read for o in outcomes]
        complete = read.index(False)
        assert 0 < complete and not any(read[complete:])  # reads first, none once complete
        assert rt.stats().fetched_rows == g.total_routed_experts == rt.pool.num_mapped
        assert rt.stats().unread_steps == 40 - complete
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        rt.pool.clear()  # nothing resident again: the next step must read, miss and fetch
        x = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(99)) * 3
        out, outcome = rt.step(lambda: model.forward(rt, x), lambda: None)
        assert outcome.last_pass.read and outcome.replays >= 1
        assert torch.equal(out, reference.step(lambda: model.forward(reference, x), lambda: None)[0])


@pytest.mark.parametrize("what", ["output_words", "record_tokens", "pool_can_miss", "prefill"])
def test_steps_read_wherever_the_read_brings_something_back_or_a_miss_is_possible(what):
    g = toy_geometry()
    model = ToyMoE(g)
    slots = g.total_routed_experts - (what == "pool_can_miss")
    kwargs = {what: 1} if what in ("output_words", "record_tokens") else {}
    with TieredRuntime(g, memory_source(g, seed=3), pool_slots=slots, device="cpu",
                       config=RuntimeConfig(kpi_every=0, force_pool=True), **kwargs) as rt:
        rt.preload([(layer, e) for layer in range(g.num_moe_layers) for e in range(g.num_experts)][:slots])
        x = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(5))
        _, outcome = rt.step(lambda: model.forward(rt, x), lambda: None, prefill=what == "prefill")
        assert outcome.last_pass.read and len(outcome.last_pass.routed_ids) > 0
        assert rt.stats().unread_steps == 0


def test_a_failing_unread_step_is_counted_and_raises():
    g = toy_geometry()
    with full_runtime(g) as rt:
        def forward():
            raise ValueError("boom")
        with pytest.raises(ValueError, match="boom"):
            rt.step(forward, lambda: None)
        stats = rt.stats()
        assert (stats.failed_steps, stats.steps) == (1, 0)


def test_unread_steps_log_their_kpi_line(caplog):
    g = toy_geometry()
    model = ToyMoE(g)
    rt = TieredRuntime(g, memory_source(g, seed=3), pool_slots=g.total_routed_experts, device="cpu",
                       config=RuntimeConfig(kpi_every=4))
    with rt, caplog.at_level(logging.INFO, logger="tierstore.runtime"):
        rt.preload()
        decode(rt, model, 8)
    lines = [r.getMessage() for r in caplog.records if "KPI" in r.getMessage()]
    assert len(lines) == 2 and "8 steps not read" in lines[-1]


def test_replay_drives_a_full_pool_unread_with_its_own_token_readback():
    g = toy_geometry()
    steps = trace_steps(skewed_routing(g, 10), None, g.num_moe_layers, None)
    result = run_replay(g, lambda: memory_source(g), steps, pool_slots=g.total_routed_experts, arena_slots=0,
                        device="cpu", warmup=2)
    tiered = result["runs"]["tiered"]
    assert tiered["readback"] == "separate" and result["tokens_match_resident"]
    assert None not in tiered["tokens"]
    variants = result["nomiss_overhead"]["variants"]
    assert set(variants) == set(NOMISS_VARIANTS + UNREAD_VARIANTS)
    checked = run_replay(g, lambda: memory_source(g), steps, pool_slots=g.total_routed_experts, arena_slots=0,
                         device="cpu", warmup=2, config=RuntimeConfig(kpi_every=0, full_pool_reads=True))
    assert checked["runs"]["tiered"]["readback"] == "folded" and checked["tokens_match_resident"]
    assert set(checked["nomiss_overhead"]["variants"]) == set(NOMISS_VARIANTS)


def test_drive_without_readback_times_an_unread_step():
    g = toy_geometry()
    steps = [np.asarray(s) for s in trace_steps(skewed_routing(g, 6), None, g.num_moe_layers, None)]
    with full_runtime(g) as rt:
        out = drive(rt, steps, warmup=2)
        assert out["tokens"] == [None] * 6 and out["steady"].steps == 4
        assert rt.stats().unread_steps == 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_unread_steps_on_cuda_equal_the_read_steps(graph):
    g = toy_geometry(hidden=128, inter=64, experts=8)
    model = ToyMoE(g)
    model.routers = model.routers.cuda()
    runs = []
    for config in ({}, {"full_pool_reads": True}):
        with full_runtime(g, device="cuda", preload=False, **config) as rt:
            x = torch.zeros(1, g.hidden, device="cuda")
            forward = lambda rt=rt, x=x: model.forward(rt, x)  # noqa: E731
            outs, reads = [], []
            for step in range(36):
                x.copy_(torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(step)).cuda() * 3)
                if step == 12:  # what the steps so far did not route: the pool is complete from here on
                    rt.preload()
                    forward = graph_replayer(forward) if graph else forward
                out, outcome = rt.step(forward, lambda: None)
                outs.append(torch.full_like(out, float("nan")).copy_(out))
                reads.append(outcome.last_pass.read)
            torch.cuda.synchronize()
            runs.append((outs, reads, rt.stats().unread_steps))
            rt.pool.check_coherent()
    (got, got_reads, unread), (want, want_reads, none) = runs
    assert none == 0 and all(want_reads) and not any(got_reads[12:]) and unread >= 24
    assert all(torch.equal(a, b) for a, b in zip(got, want))
