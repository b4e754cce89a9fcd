"""Trace replay through the runtime (the engine of `tierstore replay`), on the CPU device."""

import numpy as np
import pytest
from test_runtime_fixtures import memory_source, toy_geometry

from tierstore.runtime.config import RuntimeConfig
from tierstore.runtime.replay import (batch_read_ms, ensure_synthetic_pack, open_synthetic_rows, run_read_gbps,
                                      run_replay, source_read_gbps, source_read_ms_by_batch, trace_steps)


def skewed_routing(geometry, tokens, seed=0):
    rng = np.random.default_rng(seed)
    probs = 1.0 / np.arange(1, geometry.num_experts + 1) ** 1.2
    probs /= probs.sum()
    out = np.empty((tokens, geometry.num_moe_layers, geometry.top_k), np.int32)
    for t in range(tokens):
        for layer in range(geometry.num_moe_layers):
            out[t, layer] = rng.choice(geometry.num_experts, geometry.top_k, replace=False, p=probs)
    return out


def test_trace_steps_groups_tokens_by_step():
    experts = np.arange(5 * 2 * 2).reshape(5, 2, 2)
    steps = trace_steps(experts, np.array([0, 0, 1, 2, 2]), layers=1, limit=None)
    assert [s.shape for s in steps] == [(2, 1, 2), (1, 1, 2), (2, 1, 2)]
    assert len(trace_steps(experts, None, layers=2, limit=3)) == 3
    with pytest.raises(ValueError, match="has 2 layers, the replay needs 3"):
        trace_steps(experts, None, layers=3, limit=None)


def test_replay_reports_cold_and_steady_windows_and_the_floor(tmp_path):
    g = toy_geometry()
    spec = ensure_synthetic_pack(g, tmp_path)
    assert ensure_synthetic_pack(g, tmp_path) == spec  # reused
    steps = trace_steps(skewed_routing(g, 30), None, g.num_moe_layers, None)
    result = run_replay(g, lambda: open_synthetic_rows(spec, tmp_path), steps, pool_slots=12, arena_slots=16,
                        device="cpu", warmup=10)
    runs = result["runs"]
    for run in runs.values():
        assert (run["cold"]["steps"], run["steady"]["steps"]) == (10, 20)
        assert run["steady"]["p50_ms"] <= run["steady"]["p99_ms"]
    assert runs["resident"]["preloaded"] and runs["resident"]["steady"]["fetched_bytes"] == 0
    assert runs["resident"]["steady"]["replay_rate"] == 0.0 and not runs["tiered"]["preloaded"]
    tiered = runs["tiered"]
    assert 0 < tiered["cold"]["replay_rate"] <= 1 and tiered["cold"]["fetched_bytes"] > 0
    assert tiered["cold"]["arena_miss_bytes"] > 0  # the cold arena reads the pack
    steady = tiered["steady"]
    assert steady["arena_hit_bytes"] + steady["arena_miss_bytes"] == steady["fetched_bytes"]
    rows = open_synthetic_rows(spec, tmp_path)
    row_bytes = rows.row_bytes
    rows.close()
    # the located fetch takes arena rows only (steps whose rows all hit the arena; here some do, some do not)
    assert 0 < tiered["steady_located_rows"] * row_bytes <= steady["arena_hit_bytes"]
    assert runs["naive"]["steady"]["replay_rate"] == 0.0 and runs["naive"]["cold"]["fetched_bytes"] > 0
    assert result["floor_step_ms"] >= runs["resident"]["steady"]["step_ms"] > 0
    assert result["source_read_gbps"] > 0 and result["coverage"] == 12 / 48
    # the floor's disk rate is the faster of the probe and the tiered run's own steady reads
    assert result["source_read_run_gbps"] == pytest.approx(run_read_gbps(steady))
    assert result["source_read_gbps"] == max(result["source_read_probe_gbps"], result["source_read_run_gbps"])
    assert result["tiered_over_floor"] == pytest.approx(steady["step_ms"] / result["floor_step_ms"])
    # the batched floor charges each steady step's pack rows at the probe's time for a batch of that many
    by_batch = {int(rows): ms for rows, ms in result["source_read_ms_by_batch"].items()}
    assert sorted(by_batch) == [1, 2, 4] and all(ms > 0 for ms in by_batch.values())  # 48 rows: no 8-row batches
    miss_rows = steady["per_step"]["arena_miss_rows"]
    assert sum(miss_rows) * row_bytes == steady["arena_miss_bytes"] > 0
    pinned_ms = 1e3 * result["floor_pinned_bytes"] / (result["h2d_gbps"] * 1e9)
    expected = runs["resident"]["steady"]["step_ms"] + (pinned_ms + sum(batch_read_ms(r, by_batch) for r in miss_rows)) / 20
    assert result["floor_batched_step_ms"] == pytest.approx(expected)
    assert result["tiered_over_floor_batched"] == pytest.approx(steady["step_ms"] / expected)


