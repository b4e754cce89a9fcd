"""The FP4 step-split diagnostic (runtime/fp4_split.py) on the CPU device."""

import threading
import time

import numpy as np
from test_runtime_fixtures import toy_geometry

from tierstore.runtime.fp4_split import INTERLEAVED, VARIANTS, TimedLock, fp4_step_split
from tierstore.runtime.replay import trace_steps
from tierstore.runtime.replay_gate import hottest_keys
from tierstore.runtime.synthetic import tiled_rows


def test_split_runs_every_variant_on_held_and_live_residency():
    g = toy_geometry(layers=3, experts=16, top_k=2)
    rng = np.random.default_rng(0)
    routing = np.stack([[rng.choice(g.num_experts, g.top_k, replace=False, p=np.r_[[0.3] * 2, [0.4 / 14] * 14])
                         for _ in range(g.num_moe_layers)] for _ in range(8)])
    steps = trace_steps(routing, None, g.num_moe_layers, None)
    rows = (tiled_rows(g, fp4=False), tiled_rows(g, fp4=True))
    out = fp4_step_split(g, rows, steps, fp4_slots=12, device="cpu", rounds=3, warmup=2)
    assert set(out["variants"]) == set(VARIANTS)
    for name in VARIANTS:
        assert out["variants"][name]["steps"] == 3 * len(steps)
    assert len(out["live_blocks"]) == 3 and all(b["steps"] == len(steps) for b in out["live_blocks"])
    assert sum(b["promoted_lazy"] for b in out["live_blocks"]) > 0 and out["live_blocks"][-1]["mapped"] <= 12
    assert all(0.0 <= b["fp4_pair_share"] <= 1.0 and b["runner_lock_wait_ms"] >= 0 for b in out["live_blocks"])
    assert out["held"]["unchanged"]  # the paused manager promoted nothing into the held pool
    resident = set(hottest_keys(g, steps, 12))
    pairs = [(layer, int(e)) for ids in steps for layer in range(g.num_moe_layers) for e in np.asarray(ids)[:, layer].ravel()]
    assert out["held"]["fp4_pair_share"] == sum(p in resident for p in pairs) / len(pairs)
    m = {name: v["mean_ms"] for name, v in out["variants"].items()}
    split = out["split_ms"]
    assert split["fp4_kernels"] == m["held_plain"] - m["w2_plain"]
    assert split["fp4_step_machinery"] == (m["held_step"] - m["held_plain"]) - (m["w2_step"] - m["w2_plain"])
    assert split["manager_interference"] == m["live_step"] - m["live_plain"] - (m["held_step"] - m["held_plain"])
    assert out["graph"] is False and out["dtype"] == "float32"


def test_interleaved_variants_exclude_the_live_step():
    assert "live_step" not in INTERLEAVED and set(VARIANTS) - set(INTERLEAVED) == {"live_step"}


def test_timed_lock_times_the_runner_wait_and_the_other_threads_hold():
    lock = TimedLock(threading.RLock(), threading.get_ident())
    holding, release = threading.Event(), threading.Event()

    def manager():
        with lock:
            with lock:  # reentrant: one hold
                holding.set()
                release.wait()
                time.sleep(0.02)

    thread = threading.Thread(target=manager)
    thread.start()
    holding.wait()
    release.set()
    with lock:
        pass
    thread.join()
    assert lock.runner_wait_s >= 0.015 and lock.other_hold_s >= 0.015
    hold = lock.other_hold_s
    with lock:  # the runner's own holds are not counted
        time.sleep(0.01)
    assert lock.other_hold_s == hold
