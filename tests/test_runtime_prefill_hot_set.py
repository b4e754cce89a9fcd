"""Issue #5 §1: prefill (scan) fetches each layer's routed set before the layer and never evicts
the decode hot set (the experts the last decode step routed), as long as the pool has room for a
layer outside it; when it has not, the prefill still runs and the hot experts it evicted are
counted. Outputs stay bit-identical to the all-resident run either way."""

import pytest
import torch
from test_runtime_core import make_runtime, resident_run, tokens
from test_runtime_fixtures import ToyMoE, toy_geometry

DECODE_STEPS = 12
PROMPT_TOKENS = 40  # routes (nearly) every expert of every layer: a scan that could flush the pool


def run_decode_then_prefill(pool_fraction: float):
    """Decode steps, then one long prefill step; returns (hot keys, resident keys after the
    prefill, the prefill's output, its outcome, stats, KPI line)."""
    g = toy_geometry()
    model = ToyMoE(g)
    with make_runtime(g, pool_fraction) as runtime:
        for step in range(DECODE_STEPS):
            runtime.step(lambda x=tokens(g, step): model.forward(runtime, x), lambda: None)
        hot = set(runtime.last_pass.routed_keys)
        got, outcome = runtime.step(lambda: model.forward(runtime, tokens(g, 99, PROMPT_TOKENS)), lambda: None,
                                    prefill=True)
        resident = set(runtime.pool.resident_keys())
        runtime.pool.check_coherent()
        stats, kpi = runtime.stats(), runtime.kpi_line()
    return hot, resident, got, outcome, stats, kpi


def prefill_reference():
    g = toy_geometry()
    model = ToyMoE(g)
    with make_runtime(g) as runtime:
        runtime.preload()
        return runtime.step(lambda: model.forward(runtime, tokens(g, 99, PROMPT_TOKENS)), lambda: None)[0]


def test_prefill_keeps_the_decode_hot_set_resident():
    """Pool of 24 of 48 experts: a layer's 16 fit beside the 6 hot ones, so none of those goes."""
    hot, resident, got, outcome, stats, kpi = run_decode_then_prefill(0.5)
    assert len(hot) == 6  # 3 layers x top-2, one token
    assert hot <= resident, f"prefill evicted decode-hot experts {sorted(hot - resident)}"
    assert stats.prefill_hot_evictions == 0 and "decode-hot" not in kpi
    assert outcome.first_pass_missing_pairs == 0 and outcome.replays == 0
    assert torch.equal(got, prefill_reference())


def test_without_the_hot_set_rule_the_same_prefill_flushes_it(monkeypatch):
    """Negative control: victims from the plain policy order (the rule off) evict hot experts in
    this very run, so the test above can fail."""
    from tierstore.runtime.engine import TieredRuntime

    monkeypatch.setattr(TieredRuntime, "_victims", lambda self, protect_ids, lacking, scan, below=None:
                        self.pool.evictable_ids(protect_ids, lacking, below))
    hot, resident, *_ = run_decode_then_prefill(0.5)
    assert not hot <= resident


def test_a_pool_without_room_beside_the_hot_set_still_prefills_and_counts_what_it_evicted():
    """Pool of 18 slots: a layer's 16 do not fit beside the 6 hot experts; the layer must run, so
    hot experts go (a later layer may fetch some back), counted in stats and the KPI line; the output is still exact."""
    hot, resident, got, outcome, stats, kpi = run_decode_then_prefill(18 / 48)
    assert stats.prefill_hot_evictions >= len(hot - resident) > 0
    assert f"prefill evicted {stats.prefill_hot_evictions} decode-hot experts" in kpi
    assert outcome.first_pass_missing_pairs == 0
    assert torch.equal(got, prefill_reference())


@pytest.mark.parametrize("fraction", [0.5, 0.75])
def test_decode_after_a_prefill_stays_bit_identical(fraction):
    """Decode, prefill, decode again: every decode step equals the all-resident run."""
    g = toy_geometry()
    model = ToyMoE(g)
    want = resident_run(g, model, 2 * DECODE_STEPS)
    with make_runtime(g, fraction) as runtime:
        for step in range(2 * DECODE_STEPS):
            if step == DECODE_STEPS:
                runtime.step(lambda: model.forward(runtime, tokens(g, 99, PROMPT_TOKENS)), lambda: None, prefill=True)
            got, _ = runtime.step(lambda x=tokens(g, step): model.forward(runtime, x), lambda: None)
            assert torch.equal(got, want[step]), f"decode step {step} differs"
        runtime.pool.check_coherent()


def test_prefill_layer_routing_more_experts_than_the_pool_runs_in_token_chunks(monkeypatch):
    """A pool of 8 of 48 slots passes the start-up check (3 layers x top-2 x 1.15 = 6.9) but a 40-token prefill
    routes ~16 experts per layer: each such layer runs in token chunks whose routed experts fit (fetch, compute,
    next chunk), with no missing pair, within rounding of the all-resident prefill (a chunk's GEMMs run over fewer
    tokens, so not bit for bit). Negative control: one chunk for the whole layer raises CapacityError, as every
    such prefill did before."""
    from tierstore.errors import CapacityError
    from tierstore.runtime import engine

    g = toy_geometry()
    model = ToyMoE(g)
    prompt = tokens(g, 99, PROMPT_TOKENS)
    with make_runtime(g, 8 / g.total_routed_experts) as runtime:
        got, outcome = runtime.step(lambda: model.forward(runtime, prompt), lambda: None, prefill=True)
        runtime.pool.check_coherent()
        assert runtime.pool.num_slots == 8 and outcome.first_pass_missing_pairs == 0 and outcome.replays == 0
        assert runtime.stats().fetched_rows > 8  # chunks refetched into the same 8 slots
    # float32 GEMMs over different token counts round differently by CPU kernel (AVX2 / AVX-512): 3e-5 relative seen
    torch.testing.assert_close(got, prefill_reference(), rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(engine, "token_chunks", lambda ids, slots: [(0, len(ids))])
    with make_runtime(g, 8 / g.total_routed_experts) as runtime, pytest.raises(CapacityError, match="cannot hold"):
        runtime.step(lambda: model.forward(runtime, prompt), lambda: None, prefill=True)


def test_token_chunks_cover_the_batch_in_order_within_the_cache():
    from tierstore.runtime.token_chunks import token_chunks

    ids = [[0, 1], [1, 2], [3, 4], [0, 5], [6, 7], [6, 7]]
    assert token_chunks(ids, 8) == [(0, 6)]  # everything fits: one chunk
    chunks = token_chunks(ids, 4)
    assert chunks == [(0, 2), (2, 4), (4, 6)]
    for start, stop in chunks:
        assert len({e for row in ids[start:stop] for e in row}) <= 4
    assert token_chunks([[0, 1, 2]], 2) == [(0, 1)]  # one token above the cache: alone (the fetch refuses it)
