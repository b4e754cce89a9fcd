"""benchmarks/pair_clock.py's trace reading: a pair step's passes, waits and copies cut from a made-up Chrome trace."""
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def clock():
    sys.path.insert(0, str(ROOT / "benchmarks"))  # pair_clock reads its helpers from miss_step_timeline
    try:
        spec = importlib.util.spec_from_file_location("bench_pair_clock", ROOT / "benchmarks" / "pair_clock.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


def event(name, ts, dur, cat="kernel"):
    return {"cat": cat, "ph": "X", "name": name, "ts": ts, "dur": dur}


def pair_step(t0):
    """A pair at t0: the first pass's layers (experts 10..40, plan 40..45; experts 45..75, plan 75..80), the copies on
    the side stream (45..95, 80..140), the replay's layers (experts 100..130 after waiting for the first copy; 140..170
    after the second), the step's host range to 180."""
    return [event("tierstore.step", t0, 180, cat="user_annotation"),
            event("moe_w2", t0 + 10, 30), event("plan_pass_gather", t0 + 40, 5),
            event("moe_w2", t0 + 45, 30), event("plan_pass_gather", t0 + 75, 5),
            event("gather_pass_rows", t0 + 45, 50), event("gather_pass_rows", t0 + 80, 60),
            event("moe_w2", t0 + 100, 30), event("moe_w2", t0 + 140, 30)]


def test_a_pair_step_splits_into_passes_waits_and_copies(clock):
    single = [event("tierstore.step", 5000.0, 100, cat="user_annotation"), event("moe_w2", 5010.0, 50)]
    [t] = clock.pair_timelines(pair_step(1000.0) + single)  # the step without plan kernels is no pair: left out
    assert t == {"span": 160.0, "pass1": 70.0, "replay": 90.0, "pass1_busy": 70.0, "replay_busy": 60.0,
                 "replay_wait": 30.0, "copy_busy": 95.0, "copy_kernels": 2, "copies_end": 130.0, "tail": 30.0,
                 "pass1:moe_w2": 60.0, "pass1:plan_pass_gather": 10.0, "replay:moe_w2": 60.0}


def test_medians_take_each_field_over_the_steps_that_have_it(clock):
    timelines = clock.pair_timelines(pair_step(0.0) + pair_step(1000.0) + pair_step(2000.0))
    assert len(timelines) == 3
    medians = clock._timeline_medians(timelines + [{"span": 1.0}])
    assert medians["span"] == 160.0 and medians["copy_busy"] == 95.0


def test_a_single_pass_is_timed_from_its_own_host_range(clock):
    events = [event(clock.SINGLE, 100.0, 60, cat="user_annotation"), event("moe_w2", 110.0, 20),
              event("moe_w2", 140.0, 15), event("plan_pass_gather", 300.0, 5)]  # the last: outside the range
    assert clock.single_pass_timelines(events) == [{"span": 45.0, "busy": 35.0, "single:moe_w2": 35.0}]


def test_kernel_names_lose_their_arguments_and_templates(clock):
    assert clock.kernel_name({"name": "void w2_down<128, 4>(int const*, float*)"}) == "void w2_down"
    assert clock.kernel_name({"name": "plan_pass_gather"}) == "plan_pass_gather"
