"""benchmarks/miss_step_timeline.py's trace reading: phases of a step cut from a made-up Chrome trace."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def timeline():
    spec = importlib.util.spec_from_file_location("bench_miss_step_timeline", ROOT / "benchmarks" / "miss_step_timeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def host(name, ts, dur):
    return {"cat": "user_annotation", "ph": "X", "name": name, "ts": ts, "dur": dur}


def kernel(ts, dur):
    return {"cat": "kernel", "ph": "X", "name": "k", "ts": ts, "dur": dur}


def copy(ts, dur, nbytes, kind="HtoD (Pinned -> Device)"):
    return {"cat": "gpu_memcpy", "ph": "X", "name": f"Memcpy {kind}", "ts": ts, "dur": dur, "args": {"bytes": nbytes}}


def replayed_step(t0):
    """A step at t0: pass 1 (kernels 10..100), read ends at 110, a small table copy, two row copies 150..250
    (a gap of 20 between them), replay kernels 160..270, step ends at 290."""
    return [host("tierstore.step", t0, 290), host("tierstore.read_pass", t0 + 5, 105),
            kernel(t0 + 10, 40), kernel(t0 + 50, 50),
            copy(t0 + 140, 2, 4096), copy(t0 + 150, 40, 4_000_000), copy(t0 + 210, 40, 4_000_000),
            kernel(t0 + 160, 20), kernel(t0 + 250, 20), host("tierstore.read_pass", t0 + 120, 165)]


def test_replayed_step_phases(timeline):
    [t] = timeline.step_timelines(replayed_step(1000.0))
    assert t["replayed"] and t["passes"] == 2
    assert t["wall"] == 290 and t["launch"] == 10 and t["end"] == 20
    assert t["pass1"] == 90 and t["read1_after_pass1"] == 10
    assert t["to_copy"] == 50 and t["copies"] == 100 and t["copy_busy"] == 80 and t["row_copies"] == 2
    assert t["copy_gbps"] == pytest.approx(8e6 / 100 / 1e3)
    assert t["replay_start"] == 60 and t["tail"] == 20 and t["replay_kernels"] == 40 and t["pass1_kernels"] == 90
    # busy: 10..100, 140..142, 150..190 (copy 150..190 covers kernel 160..180), 210..270 (copy, then kernel)
    assert t["gpu_idle"] == pytest.approx(290 - (90 + 2 + 40 + 60))


def test_steps_are_separated_and_summarized(timeline):
    no_miss = [host("tierstore.step", 5000.0, 120), host("tierstore.read_pass", 5002.0, 110), kernel(5010.0, 95)]
    events = replayed_step(1000.0) + no_miss + replayed_step(2000.0)
    timelines = timeline.step_timelines(events)
    assert [t["replayed"] for t in timelines] == [True, True, False]
    clean = timelines[2]
    assert clean["wall"] == 120 and clean["pass1"] == 95 and "copies" not in clean and clean["end"] == 15
    summary = timeline.summarize(timelines)
    assert summary["replayed_steps"] == 2 and summary["replayed"]["copies"] == {"median_us": 100, "steps": 2}
    assert summary["no_miss"]["wall"] == {"median_us": 120, "steps": 1}


def test_small_or_device_to_host_copies_are_not_rows(timeline):
    events = replayed_step(0.0)
    events[5] = copy(150.0, 40, 4_000_000, kind="DtoH (Device -> Pinned)")
    [t] = timeline.step_timelines(events)
    assert t["row_copies"] == 1 and t["to_copy"] == 110


def test_a_step_that_gathered_in_its_pass_times_its_gather_and_plan_kernels(timeline):
    named = lambda name, ts, dur: dict(kernel(ts, dur), name=name)  # noqa: E731
    events = [host("tierstore.step", 0.0, 200), host("tierstore.read_pass", 2.0, 190),
              named("plan_pass_gather", 10.0, 3), named("gather_pass_rows", 14.0, 50), kernel(70.0, 20),
              named("plan_pass_gather", 95.0, 4), named("gather_pass_rows", 100.0, 60), kernel(165.0, 20)]
    [t] = timeline.step_timelines(events)
    assert not t["replayed"] and "copies" not in t
    assert t["gather_kernels"] == 110 and t["plan_kernels"] == 7 and t["pass1_kernels"] == 157
    [plain] = timeline.step_timelines(replayed_step(1000.0))
    assert "gather_kernels" not in plain and "plan_kernels" not in plain