class _TimedRows:
    """A row source whose batches take a set time each (seconds, in order), recording the keys each batch asked."""

    def __init__(self, seconds, num_layers=4, num_experts=16, row_bytes=1000):
        self.num_layers, self.num_experts, self.row_bytes, self.stride = num_layers, num_experts, row_bytes, 1024
        self.seconds, self.batches = list(seconds), []

    def read_rows(self, keys, dests):
        import time
        assert len(dests) == len(keys) and all(len(d) == self.stride for d in dests)
        self.batches.append(list(keys))
        time.sleep(self.seconds.pop(0))


def test_the_source_probe_warms_the_reader_then_keeps_its_best_batch_of_distinct_rows():
    source = _TimedRows([0.2, 0.05, 0.01, 0.03, 0.05])  # the first (untimed) batch is the slowest
    gbps = source_read_gbps(source, rows=12, batches=4)
    assert len(source.batches) == 5 and all(len(b) == 12 for b in source.batches)
    keys = [k for b in source.batches for k in b]
    assert len(set(keys)) == len(keys)  # no batch rereads a row
    assert all(0 <= l < 4 and 0 <= e < 16 for l, e in keys)
    assert 12 * 1000 / 0.03 / 1e9 < gbps <= 12 * 1000 / 0.01 / 1e9  # the 10 ms batch, not the warm-up or the mean


def test_the_source_probe_of_a_small_source_reads_one_row_per_batch():
    source = _TimedRows([0.001] * 5, num_layers=1, num_experts=3)
    assert source_read_gbps(source, rows=64, batches=4) > 0
    assert [len(b) for b in source.batches] == [1] * 5


def test_the_batch_probe_times_each_size_in_turns_and_keeps_each_ones_fastest_batch():
    # warm-up (8 rows), then three rounds of 1 / 2 / 4 / 8 rows
    seconds = [0.1] + [0.010, 0.030, 0.015, 0.060] + [0.004, 0.012, 0.040, 0.045] + [0.020, 0.025, 0.050, 0.080]
    source = _TimedRows(seconds, num_layers=4, num_experts=16)
    by_batch = source_read_ms_by_batch(source, sizes=(4, 1, 8, 2, 32), batches=3)
    assert [len(b) for b in source.batches] == [8] + [1, 2, 4, 8] * 3  # 32 rows would reread: left out
    keys = [k for b in source.batches for k in b]
    assert len(set(keys)) == len(keys) == 53
    assert list(by_batch) == [1, 2, 4, 8]
    # each size's fastest batch (a sleep may overrun, never undershoot): 4 / 12 / 15 / 45 ms
    assert 4 <= by_batch[1] < 10 and 12 <= by_batch[2] < 25 and 15 <= by_batch[4] < 40 and 45 <= by_batch[8] < 60
    assert source_read_ms_by_batch(_TimedRows([], num_layers=1, num_experts=3), batches=3) == {}


