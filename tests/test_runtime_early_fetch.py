"""Config `early_fetch`: while a pass runs, the host reads each finished MoE layer's routing from the
pass log's pinned per-layer copies and fetches what those layers miss, evicting only experts of
finished layers that the pass did not route. On the CPU the pass has finished when the host looks,
so every layer is read at once; the same bookkeeping runs, and every step must still equal the
all-resident run bit for bit. The GPU tests hold every row copy back behind a device sleep, so the
replay must wait for rows fetched during the pass, eager and inside a CUDA graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from fp4_fixtures import decode_inputs, tier_rows, tiered
from test_runtime_core import make_runtime, resident_run, tokens
from test_runtime_fixtures import ToyMoE, memory_source, toy_geometry
from test_runtime_layer_waits import _hold_rows, _resident_outputs, _steps

from tierstore.errors import ConfigError
from tierstore.runtime import RuntimeConfig, TieredRuntime
from tierstore.runtime.passlog import PassLog
from tierstore.runtime.replay import preload_arena

STEPS = 40


def test_early_fetch_is_a_config_knob_off_by_default():
    assert RuntimeConfig().early_fetch is False
    assert RuntimeConfig.from_env({"TIERSTORE_EARLY_FETCH": "1"}).early_fetch is True


def test_pass_log_layer_rows_appear_only_after_publish_and_clear_hides_them():
    log = PassLog(3, 8, 2, capacity=24, device="cpu", early_layers=True)
    log.reset()
    log.record(1, torch.tensor([[3, 5], [5, 7]]))  # [T, k]
    log.clear_layers()
    assert log.layer_seen(1) is None
    log.publish_layer(1)
    assert log.layer_seen(1).tolist() == [0, 0, 0, 1, 0, 2, 0, 1]
    assert log.layer_seen(0) is None and log.layer_seen(2) is None
    log.clear_layers()
    assert log.layer_seen(1) is None


@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_steps_with_early_fetch_are_bit_identical_to_all_resident(fraction):
    g = toy_geometry()
    model = ToyMoE(g)
    expected = resident_run(g, model, STEPS)
    with make_runtime(g, fraction, early_fetch=True) as runtime:
        for step, want in enumerate(expected):
            got, outcome = runtime.step(lambda x=tokens(g, step): model.forward(runtime, x), lambda: None)
            assert torch.equal(got, want), f"step {step} differs after {outcome.replays} replays"
            runtime.pool.check_coherent()
        stats, kpi = runtime.stats(), runtime.kpi_line()
    assert 0 < stats.early_fetched_rows <= stats.fetched_rows
    assert f"{stats.early_fetched_rows} rows fetched during their pass" in kpi


def test_fetches_during_a_pass_evict_only_finished_layers_experts_it_did_not_route():
    """Every install made during a pass: its victims lie in the layers the pass has finished and
    none of them was routed there by the pass; its copies do not wait for the pass."""
    g = toy_geometry()
    model = ToyMoE(g)
    installs = []
    with make_runtime(g, 0.5, early_fetch=True) as runtime:
        fetch, install = runtime._fetch, runtime.pool.install

        def recording_fetch(keys, protect_ids, scan=False, partial=False, finished_layers=None, after_read=False):
            installs.append({"finished": finished_layers, "protect": set(protect_ids), "after_read": after_read})
            return fetch(keys, protect_ids, scan, partial, finished_layers, after_read)

        def recording_install(keys, rows, exclude, victims=None, after_compute=True, **options):
            installs[-1].update(victims=list(victims or []), after_compute=after_compute)
            install(keys, rows, exclude, victims, after_compute, **options)

        runtime._fetch, runtime.pool.install = recording_fetch, recording_install
        for step in range(STEPS):
            runtime.step(lambda x=tokens(g, step): model.forward(runtime, x), lambda: None)
    early = [i for i in installs if i["finished"] is not None and "victims" in i]
    assert early and any(i["victims"] for i in early), "no install during a pass evicted anything: nothing checked"
    for i in early:
        assert all(v < i["finished"] * g.num_experts for v in i["victims"]), "evicted an unfinished layer's expert"
        assert not set(i["victims"]) & i["protect"], "evicted an expert the running pass routed"
        assert i["after_compute"] is False
    # the fetch after a pass-log read (none may be left here: the pass fetched it all) skips the wait as well
    assert all(i["after_read"] and i["after_compute"] is False
               for i in installs if i["finished"] is None and "victims" in i)


def test_early_fetch_leaves_prefill_and_a_full_pool_alone():
    g = toy_geometry()
    model = ToyMoE(g)
    want = resident_run(g, model, 1, count=6)[0]
    with make_runtime(g, 0.25, early_fetch=True) as runtime:
        got, _ = runtime.step(lambda: model.forward(runtime, tokens(g, 0, 6)), lambda: None, prefill=True)
        assert torch.equal(got, want) and runtime.stats().early_fetched_rows == 0
    with make_runtime(g, 1.0, early_fetch=True) as runtime:  # nothing can miss: no per-layer copies in the pass
        assert runtime.log._layer_rows is None


@pytest.mark.gpu
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("arena", ["small", "whole"])
def test_rows_fetched_during_the_pass_and_held_back_are_waited_for(graph, arena):
    """`whole`: every fetch is an arena hit, so the fetch after the pass-log read does not wait for the
    held-back copies of the fetches during the pass (two installs in flight); `small`: it does."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = toy_geometry(hidden=128, inter=64)
    model = ToyMoE(g)
    model.routers = model.routers.cuda()
    want = _resident_outputs(g, model)
    config = RuntimeConfig(kpi_every=0, early_fetch=True)
    arena_slots = 16 if arena == "small" else g.total_routed_experts
    with TieredRuntime(g, memory_source(g, 0), pool_slots=round(0.25 * g.total_routed_experts),
                       arena_slots=arena_slots, device="cuda", backend="triton", config=config) as small:
        if arena == "whole":
            preload_arena(small)
        _hold_rows(small.pool)
        in_flight = []  # installs with copies in flight right after each install (either kind)
        for name in ("install", "install_located"):
            def counted(*args, _install=getattr(small.pool, name), **kwargs):
                _install(*args, **kwargs)
                in_flight.append(len(small.pool._in_flight))
            setattr(small.pool, name, counted)
        got = _steps(small, model, g, graph)
        stats = small.stats()
        small.pool.check_coherent()
    assert stats.early_fetched_rows > 0
    if arena == "whole":
        assert max(in_flight) == 2
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {step} differs from the all-resident run"


