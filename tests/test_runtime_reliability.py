"""Reliability of the tiered runtime: a storm of hostile steps over tiny pools, read faults
mid-fetch (EIO, flipped bits) that fail the step closed, and shutdown / reopen."""

import threading

import pytest
import torch
from test_runtime_fixtures import ToyMoE, memory_source, toy_geometry

from tierstore.checkpoint import open_checkpoint
from tierstore.checkpoint.synthetic import write_synthetic_checkpoint
from tierstore.errors import PackFormatError, ReadError
from tierstore.io.readers import FaultPlan, FaultyReader, make_reader
from tierstore.runtime import RuntimeConfig, TieredRuntime
from tierstore.runtime.packs import ensure_base_pack, open_base_rows


def assert_pool_matches_rows(runtime, rows):
    """Every mapped slot holds its host row byte for byte; table == mirror == owners == policy."""
    runtime.pool.check_coherent()
    pool = runtime.pool
    for slot, (layer, expert) in enumerate(pool.owner.tolist()):
        if layer >= 0:
            assert torch.equal(pool.slots[slot, :rows.shape[2]], rows[layer, expert]), f"slot {slot} bytes differ"


def hostile_tokens(geometry, step, count):
    """Inputs that sweep the routing across experts: a new random direction every step, scaled up."""
    gen = torch.Generator().manual_seed(50_000 + step)
    return torch.randn(count, geometry.hidden, generator=gen) * (1 + step % 5)


def storm(steps, fraction, arena_slots, tokens_per_step, policy):
    g = toy_geometry(layers=3, experts=16)
    model = ToyMoE(g, seed=11)
    source = memory_source(g, seed=5)
    config = dict(tokens_per_step=tokens_per_step, kpi_every=0, policy=policy)
    resident = TieredRuntime(g, memory_source(g, seed=5), pool_slots=g.total_routed_experts, config=RuntimeConfig(**config))
    resident.preload()
    small = TieredRuntime(g, source, pool_slots=round(fraction * g.total_routed_experts), arena_slots=arena_slots,
                          config=RuntimeConfig(**config))
    with resident, small:
        for step in range(steps):
            x = hostile_tokens(g, step, tokens_per_step)
            want, _ = resident.step(lambda: model.forward(resident, x), lambda: None)
            got, outcome = small.step(lambda: model.forward(small, x), lambda: None)
            assert torch.equal(got, want), f"step {step} differs from the all-resident run"
            assert_pool_matches_rows(small, source.rows)
        stats = small.stats()
    assert stats.replayed_steps > steps // 5 and stats.failed_steps == 0
    return stats


@pytest.mark.parametrize("policy", ["lru", "sieve", "freq-dense"])
def test_storm_short(policy):
    storm(steps=60, fraction=14 / 48, arena_slots=16, tokens_per_step=2, policy=policy)


@pytest.mark.slow
def test_storm_thousands_of_steps():
    stats = storm(steps=3000, fraction=7 / 48, arena_slots=16, tokens_per_step=1, policy="lru")
    assert stats.second_order_steps > 0


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    root = tmp_path_factory.mktemp("packed")
    ckpt = write_synthetic_checkpoint(root / "ckpt", arch="qwen3_moe", num_layers=3, num_experts=16, top_k=2,
                                      hidden=64, expert_inter=32, seed=4)
    ensure_base_pack(ckpt, root / "packs", device="cpu")
    with open_checkpoint(ckpt) as c:
        geometry = c.geometry
    return ckpt, root / "packs", geometry


def faulty_runtime(packed, plan, fraction=0.25):
    ckpt, packs, g = packed
    plain = open_base_rows(ckpt, packs, direct=False)
    reader = FaultyReader(make_reader(plain.pack.path, backend="preadv-pool"), plan)
    plain.close()
    rows = open_base_rows(ckpt, packs, reader=reader)
    runtime = TieredRuntime(g, rows, pool_slots=round(fraction * g.total_routed_experts), arena_slots=16,
                            config=RuntimeConfig(kpi_every=0))
    return runtime, rows


@pytest.mark.parametrize("fault", ["eio", "flip"])
def test_read_fault_fails_the_step_closed_and_the_retry_is_exact(packed, fault):
    ckpt, packs, g = packed
    model = ToyMoE(g, seed=2)
    x = hostile_tokens(g, 0, 1)
    resident = TieredRuntime(g, open_base_rows(ckpt, packs, direct=False), pool_slots=g.total_routed_experts,
                             config=RuntimeConfig(kpi_every=0))
    with resident:
        resident.preload()
        want, _ = resident.step(lambda: model.forward(resident, x), lambda: None)
    probe = open_base_rows(ckpt, packs, direct=False)
    offsets = {probe.pack.spec.row_offset(l, e) for l in range(g.num_moe_layers) for e in range(g.num_experts)}
    probe.close()
    plan = FaultPlan(eio_offsets=set(offsets)) if fault == "eio" else FaultPlan(flip_offsets=set(offsets))
    runtime, rows = faulty_runtime(packed, plan)
    with runtime:
        with pytest.raises(ReadError if fault == "eio" else PackFormatError):
            runtime.step(lambda: model.forward(runtime, x), lambda: None)
        assert runtime.pool.num_mapped == 0  # nothing published from a failed batch
        assert len(runtime.arena._table) == 0
        runtime.pool.check_coherent()
        got, outcome = runtime.step(lambda: model.forward(runtime, x), lambda: None)  # faults fire once: retry reads
        assert torch.equal(got, want) and outcome.last_pass.missing_pairs == 0
        assert runtime.stats().failed_steps == 1
        assert rows.reader.fired


def test_shutdown_releases_files_and_threads_and_reopen_works(packed):
    ckpt, packs, g = packed
    model = ToyMoE(g, seed=3)
    threads_before = threading.active_count()
    results = []
    for _ in range(2):
        rows = open_base_rows(ckpt, packs, direct=False)
        runtime = TieredRuntime(g, rows, pool_slots=12, arena_slots=16, config=RuntimeConfig(kpi_every=0),
                                heat_path=rows.pack.paths.heat)
        with runtime:
            for step in range(6):
                got, _ = runtime.step(lambda s=step: model.forward(runtime, hostile_tokens(g, s, 1)), lambda: None)
            results.append(got)
            preheated = runtime.arena.stats()
        assert runtime.closed and rows.reader.fd == -1
        with pytest.raises(AttributeError):
            runtime.pool  # noqa: B018 (released)
    assert torch.equal(results[0], results[1])
    assert rows.pack.paths.heat.exists()
    assert preheated.hit_rows > 0  # the reopened arena started from the saved hot set
    assert threading.active_count() <= threads_before
