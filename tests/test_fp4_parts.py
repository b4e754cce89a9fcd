"""Pieces of the FP4 tier: wall-clock heat, the chained snapshot, victim rules, the manager thread."""

from __future__ import annotations

import numpy as np
import pytest
from fp4_fixtures import routing_counts, tier_rows
from test_runtime_fixtures import toy_geometry

from tierstore.runtime import MemoryRowSource, RuntimeConfig
from tierstore.runtime.fp4_manager import THREAD_NAME, Fp4Manager
from tierstore.runtime.fp4_tier import Fp4Tier
from tierstore.runtime.heat import WallClockHeat
from tierstore.runtime.seen_snapshot import ChainedSnapshot

GEOMETRY = toy_geometry(layers=2, experts=8, top_k=2)
ROWS = tier_rows(GEOMETRY)


def test_heat_halves_every_half_life_in_seconds_whatever_the_window_cadence():
    heat = WallClockHeat(1, 2, half_life_s=5.0, now=100.0)
    heat.add(np.array([[8, 0]]), 100.0)
    for t in np.linspace(100.0, 105.0, 7)[1:]:  # many windows without routing
        heat.add(np.zeros((1, 2)), t)
    assert heat.values(105.0)[0, 0] == pytest.approx(4.0)
    assert heat.values(110.0)[0, 0] == pytest.approx(2.0)


def test_snapshot_merges_windows_until_taken_and_loses_none():
    snapshot = ChainedSnapshot(2, 3)
    assert snapshot.take() is None and not snapshot.pending
    windows = [np.random.default_rng(i).integers(0, 3, (2, 3), dtype=np.int32) for i in range(4)]
    snapshot.push(windows[0])
    taken = snapshot.take()
    assert np.array_equal(taken, windows[0]) and snapshot.take() is None
    windows[0][:] = 7  # push read the counts: the caller's buffer is its own again
    assert np.array_equal(taken, np.random.default_rng(0).integers(0, 3, (2, 3), dtype=np.int32))
    snapshot.push(windows[1])
    snapshot.push(windows[2])  # pending: merged
    snapshot.push(windows[3])
    assert snapshot.pending
    assert np.array_equal(snapshot.take(), windows[1].astype(np.int64) + windows[2] + windows[3])
    assert snapshot.take() is None and (snapshot.windows, snapshot.merged) == (4, 2)


def tier(slots: int, **config) -> Fp4Tier:
    return Fp4Tier(GEOMETRY, MemoryRowSource(ROWS[1]), slots, "cpu", RuntimeConfig(**config))


def test_lazy_eviction_takes_only_cold_victims_outside_the_window():
    t = tier(2, fp4_policy="lru", fp4_cold_steps=2)
    for step in range(2):  # steps 0 and 1 route (0, 0) and (0, 1)
        t.close_step([(0, 0), (0, 1)])
        t.promote_lazy(t.observe_window(routing_counts((0, 0), (0, 1))))
    assert sorted(t.pool.resident_keys()) == [(0, 0), (0, 1)]
    t.close_step([(0, 1), (0, 2)])  # step 2: (0, 0) routed one step ago (warm), (0, 1) in the window
    assert t.promote_lazy(t.observe_window(routing_counts((0, 1), (0, 2)))) == 0
    t.close_step([(0, 3)])  # step 3: (0, 0) not routed for 2 steps (cold), (0, 1) routed in step 2 (warm)
    assert t.promote_lazy(t.observe_window(routing_counts((0, 3)))) == 1
    assert sorted(t.pool.resident_keys()) == [(0, 1), (0, 3)] and t.evicted == 1
    t.pool.check_coherent()


def test_forced_promotion_ignores_coldness_but_never_evicts_the_step_and_counts_shortfall():
    t = tier(2, fp4_policy="lru")
    t.force_promote([(1, 0), (1, 1)], {(1, 0), (1, 1)}, None)
    t.close_step([(1, 0), (1, 1)])  # both warm
    assert t.force_promote([(1, 2)], {(1, 2)}, None) == 1  # evicts a warm expert: the runner is synchronous
    assert t.force_promote([(1, 3), (1, 4)], {(1, 2), (1, 3), (1, 4)}, None) == 1
    assert t.unrestored == 1 and (1, 2) in t.pool.resident_keys()
    assert t.force_promote([(1, 5), (1, 6)], {(1, 5), (1, 6)}, 1) == 1  # budget
    t.pool.check_coherent()


def test_hysteresis_keeps_a_hot_pool_from_churning():
    t = tier(1, fp4_policy="freq", fp4_hysteresis=2.0, fp4_cold_steps=0)
    hot = routing_counts(*[(0, 0)] * 20)
    t.close_step([(0, 0)])
    t.promote_lazy(t.observe_window(hot))
    t.close_step([(0, 1)])
    assert t.promote_lazy(t.observe_window(routing_counts((0, 1)))) == 0  # 1 < 2 x 20 + 4
    assert t.pool.resident_keys() == [(0, 0)]


def test_manager_thread_consumes_every_window_and_stops_on_close():
    t = tier(4, fp4_policy="freq", fp4_promote=2)
    snapshot = ChainedSnapshot(2, 8)
    manager = Fp4Manager(t, snapshot)
    try:
        assert manager.alive and manager._thread.name == THREAD_NAME and manager._thread.daemon
        for step in range(5):
            with t.lock:  # the runner's step: the manager cannot mutate meanwhile
                t.close_step([(0, step)])
            snapshot.push(routing_counts((0, step), (1, step)))
            manager.wake()
        assert manager.wait_idle(10)
        assert t.routed_pairs == 10 and manager.error is None and t.promoted_lazy >= 2
        t.pool.check_coherent()
    finally:
        manager.close()
    assert not manager.alive