@pytest.mark.gpu
def test_early_fetch_without_layer_waits_is_refused():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = toy_geometry()
    with pytest.raises(ConfigError, match="early_fetch needs layer_waits"):
        TieredRuntime(g, memory_source(g), pool_slots=g.total_routed_experts // 2, device="cuda",
                      config=RuntimeConfig(kpi_every=0, early_fetch=True, layer_waits=False))


def test_layer_rows_match_the_pass_logs_seen_counts_after_a_pass():
    g = toy_geometry()
    model = ToyMoE(g)
    with make_runtime(g, 0.5, early_fetch=True) as runtime:
        runtime.step(lambda: model.forward(runtime, tokens(g, 3)), lambda: None)
        for layer in range(g.num_moe_layers):
            assert np.array_equal(runtime.log.layer_seen(layer), runtime.log.host_seen()[layer])


def test_experts_resident_at_fp4_are_not_fetched_during_the_pass():
    """An FP4-resident pair does not miss: fetches during a pass leave those experts alone, and the
    steps equal the same run without early fetch bit for bit."""
    g = toy_geometry()
    rows, model, xs = tier_rows(g), ToyMoE(g), decode_inputs(g, 24)
    fp4_keys = [(layer, expert) for layer in range(g.num_moe_layers) for expert in range(0, g.num_experts, 2)]

    def run(early: bool):
        fetched = []
        with tiered(g, rows, pool_slots=g.total_routed_experts // 2, fp4_slots=len(fp4_keys), fp4_policy="need",
                    early_fetch=early) as runtime:
            runtime.preload_fp4(fp4_keys)
            fetch = runtime.fetch

            def recording_fetch(keys, protect, scan=False, partial=False, finished_layers=None):
                if finished_layers is not None:
                    fetched.extend(keys)
                return fetch(keys, protect, scan, partial, finished_layers)

            runtime.fetch = recording_fetch
            outs = [runtime.step(lambda x=x: model.forward(runtime, x), lambda: None)[0] for x in xs]
        return outs, fetched

    plain, _ = run(False)
    early, fetched = run(True)
    assert fetched and not set(fetched) & set(fp4_keys)
    for step, (a, b) in enumerate(zip(early, plain)):
        assert torch.equal(a, b), f"step {step} differs from the run without early fetch"


def test_a_read_error_during_the_pass_fails_the_step_closed_and_the_next_steps_are_exact():
    g = toy_geometry()
    model = ToyMoE(g)
    expected = resident_run(g, model, 12)
    with make_runtime(g, 0.25, early_fetch=True) as runtime:
        fetch, read, failures = runtime.fetch, runtime.arena.fetch, []

        def failing_read(keys, scan=False, before_read=None):
            failures.append(list(keys))
            raise OSError(5, "Input/output error (injected)")

        def fetch_failing_once_during_a_pass(keys, protect, scan=False, partial=False, finished_layers=None):
            runtime.arena.fetch = failing_read if finished_layers is not None and not failures else read
            return fetch(keys, protect, scan, partial, finished_layers)

        runtime.fetch = fetch_failing_once_during_a_pass
        for step, want in enumerate(expected):
            try:
                got, _ = runtime.step(lambda x=tokens(g, step): model.forward(runtime, x), lambda: None)
            except OSError:
                runtime.pool.check_coherent()
                got, _ = runtime.step(lambda x=tokens(g, step): model.forward(runtime, x), lambda: None)
            assert torch.equal(got, want), f"step {step} differs"
        assert failures and runtime.stats().failed_steps == 1
