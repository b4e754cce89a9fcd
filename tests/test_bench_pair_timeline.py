"""benchmarks/pair_timeline.py's phase cut on a made-up trace (the script itself needs CUDA)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "pair_timeline.py"
spec = importlib.util.spec_from_file_location("bench_pair_timeline_for_test", PATH)
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def _x(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
    return {"name": name, "ph": "X", "ts": ts, "dur": dur, "cat": cat}


def test_a_step_is_cut_into_copies_compute_and_tail():
    events = [
        _x(bench.STEP, 0, 1000, cat="user_annotation"),
        _x("w2_gate_up_mma", 10, 20), _x("plan_pass_gather", 30, 2),
        _x("gather_pass_rows", 35, 100), _x("w2_down_mma", 40, 30),  # 30 us of compute beside the first copy
        _x("gather_pass_rows", 200, 0.5),  # an empty plan's copy: not a row copy
        _x("gather_pass_rows", 300, 200), _x("w2_down_mma", 520, 20),
        _x(bench.STEP, 2000, 500, cat="user_annotation"),  # a step without row copies: skipped
        _x("w2_gate_up_mma", 2010, 20),
    ]
    (phases,) = bench.step_phases(events, [15.0, 0.0])
    assert phases["span"] == pytest.approx(530)  # 10 -> 540
    assert phases["first_copy"] == pytest.approx(25) and phases["tail"] == pytest.approx(40)
    assert phases["copies"] == pytest.approx(465) and phases["copy_busy"] == pytest.approx(300)
    assert phases["compute_during_copies"] == pytest.approx(30)
    assert phases["gbps_busy"] == pytest.approx(15.0 * 1e3 / 300)
