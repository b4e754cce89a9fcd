"""`simulate()`: the stable Python entry point of the simulator."""

from __future__ import annotations

import numpy as np

from tierstore.errors import CapacityError
from tierstore.geometry import MoEGeometry, PRESETS, get_preset
from tierstore.sim.cost import CostModel
from tierstore.sim.result import SimResult, empty_counters
from tierstore.sim.steps import group_steps, step_ids
from tierstore.sim.trace import Trace

GIB = 1 << 30


def resolve_geometry(trace: Trace, geometry: MoEGeometry | str | None) -> MoEGeometry | None:
    """An explicit geometry (object or preset name) or the trace's own `meta.geometry` preset."""
    if isinstance(geometry, MoEGeometry):
        g = geometry
    elif isinstance(geometry, str):
        g = get_preset(geometry)
    elif trace.meta.get("geometry") in PRESETS:
        g = PRESETS[trace.meta["geometry"]]
    else:
        return None
    if g.num_experts != trace.num_experts or g.num_moe_layers != trace.num_layers:
        g = MoEGeometry(name=f"{g.name}@trace", moe_layers=tuple(range(trace.num_layers)),
                        num_experts=trace.num_experts, top_k=trace.top_k,
                        hidden=g.hidden, expert_inter=g.expert_inter)
    return g


def slots_from_gib(gib: float, row_bytes: int, what: str) -> int:
    if gib < 0:
        raise CapacityError(f"{what}: size must be >= 0 GiB, got {gib}")
    return int(gib * GIB // row_bytes)


def simulate(trace: Trace, gpu_slots: int | None = None, policy="lru", *, gpu_gb: float | None = None,
             geometry: MoEGeometry | str | None = None, tokens_per_step: int | str = 1, pool: str = "global",
             policy_params: dict | None = None, fp4_slots: int = 0, fp4_gb: float | None = None,
             fp4_policy: str = "freq", fp4_params: dict | None = None, fp4_promote_per_step: int = 8,
             gate_tau: float | None = None, fp4_force_budget: int | None = None,
             arena_slots: int | None = None, arena_gb: float | None = None, arena_policy: str = "lru",
             cost: CostModel | dict | None = None, fast: bool | None = None) -> SimResult:
    """Replay `trace` through a GPU pool of `gpu_slots` 2-bit expert slots (or `gpu_gb` GiB).

    Default semantics: one step = one token; a key is a hit if resident at the step's start;
    then all missing keys are inserted, evicting only keys the step does not use (a step larger
    than the pool overflows it temporarily). Options add per-layer pools, batched steps, an FP4
    pool with a confidence gate and a host arena (see docs/simulator.md). `fast` (default: when
    possible) uses the numba kernels for global `lru` / `belady` pools.
    """
    g = resolve_geometry(trace, geometry)
    if (gpu_slots is None) == (gpu_gb is None):
        raise CapacityError("give exactly one of gpu_slots and gpu_gb")
    if gpu_gb is not None or fp4_gb is not None or arena_gb is not None:
        if g is None:
            raise CapacityError("capacities in GiB need a geometry (preset name, MoEGeometry or trace meta)")
    if gpu_gb is not None:
        gpu_slots = slots_from_gib(gpu_gb, g.w2_expert_bytes, "GPU pool")
    if fp4_gb is not None:
        fp4_slots = slots_from_gib(fp4_gb, g.fp4_expert_bytes, "FP4 pool")
    if arena_gb is not None:
        arena_slots = slots_from_gib(arena_gb, g.w2_expert_bytes, "host arena")
    if gpu_slots < 0:
        raise CapacityError(f"gpu_slots must be >= 0, got {gpu_slots}")
    cost = CostModel.from_overrides(**cost) if isinstance(cost, dict) else (cost or CostModel())
    steps = group_steps(trace, tokens_per_step)
    params = {"policy": policy if isinstance(policy, str) else getattr(policy, "__name__", "custom"),
              "gpu_slots": gpu_slots, "coverage": gpu_slots / trace.num_keys, "pool": pool,
              "tokens_per_step": tokens_per_step, "fp4_slots": fp4_slots, "arena_slots": arena_slots,
              "arena_policy": arena_policy}
    eligible = (policy in ("lru", "belady") and pool == "global" and not fp4_slots and arena_slots is None
                and gate_tau is None
                and not policy_params)
    if fast and not eligible:
        raise ValueError("fast=True needs policy 'lru' or 'belady', one global pool, no FP4 pool, no arena")
    if eligible and fast is not False:
        from tierstore.sim.fast import run_fast

        counters = empty_counters(steps.num_steps)
        hit, miss = run_fast(policy, steps.keys, steps.counts, steps.offsets, trace.num_keys, gpu_slots)
        counters["hit_pairs"][:], counters["miss_keys"][:] = hit, miss
        counters["pairs"][:] = np.add.reduceat(steps.counts, steps.offsets[:-1]) if len(steps.keys) else 0
        counters["base_keys"][:] = np.diff(steps.offsets)
        counters["arena_rows"][:] = miss
        counters["tokens"][:] = steps.tokens_per_step
        params["engine"] = "fast"
    else:
        from tierstore.sim.engine import TierEngine

        confidence = None
        if gate_tau is not None and trace.confidence is not None:
            ids = step_ids(trace, tokens_per_step)
            confidence = np.full(steps.num_steps, np.inf)
            np.minimum.at(confidence, ids, trace.confidence)
        engine = TierEngine(steps, trace.num_layers, trace.num_experts, gpu_slots=gpu_slots, policy=policy,
                            policy_params=policy_params, pool=pool, fp4_slots=fp4_slots, fp4_policy=fp4_policy,
                            fp4_params=fp4_params, fp4_promote_per_step=fp4_promote_per_step, gate_tau=gate_tau,
                            confidence=confidence, fp4_force_budget=fp4_force_budget, arena_slots=arena_slots,
                            arena_policy=arena_policy)
        counters = engine.run()
        params["engine"] = "reference"
    return SimResult(counters=counters, params=params, geometry=g, cost=cost)
