"""The miss path's per-step split (arena, pool install, copies, copy wait, pass-log reads) and the
pool's overlapped installs: the host waits for the last copies before the arena is touched again,
and on CUDA the compute stream reads nothing before the copies land (the `gpu` test)."""

import numpy as np
import pytest
import torch
from test_runtime_core import tokens
from test_runtime_fixtures import ToyMoE, memory_source, toy_geometry
from test_runtime_replay import skewed_routing

from tierstore.cache.policy import get_policy
from tierstore.runtime import RuntimeConfig, TieredRuntime
from tierstore.runtime.pools import DevicePool
from tierstore.runtime.replay import run_replay, trace_steps
from tierstore.runtime.replay_drive import PER_STEP_MS, drive


def test_per_step_split_adds_up_and_is_zero_without_a_fetch():
    g = toy_geometry()
    steps = trace_steps(skewed_routing(g, 16), None, g.num_moe_layers, None)
    result = run_replay(g, lambda: memory_source(g), steps, pool_slots=12, arena_slots=16, device="cpu", warmup=4)
    steady = result["runs"]["tiered"]["steady"]
    per = steady["per_step"]
    fetched = [h + m > 0 for h, m in zip(per["arena_hit_rows"], per["arena_miss_rows"])]
    assert any(fetched)
    for i, did in enumerate(fetched):
        assert per["read_ms"][i] > 0  # every step reads at least one pass
        assert per["arena_ms"][i] + per["install_ms"][i] <= per["fetch_ms"][i] + 1e-3
        assert per["copy_ms"][i] <= per["install_ms"][i] + 1e-3  # on the CPU the copies run inside install
        assert per["copy_wait_ms"][i] == 0.0  # nothing is ever in flight on the CPU
        if did:
            assert per["copy_ms"][i] > 0 and per["install_ms"][i] > 0
        else:
            assert per["fetch_ms"][i] == per["arena_ms"][i] == per["install_ms"][i] == per["copy_ms"][i] == 0.0
    medians = steady["breakdown"]["fetch_step_median_ms"]
    assert set(medians) == {"ms", *PER_STEP_MS} and steady["breakdown"]["fetch_steps"] == sum(fetched)
    assert medians["install_ms"] == float(np.median(np.asarray(per["install_ms"])[fetched]))


def test_fetch_waits_for_the_last_copies_before_the_arena_reads_and_close_waits():
    """A fetch that reads rows into the arena waits for the pool's copies first (they may read arena rows the
    read rewrites); one whose rows are all arena hits does not wait; close waits."""
    g = toy_geometry()
    source = memory_source(g)
    runtime = TieredRuntime(g, source, pool_slots=12, arena_slots=16, config=RuntimeConfig(kpi_every=0))
    calls = []
    wait, read_rows = runtime.pool.wait, source.read_rows
    runtime.pool.wait = lambda: (calls.append("wait"), wait())[1]
    source.read_rows = lambda *a, **k: (calls.append("read"), read_rows(*a, **k))[1]
    runtime.fetch([(0, 1), (1, 2)], [])
    assert calls == ["wait", "read"]
    calls.clear()
    runtime.pool.clear()  # unmapped from the pool, still in the arena: the next fetch hits there only
    runtime.fetch([(0, 1), (1, 2)], [])
    assert calls == [] and runtime.pool.is_resident((0, 1)) and runtime.pool.is_resident((1, 2))
    runtime.close()
    assert calls == ["wait"]