def test_a_batch_of_rows_is_charged_the_probed_time_interpolated_between_sizes_and_per_row_beyond():
    by_batch = {1: 2.0, 2: 3.0, 4: 4.0, 8: 6.0}
    assert batch_read_ms(0, by_batch) == 0.0
    assert [batch_read_ms(r, by_batch) for r in (1, 2, 4, 8)] == [2.0, 3.0, 4.0, 6.0]
    assert batch_read_ms(3, by_batch) == pytest.approx(3.5)
    assert batch_read_ms(6, by_batch) == pytest.approx(5.0)
    assert batch_read_ms(16, by_batch) == pytest.approx(12.0)  # 8 rows' time per row
    assert batch_read_ms(3, {4: 4.0}) == pytest.approx(3.0)  # below the smallest probed size: its time per row


def test_a_runs_own_read_rate_is_its_miss_bytes_over_its_arena_time():
    window = {"arena_miss_bytes": 3_000_000, "per_step": {"arena_ms": [1.0, 0.5, 0.0, 1.5]}}
    assert run_read_gbps(window) == pytest.approx(3e6 / 3e-3 / 1e9)
    assert run_read_gbps({"arena_miss_bytes": 0, "per_step": {"arena_ms": [1.0]}}) == 0.0
    assert run_read_gbps({"arena_miss_bytes": 5, "per_step": None}) == 0.0


def test_a_pool_that_holds_everything_is_preloaded_and_never_misses():
    g = toy_geometry()
    steps = trace_steps(skewed_routing(g, 6), None, g.num_moe_layers, None)
    result = run_replay(g, lambda: memory_source(g), steps, pool_slots=48, arena_slots=0, device="cpu", warmup=2)
    tiered = result["runs"]["tiered"]
    assert tiered["preloaded"]
    assert tiered["cold"]["replay_rate"] == tiered["steady"]["replay_rate"] == 0.0
    assert tiered["steady"]["fetched_bytes"] == 0 and tiered["steady"]["steps"] == 4


def test_a_warmup_past_the_end_leaves_an_empty_steady_window():
    g = toy_geometry()
    steps = trace_steps(skewed_routing(g, 4), None, g.num_moe_layers, None)
    result = run_replay(g, lambda: memory_source(g), steps, pool_slots=12, arena_slots=0, device="cpu", warmup=9)
    tiered = result["runs"]["tiered"]
    assert tiered["cold"]["steps"] == 4 and tiered["cold"]["fetched_bytes"] > 0
    assert tiered["steady"]["steps"] == 0 and tiered["steady"]["fetched_bytes"] == 0


def test_compare_adds_the_tiered_run_with_the_changed_config(tmp_path):
    g = toy_geometry()
    spec = ensure_synthetic_pack(g, tmp_path)
    steps = trace_steps(skewed_routing(g, 16), None, g.num_moe_layers, None)
    result = run_replay(g, lambda: open_synthetic_rows(spec, tmp_path), steps, pool_slots=12, arena_slots=16,
                        device="cpu", warmup=4, compare={"layer_waits": False})
    flipped, tiered = result["runs"]["tiered_flipped"], result["runs"]["tiered"]
    assert result["layer_waits"] is True and result["compared_config"] == {"layer_waits": False}
    assert flipped["steady"]["steps"] == tiered["steady"]["steps"] == 12
    assert flipped["steady"]["replay_rate"] > 0  # the same misses, the same protocol
    assert result["flipped_tokens_match_resident"] and result["tokens_match_resident"]
    assert result["tiered_over_flipped"] == pytest.approx(tiered["steady"]["step_ms"] / flipped["steady"]["step_ms"])


