"""benchmarks/step_host_profile.py's clock: the wrapped functions' time summed per step, steps split by what they did,
and medians per kind; on a CPU runtime over a toy model (streaming, an empty arena filling from the pack)."""
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_runtime_fixtures import ToyMoE, memory_source, toy_geometry

from tierstore.runtime import RuntimeConfig, TieredRuntime

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def profile():
    spec = importlib.util.spec_from_file_location("bench_step_host_profile", ROOT / "benchmarks" / "step_host_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stats(replayed=0, installs=0, streamed=0):
    return SimpleNamespace(replayed_steps=replayed, streamed_installs=installs, streamed_steps=streamed)


def test_step_kind_names_what_a_step_did(profile):
    before = _stats(3, 5, 7)
    assert profile.step_kind(before, _stats(4, 6, 8)) == "fetch"  # a replay outranks the rest
    assert profile.step_kind(before, _stats(3, 6, 8)) == "install"
    assert profile.step_kind(before, _stats(3, 5, 8)) == "stream"
    assert profile.step_kind(before, _stats(3, 5, 7)) == "quiet"


def test_the_clock_sums_each_wrapped_function_per_step_and_detaches(profile):
    g = toy_geometry(layers=4, experts=16)
    model = ToyMoE(g, seed=3)
    rt = TieredRuntime(g, memory_source(g, seed=7), pool_slots=12, arena_slots=g.total_routed_experts,
                       config=RuntimeConfig(kpi_every=0, stream_arena=True))
    with rt:
        clock = profile.HostClock(rt)
        assert "step" in vars(rt) and "read" in vars(rt.log)  # instance attributes over the methods
        kinds = []
        for step in range(12):
            x = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(step % 4)) * 3
            before = rt.stats()
            rt.step(lambda: model.forward(rt, x), lambda: None)
            kinds.append(profile.step_kind(before, rt.stats()))
            clock.end_step(kinds[-1])
        clock.detach()
        assert "step" not in vars(rt) and "read" not in vars(rt.log)
    assert kinds[0] == "fetch"  # the empty arena: the first step misses, reads the pack and replays
    for record in clock.steps:
        step_us, calls = record["runtime.step"]
        read_us, _ = record["runtime._read_pass"]
        assert calls == 1 and 0 < read_us <= step_us  # nested: the read inside the step
        assert record["log.read"][1] == record["runtime._read_pass"][1]  # one pass-log read per read of a pass
    summary = profile.summarize(clock.steps)
    assert sum(kind["steps"] for kind in summary.values()) == 12 and set(summary) == set(kinds)
    fetch = summary["fetch"]
    assert fetch["runtime._read_pass"]["calls_per_step"] >= 2  # a fetch step reads its pass and its replay
    assert fetch["runtime.step"]["median_us"] > 0
