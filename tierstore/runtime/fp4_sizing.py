"""How many FP4 slots: a size in GiB, or `auto` from the device's free memory (CUDA only); and the
gate's fire floor (the smallest pool that lets a fired step upgrade its whole routed set)."""

from __future__ import annotations

import math

import torch

from tierstore.errors import CapacityError, ConfigError
from tierstore.geometry import MoEGeometry
from tierstore.runtime.config import RuntimeConfig

GIB = 2**30
FIRE_FLOOR_GROWTH = 0.35  # extra routed set per further gate iteration (re-routing after an FP4 replay)
SUB_FLOOR_BUDGET = 64  # forced promotions per step on a forced sub-floor pool


def free_device_bytes(device: torch.device) -> int:
    """Free device memory for a new allocation: the driver's free bytes plus what torch's caching
    allocator holds reserved but unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def fp4_pool_slots(config: RuntimeConfig, slot_bytes: int, total_experts: int, device: torch.device) -> int:
    """Slots for `config.fp4_pool_gb` (0 = no pool), at most one per routed expert."""
    if config.fp4_pool_gb == "auto":
        if device.type != "cuda":
            raise ConfigError("fp4_pool_gb=auto sizes the pool from free CUDA memory; on "
                              f"{device.type} give a size in GiB")
        budget = free_device_bytes(device) - int(config.fp4_reserve_gb * GIB)
        if config.fp4_max_gb > 0:
            budget = min(budget, int(config.fp4_max_gb * GIB))
        return max(0, min(budget // slot_bytes, total_experts))
    gib = float(config.fp4_pool_gb)
    if gib == 0:
        return 0
    return max(1, min(int(gib * GIB) // slot_bytes, total_experts))


def fire_floor_slots(geometry: MoEGeometry, config: RuntimeConfig) -> int:
    """layers x distinct routed experts per layer per step x (1 + 0.35 x (gate_fp_max - 1))."""
    per_layer = min(geometry.num_experts, geometry.top_k * config.tokens_per_step)
    growth = 1 + FIRE_FLOOR_GROWTH * (config.gate_fp_max - 1)
    return math.ceil(geometry.num_moe_layers * per_layer * growth)


def check_fire_floor(geometry: MoEGeometry, slots: int, slot_bytes: int, config: RuntimeConfig) -> int | None:
    """The per-step forced-promotion budget (None = unlimited). Refuses a sub-floor pool unless
    `force_fp4_pool`; a forced one keeps promotions capped."""
    budget = config.gate_budget or None
    floor = fire_floor_slots(geometry, config)
    if slots >= floor:
        return budget
    message = (f"FP4 pool of {slots} slots ({slots * slot_bytes / GIB:.3f} GiB) is below the gate's fire floor of "
               f"{floor} slots ({floor * slot_bytes / GIB:.3f} GiB): {geometry.num_moe_layers} layers x top-"
               f"{geometry.top_k} x {config.tokens_per_step} tokens x {1 + FIRE_FLOOR_GROWTH * (config.gate_fp_max - 1):.2f}")
    if not config.force_fp4_pool:
        raise CapacityError(message + "; give a larger pool or force it (force_fp4_pool, promotions then stay capped)")
    return min(budget or SUB_FLOOR_BUDGET, SUB_FLOOR_BUDGET)