def test_compare_pass_pair_runs_pairs_and_matches_the_resident_tokens(tmp_path):
    """The replay benchmark's pass-pair run: the driver launches pairs, the pairs' first passes gather their
    misses, and every step's token equals the resident run's."""
    g = toy_geometry()
    spec = ensure_synthetic_pack(g, tmp_path)
    steps = trace_steps(skewed_routing(g, 16), None, g.num_moe_layers, None)
    result = run_replay(g, lambda: open_synthetic_rows(spec, tmp_path), steps, pool_slots=12, arena_slots=48,
                        device="cpu", warmup=4, arena_preload=True,
                        compare={"pass_pair": True, "pass_pair_choice": "always"})
    flipped = result["runs"]["tiered_flipped"]
    assert result["compared_config"] == {"pass_pair": True, "pass_pair_choice": "always"}
    assert flipped["steady_gathered_rows"] > 0 and flipped["steady"]["replay_rate"] > 0
    assert result["flipped_tokens_match_resident"] and result["tokens_match_resident"]
    # each step says whether it was a pair; the breakdown splits the window by kind
    steady = flipped["steady"]
    flags = steady["per_step"]["pairs"]
    assert set(flags) <= {0, 1} and sum(flags) == flipped["steady_pair_steps"] > 0
    kinds = steady["breakdown"]["by_kind"]
    assert kinds["pair"]["steps"] == sum(flags) and kinds.get("single", {"steps": 0})["steps"] == 12 - sum(flags)
    pair_ms = [ms for ms, flag in zip(steady["per_step"]["ms"], flags) if flag]
    assert kinds["pair"]["ms"] == pytest.approx(sum(pair_ms) / len(pair_ms))
    assert 0 < kinds["pair"]["forward_ms"] < kinds["pair"]["ms"] and kinds["pair"]["prep_ms"] > 0
    assert sum(result["runs"]["tiered"]["steady"]["per_step"]["pairs"]) == 0  # the default is off on a CPU
    # each step's first-pass misses, a pair's first pass too: they sum to the window's missing pairs
    for run in (flipped, result["runs"]["tiered"]):
        first = run["steady"]["per_step"]["first_missing"]
        assert sum(first) == run["steady"]["missing_pairs"] > 0 and min(first) >= 0
    assert any(miss > 0 for miss, flag in zip(steady["per_step"]["first_missing"], flags) if flag)


@pytest.mark.parametrize("compare_first", [False, True])
def test_compare_first_runs_the_compared_config_before_the_default(tmp_path, monkeypatch, compare_first):
    from tierstore.runtime import replay

    g = toy_geometry()
    spec = ensure_synthetic_pack(g, tmp_path)
    steps = trace_steps(skewed_routing(g, 6), None, g.num_moe_layers, None)
    order, run = [], replay._run

    def recording(*args, config, **kwargs):
        order.append("naive" if kwargs.get("naive") else "plain" if kwargs.get("plain") else config.kpi_every)
        return run(*args, config=config, **kwargs)
    monkeypatch.setattr(replay, "_run", recording)
    result = run_replay(g, lambda: open_synthetic_rows(spec, tmp_path), steps, pool_slots=12, arena_slots=48,
                        device="cpu", warmup=2, compare={"kpi_every": 7}, compare_first=compare_first)
    tiered = [0, "naive", 7] if not compare_first else [7, 0, "naive"]
    assert order == ["plain", "plain", *tiered]
    assert result["compared_first"] is compare_first and result["flipped_tokens_match_resident"]


def test_interleave_runs_the_resident_and_both_tiered_runtimes_in_turns_and_all_match_the_resident_tokens(
        tmp_path, monkeypatch):
    """The two resident runs, the default and the compared runtime are open together and take turns step by step, the
    order rotating; the naive run stays separate, after them."""
    from tierstore.runtime import replay_drive

    g = toy_geometry()
    spec = ensure_synthetic_pack(g, tmp_path)
    steps = trace_steps(skewed_routing(g, 12), None, g.num_moe_layers, None)
    order = []
    step = replay_drive.Driver.step

    def kind(driver) -> str:
        if driver.plain:
            return "resident" if driver.readback == "none" else "resident_readback"
        return "tiered" if driver.runtime.config.layer_waits else "tiered_flipped"
    monkeypatch.setattr(replay_drive.Driver, "step", lambda self, i: (order.append((i, kind(self))), step(self, i))[1])
    result = run_replay(g, lambda: open_synthetic_rows(spec, tmp_path), steps, pool_slots=12, arena_slots=16,
                        device="cpu", warmup=4, compare={"layer_waits": False}, interleave=True)
    assert result["interleaved"] and result["tokens_match_resident"] and result["flipped_tokens_match_resident"]
    names = ["resident", "resident_readback", "tiered", "tiered_flipped"]
    assert order[:48] == [(i, names[(i + j) % 4]) for i in range(12) for j in range(4)]
    assert len(order) == 48 + 12  # then the naive run's steps
    for name in ("tiered", "tiered_flipped"):
        assert result["runs"][name]["steady"]["steps"] == 8 and result["runs"][name]["steady"]["replay_rate"] > 0
    assert result["runs"]["resident"]["tokens"] == [None] * 12 and result["runs"]["resident"]["steady"]["steps"] == 8


