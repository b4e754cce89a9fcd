"""A recorded trace replayed at a preset's shapes (`runtime.replay.map_trace`): the layer, expert and
top-k mapping, the refusals, and runs end to end on the CPU device (`tierstore replay`, and
benchmarks/replay.py with a toy preset)."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
from test_runtime_fixtures import toy_geometry

from tierstore import geometry as geometry_module
from tierstore.cli import main
from tierstore.errors import TraceFormatError
from tierstore.geometry import get_preset
from tierstore.runtime.replay import map_trace, run_replay, touched_keys, trace_steps
from tierstore.sim import load_trace
from tierstore.sim.trace import Trace, save_trace

ROOT = Path(__file__).resolve().parents[1]
QUALITY_TRACE = ROOT / "benchmarks" / "results" / "quality-traces" / "quality-fp4_checkpoint.npz"


def recorded(tokens=12, layers=2, experts=8, top_k=2, seed=0) -> Trace:
    rng = np.random.default_rng(seed)
    ids = np.stack([np.stack([rng.choice(experts, top_k, replace=False) for _ in range(layers)])
                    for _ in range(tokens)]).astype(np.int32)
    return Trace(ids, experts, step=np.arange(tokens, dtype=np.int64), meta={"source": "test"})


def test_first_layers_expert_ids_as_is_and_a_smaller_top_k_runs_at_the_trace_top_k():
    trace = recorded(layers=4, experts=8, top_k=2)
    run_geometry, ids, mapping = map_trace(trace, toy_geometry(layers=3, experts=16, top_k=4))
    assert run_geometry.top_k == 2 and run_geometry.num_experts == 16 and run_geometry.hidden == 64
    assert ids.dtype == np.int64 and np.array_equal(ids, trace.experts[:, :3])
    assert mapping["layers"]["source_layer"] == [0, 1, 2] and "trace layers 3..3 unused" in mapping["layers"]["rule"]
    assert mapping["experts"]["rule"] == "trace expert e -> preset expert e; preset experts 8..15 never routed"
    assert mapping["top_k"] == {"mode": "trace", "used": 2,
                                "rule": "the preset's shapes at the trace's top-2 (preset top-4), weights 1/2"}
    assert mapping["trace"]["meta"] == {"source": "test"} and mapping["trace"]["steps"] == 12
    json.dumps(mapping)  # goes into the result JSON as is


def test_tiled_layers_repeat_the_trace_layers():
    trace = recorded(layers=2)
    run_geometry, ids, mapping = map_trace(trace, toy_geometry(layers=5, experts=8, top_k=2), layers="tile")
    assert run_geometry == toy_geometry(layers=5, experts=8, top_k=2)  # nothing to change
    assert mapping["layers"]["source_layer"] == [0, 1, 0, 1, 0]
    assert np.array_equal(ids[:, 4], trace.experts[:, 0]) and mapping["top_k"]["mode"] == "as-is"


@pytest.mark.parametrize("trace, geometry, kwargs, message", [
    (recorded(layers=2), toy_geometry(layers=3, experts=8, top_k=2), {},
     "the trace has 2 layers, the replay needs 3 (use 2 layers, or the 'tile' layer mapping)"),
    (recorded(experts=32), toy_geometry(experts=16, top_k=2), {},
     "the trace has 32 experts per layer, more than the preset's 16"),
    (recorded(top_k=4), toy_geometry(layers=2, experts=8, top_k=2), {},
     "the trace's top-4 does not fit the preset's top-2"),
    (recorded(top_k=2), toy_geometry(layers=2, experts=8, top_k=4), {"top_k": "refuse"},
     "the trace's top-2 is below the preset's top-4 (refused"),
])
def test_mismatches_that_cannot_be_mapped_are_refused_by_name(trace, geometry, kwargs, message):
    with pytest.raises(TraceFormatError, match=r"trace \(.*\) at toy \(") as caught:
        map_trace(trace, geometry, **kwargs)
    assert message in str(caught.value)


def test_empty_routing_slots_are_refused():
    trace = recorded(layers=2, experts=8, top_k=2)
    trace.experts[3, 1, 1] = -1
    with pytest.raises(TraceFormatError, match="empty routing slots"):
        map_trace(trace, toy_geometry(layers=2, experts=8, top_k=2))


def test_the_quality_trace_at_ds_v2_lite_shapes():
    trace = load_trace(QUALITY_TRACE)
    geometry = get_preset("ds-v2-lite").with_layers(8)
    run_geometry, ids, mapping = map_trace(trace, geometry)
    assert (run_geometry.top_k, run_geometry.hidden, run_geometry.expert_inter) == (4, 2048, 1408)
    assert mapping["trace"]["layers"] == 8 and mapping["trace"]["experts"] == 32 and mapping["trace"]["steps"] == 2032
    steps = trace_steps(ids, trace.step, 8, 520)
    assert len(steps) == 520 and steps[0].shape == (1, 8, 4)
    assert touched_keys(steps, 64) <= 8 * 32
    with pytest.raises(TraceFormatError, match="the trace has 8 layers, the replay needs 26"):
        map_trace(trace, get_preset("ds-v2-lite"))
    with pytest.raises(TraceFormatError, match="top-4 is below the preset's top-8"):
        map_trace(trace, get_preset("qwen3-30b-a3b").with_layers(8), top_k="refuse")


def test_a_mapped_trace_runs_end_to_end_on_cpu(tmp_path):
    from test_runtime_fixtures import memory_source

    g = toy_geometry(layers=3, experts=16, top_k=4)
    run_geometry, ids, _ = map_trace(recorded(tokens=10, layers=2, experts=8, top_k=2), g, layers="tile")
    steps = trace_steps(ids, np.arange(10), g.num_moe_layers, None)
    result = run_replay(run_geometry, lambda: memory_source(run_geometry), steps, pool_slots=12, arena_slots=0,
                        device="cpu", warmup=3)
    assert result["top_k"] == 2 and result["steps"] == 10 and result["tokens_match_resident"]
    assert result["touched_keys"] <= 3 * 8 and result["pool_over_touched"] == 12 / result["touched_keys"]


@pytest.fixture
def toy_preset(monkeypatch):
    g = toy_geometry(layers=4, experts=16, top_k=4)
    monkeypatch.setitem(geometry_module.PRESETS, "toy", g)
    return g


def test_tierstore_replay_maps_a_recorded_trace(tmp_path, toy_preset, capsys):
    trace = save_trace(recorded(tokens=8, layers=2, experts=8, top_k=2), tmp_path / "t.npz")
    out = tmp_path / "r.json"
    args = ["replay", "--trace", str(trace), "--preset", "toy", "--layers", "2", "--gpu-pool-frac", "0.5",
            "--arena-gb", "0.001", "--pack-dir", str(tmp_path / "pack"), "--device", "cpu", "--warmup", "2",
            "--json", str(out)]
    assert main(args) == 0, capsys.readouterr()
    printed = capsys.readouterr().out
    assert "trace mapping: layers run layer l <- trace layer l;" in printed
    result = json.loads(out.read_text())
    assert result["top_k"] == 2 and result["trace_mapping"]["top_k"]["used"] == 2 and result["steps"] == 8
    read_pack = any(result["runs"]["tiered"]["steady"]["per_step"]["arena_miss_rows"])
    assert ("floor at the steps' own batch sizes" in printed) == read_pack
    assert main(args[:-2] + ["--trace-top-k", "refuse"]) == 2
    assert "refused: trace (2 layers x 8 experts, top-2) at toy" in capsys.readouterr().err
    assert main(args[:-2] + ["--layers", "3"]) == 2
    assert "the replay needs 3" in capsys.readouterr().err


def _benchmark():
    spec = importlib.util.spec_from_file_location("replay_benchmark", ROOT / "benchmarks" / "replay.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_replays_a_recorded_trace_and_records_the_mapping(tmp_path, toy_preset, monkeypatch, capsys):
    trace = save_trace(recorded(tokens=9, layers=2, experts=8, top_k=2), tmp_path / "rec.npz")
    out = tmp_path / "replay.json"
    common = ["replay.py", "--pack-dir", str(tmp_path / "pack"), "--presets", "toy", "--layers", "3", "--steps", "6",
              "--warmup", "2", "--coverages", "0.25", "--arena-gb", "0.001", "--trace", str(trace), "--commit", "x",
              "--out", str(out)]
    monkeypatch.setattr(sys, "argv", common + ["--trace-layers", "tile"])
    _benchmark().main()
    data = json.loads(out.read_text())
    assert data["method"]["trace_layers"] == "tile" and data["method"]["synthetic"]
    by_workload = {r["workload"]: r for r in data["results"]}
    assert set(by_workload) == {"synthetic-skewed", "rec.npz"}
    assert by_workload["synthetic-skewed"]["trace_mapping"] is None and by_workload["synthetic-skewed"]["top_k"] == 4
    rec = by_workload["rec.npz"]
    assert rec["trace_mapping"]["layers"]["source_layer"] == [0, 1, 0] and rec["top_k"] == 2 and rec["steps"] == 6
    monkeypatch.setattr(sys, "argv", common + ["--no-synthetic"])  # 3 layers, the trace has 2: refused up front
    with pytest.raises(SystemExit, match="refused: rec.npz: .*the trace has 2 layers, the replay needs 3"):
        _benchmark().main()


def test_tierstore_replay_takes_the_dtype_arena_preload_and_cuda_w2(tmp_path, toy_preset, capsys):
    trace = save_trace(recorded(tokens=6, layers=2, experts=8, top_k=2), tmp_path / "t.npz")
    out = tmp_path / "r.json"
    args = ["replay", "--trace", str(trace), "--preset", "toy", "--layers", "2", "--gpu-pool-frac", "0.5",
            "--arena-gb", "0.001", "--pack-dir", str(tmp_path / "pack"), "--device", "cpu", "--json", str(out)]
    assert main(args + ["--dtype", "bfloat16", "--arena-preload"]) == 0
    assert "kernels: Triton, activations bfloat16" in capsys.readouterr().out  # config cuda_w2 auto: not on a CPU
    result = json.loads(out.read_text())
    assert result["dtype"] == "bfloat16" and result["arena_preload"] is True and result["tokens_match_resident"]
    assert result["runs"]["tiered"]["cuda_w2_kernels"] is False
    assert main(args + ["--cuda-w2"]) == 2
    assert "--cuda-w2 runs the CUDA C++ kernels, which take bfloat16 activations" in capsys.readouterr().err
    assert main(args + ["--cuda-w2", "--dtype", "bfloat16"]) == 2  # the runtime's own check at boot, named
    assert "TIERSTORE_CUDA_W2 (config cuda_w2) is on but the expert shapes (hidden 64" in capsys.readouterr().err
