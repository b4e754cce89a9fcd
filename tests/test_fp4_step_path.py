"""What a step under the precision tier does beyond a W2 step: an armed gate that does not fire
makes no readback or host sync of its own (its signal rides ahead of the pass log's read), the
safe point does not wait for the manager's bookkeeping (only for installs), and a paused manager
holds the FP4 residency still without losing windows."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from fp4_fixtures import assert_fp4_coherent, decode_inputs, tier_rows, tiered
from test_runtime_fixtures import ToyMoE, toy_geometry

import tierstore.runtime.gate as gate_module
from tierstore.runtime.gate import ConfidenceGate

GEOMETRY = toy_geometry(layers=3, experts=16, top_k=2)
ROWS = tier_rows(GEOMETRY)
ALL = GEOMETRY.total_routed_experts


def counting_reads(runtime) -> list[int]:
    calls = [0]
    read = runtime.log.read

    def counted():
        calls[0] += 1
        return read()
    runtime.log.read = counted
    return calls


def test_an_armed_silent_step_reads_back_once_and_never_syncs_for_the_gate(monkeypatch):
    model, xs = ToyMoE(GEOMETRY), decode_inputs(GEOMETRY, 6)
    with tiered(GEOMETRY, ROWS, pool_slots=ALL, fp4_slots=8, gate=True, gate_tau=-1.0, fp4_policy="freq",
                force_fp4_pool=True) as runtime:
        runtime.preload()  # no base misses: one pass per step
        reads = counting_reads(runtime)

        def no_host_sync(*_):
            raise AssertionError("the armed-silent step synchronised for the gate")
        monkeypatch.setattr(gate_module, "aggregate", no_host_sync)
        monkeypatch.setattr(ConfidenceGate, "decide", no_host_sync)
        for x in xs:
            out, outcome = runtime.step(lambda x=x: model.forward(runtime, x), lambda: None)
            assert outcome.gate is None and outcome.replays == 0
        assert reads[0] == len(xs)  # the pass log's read, nothing else
        assert runtime.gate_stats().steps == len(xs) and runtime.gate_stats().fired == 0
        monkeypatch.undo()
        # the host copy is the same float the host-side path computes from the last logits
        assert float(runtime._gate_signal[0]) == runtime.gate.decide(out).signal
        assert_fp4_coherent(runtime, ROWS[1])


def test_the_safe_point_does_not_wait_for_the_managers_bookkeeping():
    model, xs = ToyMoE(GEOMETRY), decode_inputs(GEOMETRY, 4, seed=5)
    with tiered(GEOMETRY, ROWS, pool_slots=ALL, fp4_slots=8, fp4_policy="freq", fp4_promote=4) as runtime:
        runtime.preload()
        tier = runtime.fp4
        observe, entered, release = tier.observe_window, threading.Event(), threading.Event()

        def slow_observe(counts):
            with tier.state_lock:  # the manager mid-bookkeeping, holding the host state
                entered.set()
                assert release.wait(10)
                return observe(counts)
        tier.observe_window = slow_observe
        runtime.step(lambda: model.forward(runtime, xs[0]), lambda: None)  # wakes the manager
        assert entered.wait(10)
        done = threading.Event()

        def steps():
            for x in xs[1:]:
                runtime.step(lambda x=x: model.forward(runtime, x), lambda: None)
            done.set()
        runner = threading.Thread(target=steps)
        runner.start()
        finished = done.wait(5)
        release.set()
        runner.join(10)
        assert finished, "a step waited for the manager's bookkeeping (nothing was being installed)"
        assert runtime.wait_fp4_manager(10)
        stats = runtime.fp4_stats()
        assert stats.routed_pairs == len(xs) * GEOMETRY.num_moe_layers * GEOMETRY.top_k  # no window lost
        assert tier.tick == len(xs)  # every close applied
        assert_fp4_coherent(runtime, ROWS[1])


def test_a_paused_manager_holds_residency_and_loses_no_window():
    steps = 5
    model, xs = ToyMoE(GEOMETRY), decode_inputs(GEOMETRY, steps, seed=6)
    with tiered(GEOMETRY, ROWS, pool_slots=ALL, fp4_slots=10, fp4_policy="freq", fp4_promote=4) as runtime:
        runtime.preload()
        runtime.preload_fp4([(0, 0), (1, 1)])
        assert runtime.pause_fp4_manager(10)
        for x in xs:
            runtime.step(lambda x=x: model.forward(runtime, x), lambda: None)
        assert runtime.wait_fp4_manager(10)  # returns while paused
        stats = runtime.fp4_stats()
        assert stats.mapped == 2 and stats.promoted_lazy == 0 and stats.routed_pairs == 0
        runtime.resume_fp4_manager()
        assert runtime.wait_fp4_manager(10)
        stats = runtime.fp4_stats()
    assert stats.routed_pairs == steps * GEOMETRY.num_moe_layers * GEOMETRY.top_k  # the merged windows arrived
    assert stats.promoted_lazy > 0


def test_the_manager_gets_each_steps_last_pass_counts_from_the_read_and_a_paused_one_is_not_woken():
    model, xs = ToyMoE(GEOMETRY), decode_inputs(GEOMETRY, 6, seed=7)
    with tiered(GEOMETRY, ROWS, pool_slots=4 * GEOMETRY.top_k * GEOMETRY.num_moe_layers, fp4_slots=8,
                fp4_policy="freq", force_pool=True) as runtime:  # small base pool: steps miss and replay
        assert runtime.pause_fp4_manager(10)
        manager = runtime._fp4_manager
        deliver, delivered = manager._wake.set, []
        manager._wake.set = lambda: delivered.append(1)
        want, replays = np.zeros((GEOMETRY.num_moe_layers, GEOMETRY.num_experts), np.int64), 0
        for x in xs:
            _, outcome = runtime.step(lambda x=x: model.forward(runtime, x), lambda: None)
            replays += outcome.replays
            want += runtime.log.seen.numpy()  # the device counts of the step's last pass
        manager._wake.set = deliver
        assert delivered == []  # paused: no step's wake was delivered
        assert replays > 0  # earlier passes were not pushed
        assert np.array_equal(runtime._fp4_snapshot.take(), want)


# freq-dense's counts decay by wall-clock time, so two runs order keys alike only where nothing decays (a half-life
# so long that every decay factor is exactly 1.0); lru's order is the hooks' order alone
@pytest.mark.parametrize("policy", [dict(policy="lru"), dict(policy="freq-dense", policy_half_life_s=1e30)])
def test_with_an_fp4_tier_the_base_pool_policy_still_hears_of_a_step_at_the_next_read_in_the_same_order(policy):
    model, xs = ToyMoE(GEOMETRY), decode_inputs(GEOMETRY, 20, seed=8)
    orders, outputs = [], []
    for eager in (False, True):
        with tiered(GEOMETRY, ROWS, pool_slots=3 * GEOMETRY.top_k * GEOMETRY.num_moe_layers, fp4_slots=6,
                    fp4_policy="freq", force_pool=True, **policy) as runtime:  # base misses: fetches evict
            runtime.preload_fp4([(0, 1), (1, 2), (2, 3)])
            assert runtime.pause_fp4_manager(10)  # the same FP4 residency in both runs
            outs = []
            for x in xs:
                out, _ = runtime.step(lambda x=x: model.forward(runtime, x), lambda: None)
                outs.append(out)
                if eager:
                    runtime.settle()
                else:
                    assert runtime._untouched is not None  # deferred until something needs the policy
            runtime.settle()
            orders.append(list(runtime.pool.policy.eviction_order()))
            outputs.append(outs)
            runtime.pool.check_coherent()
            assert runtime.stats().replayed_steps > 0
    assert orders[0] == orders[1]
    assert all(torch.equal(a, b) for a, b in zip(*outputs))


def test_all_fp4_tells_whether_the_last_pass_routed_only_fp4_resident_experts():
    model, x = ToyMoE(GEOMETRY), decode_inputs(GEOMETRY, 1, seed=8)[0]
    with tiered(GEOMETRY, ROWS, pool_slots=ALL, fp4_slots=ALL, fp4_policy="freq") as runtime:
        runtime.preload()
        assert runtime.pause_fp4_manager(10)
        _, outcome = runtime.step(lambda: model.forward(runtime, x), lambda: None)
        assert outcome.all_fp4 is False  # nothing FP4 yet
        first_layer = {key for key in outcome.last_pass.routed_keys if key[0] == 0}  # routed from x alone
        everything = [divmod(i, GEOMETRY.num_experts) for i in range(ALL)]
        runtime.preload_fp4([key for key in everything if key not in first_layer])
        _, outcome = runtime.step(lambda: model.forward(runtime, x), lambda: None)
        assert first_layer <= set(outcome.last_pass.routed_keys) and outcome.all_fp4 is False
        runtime.preload_fp4(sorted(first_layer))
        _, outcome = runtime.step(lambda: model.forward(runtime, x), lambda: None)
        assert outcome.all_fp4 is True
        runtime.resume_fp4_manager()


def test_with_all_fp4_equals_dataclasses_replace():
    from dataclasses import fields, replace

    from tierstore.runtime.step import StepOutcome

    outcome = StepOutcome(*(object() for _ in fields(StepOutcome)))  # a distinct value in every field
    assert outcome.with_all_fp4(True) == replace(outcome, all_fp4=True)