def test_interleave_without_a_compared_config_runs_the_resident_and_tiered_runtimes_in_turns(tmp_path):
    g = toy_geometry()
    spec = ensure_synthetic_pack(g, tmp_path)
    steps = trace_steps(skewed_routing(g, 8), None, g.num_moe_layers, None)
    result = run_replay(g, lambda: open_synthetic_rows(spec, tmp_path), steps, pool_slots=12, arena_slots=16,
                        device="cpu", warmup=2, interleave=True)
    assert result["interleaved"] and result["tokens_match_resident"] and "tiered_flipped" not in result["runs"]
    assert set(result["runs"]) == {"resident", "resident_readback", "tiered", "naive"}


def test_replay_cli_config_and_compare_config_parse_fields_like_the_environment():
    import argparse
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "replay.py"
    spec = importlib.util.spec_from_file_location("bench_replay_for_test", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def parse(*items, layer_waits=False):
        return bench._compare_config(argparse.Namespace(compare_layer_waits=layer_waits, compare_config=list(items)))

    assert parse() is None
    assert parse(layer_waits=True) == {"layer_waits": False}
    assert parse("copy_streams=2") == {"copy_streams": 2}
    assert parse("copy_streams=2", layer_waits=True) == {"copy_streams": 2, "layer_waits": False}
    for bad, message in (("copy_streams", "takes FIELD=VALUE"), ("copy_streams=3", "copy_streams must be 1 or 2"),
                         ("no_such=1", "no runtime config field no_such")):
        with pytest.raises(SystemExit, match=message):
            parse(bad)
    base = lambda *items: bench._base_config(argparse.Namespace(config=list(items)))  # noqa: E731
    assert base() == RuntimeConfig(kpi_every=0, force_pool=True)
    assert base("cuda_w2=1", "copy_streams=2") == RuntimeConfig(kpi_every=0, force_pool=True, cuda_w2=True,
                                                                 copy_streams=2)
    with pytest.raises(SystemExit, match="--config: no runtime config field no_such"):
        base("no_such=1")


def test_the_floor_of_a_streaming_run_counts_streamed_bytes_not_their_installs(tmp_path):
    g = toy_geometry()
    spec = ensure_synthetic_pack(g, tmp_path)
    steps = trace_steps(skewed_routing(g, 30), None, g.num_moe_layers, None)
    config = RuntimeConfig(kpi_every=0, force_pool=True, stream_arena=True, stream_install="all")
    result = run_replay(g, lambda: open_synthetic_rows(spec, tmp_path), steps, pool_slots=12,
                        arena_slots=g.total_routed_experts, arena_preload=True, device="cpu", warmup=10, config=config)
    steady = result["runs"]["tiered"]["steady"]
    assert steady["replay_rate"] == 0.0 and steady["streamed_bytes"] > 0
    assert 0 < steady["streamed_install_bytes"] <= steady["arena_hit_bytes"]
    pinned = steady["arena_hit_bytes"] - steady["streamed_install_bytes"] + steady["streamed_bytes"]
    assert result["floor_pinned_bytes"] == pinned
    assert result["floor_fetch_ms"] == pytest.approx(1e3 * pinned / (result["h2d_gbps"] * 1e9) / steady["steps"])