@pytest.mark.parametrize("overlap", [False, True])
def test_install_on_cpu_is_exact_and_times_its_copies(overlap):
    p = DevicePool(4, 4096, 2, 4, "cpu", get_policy("lru"), overlap=overlap)
    rows = torch.randint(0, 256, (6, 4096), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    keys = [(0, 0), (0, 3), (1, 1), (1, 2)]
    p.install(keys, [rows[0], rows[2], rows[4], rows[5]], exclude=[])
    p.touch([(0, 0), (1, 1)], now=1.0)
    p.install([(0, 1), (1, 3)], [rows[1], rows[3]], exclude=[(0, 0), (1, 1)])  # evicts (0, 3) and (1, 2)
    for key, row in zip([(0, 0), (1, 1), (0, 1), (1, 3)], [rows[0], rows[4], rows[1], rows[3]]):
        assert torch.equal(p.slots[p.slot_of(key)], row)
    assert not p.is_resident((0, 3)) and not p.is_resident((1, 2))
    assert p.copy_seconds > 0 and p.wait_seconds == 0.0
    p.check_coherent()


@pytest.mark.gpu
def test_an_overlapped_install_is_read_in_stream_order_on_cuda():
    """Rows big enough (8 x 64 MiB, ~10 ms at 55 GB/s) that a read racing the copies would see old
    bytes: the compute stream's comparison right after install must see the new ones."""
    slot, count = 64 << 20, 8
    p = DevicePool(count, slot, 1, count, "cuda", get_policy("lru"), overlap=True)
    p.install([(0, e) for e in range(count)], list(torch.zeros(count, slot, dtype=torch.uint8).pin_memory()), [])
    p.wait()
    host = torch.randint(0, 256, (count, slot), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    want = host.cuda()
    rows = list(host.pin_memory())[::-1]  # descending in memory: one copy per row
    keys = [(0, e) for e in range(count)]
    p.clear()  # every slot free again: the next install rewrites all of them
    torch.cuda.synchronize()
    collected = p.copy_seconds
    p.install(keys, rows, [])
    same = [torch.equal(p.slots[p.slot_of(key)], want[count - 1 - i]) for i, key in enumerate(keys)]
    table = p.table.cpu().numpy()
    assert all(same) and np.array_equal(table, p.mirror)
    assert p.copy_seconds == collected  # counted once waited for
    p.wait()
    assert p.copy_seconds > collected and count * slot / (p.copy_seconds - collected) > 1e9
    p.check_coherent()


def test_hits_applied_before_each_read_change_no_eviction():
    """`_early_hits` (on by default where the device is CUDA and the pool can evict) moves the
    replay of the deferred LRU hits before the pass-log read: same policy order, same slots."""
    g = toy_geometry()
    steps = trace_steps(skewed_routing(g, 40, seed=3), None, g.num_moe_layers, None)
    finals = []
    for early in (False, True):
        runtime = TieredRuntime(g, memory_source(g), pool_slots=12, arena_slots=16,
                                config=RuntimeConfig(kpi_every=0, policy="lru"), output_words=1)  # deferred hits
        runtime._early_hits = early
        with runtime:
            out = drive(runtime, steps, warmup=0, readback="folded")
            finals.append((out["tokens"], runtime.pool.mirror.copy(), list(runtime.pool.policy._order)))
    assert finals[0][0] == finals[1][0] and np.array_equal(finals[0][1], finals[1][1])
    assert finals[0][2] == finals[1][2]


def test_only_the_steps_fetch_after_a_read_skips_the_copies_wait_for_compute():
    """The step's fetch follows a pass-log read (its sync finished every kernel that could read a victim's slot) and
    installs with after_compute False; a fetch from outside the step (preload, a prefill layer's, a caller's) keeps
    the wait."""
    g = toy_geometry()
    model = ToyMoE(g)
    runtime = TieredRuntime(g, memory_source(g), pool_slots=12, arena_slots=16, config=RuntimeConfig(kpi_every=0))
    flags = []
    install = runtime.pool.install
    runtime.pool.install = lambda *a, after_compute=True, **k: (flags.append(after_compute),
                                                                 install(*a, after_compute=after_compute, **k))[1]
    runtime.fetch([(0, 1)], [])
    assert flags == [True]
    flags.clear()
    for step in range(4):
        runtime.step(lambda x=tokens(g, step): model.forward(runtime, x), lambda: None)
    assert flags and not any(flags)
    runtime.close()
