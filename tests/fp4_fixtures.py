"""Toy experts at both tiers for the precision-tier tests (import as `from fp4_fixtures import ...`).

W2 codes are derived from random e2m1 nibbles exactly as the format defines (magnitudes
{0, .5, 1, 1.5, 2} -> +/-1, {3, 4, 6} -> +/-4), so the FP4 row of an expert is its true
precision and shares the W2 row's scales.
"""

from __future__ import annotations

import numpy as np
import torch

from tierstore.geometry import MoEGeometry
from tierstore.kernels.layout import fp4_slot_layout, pack_slot, w2_slot_layout
from tierstore.runtime import MemoryRowSource, RuntimeConfig, TieredRuntime


def nibbles_to_codes(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 nibbles -> W2 codes 0..3 = {-4, -1, +1, +4}."""
    big = (nibbles & 7) >= 5
    negative = nibbles >= 8
    return torch.where(negative, torch.where(big, 0, 1), torch.where(big, 3, 2)).to(torch.uint8)


def tier_rows(geometry: MoEGeometry, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(W2 rows uint8 [L, E, w2 slot bytes], FP4 rows uint8 [L, E, fp4 slot bytes]) of the same experts."""
    gen = torch.Generator().manual_seed(seed)
    h, i = geometry.hidden, geometry.expert_inter
    w2_layout, fp4_layout = w2_slot_layout(h, i), fp4_slot_layout(h, i)
    shape = (geometry.num_moe_layers, geometry.num_experts)
    w2_rows = torch.zeros(*shape, w2_layout.slot_bytes, dtype=torch.uint8)
    fp4_rows = torch.zeros(*shape, fp4_layout.slot_bytes, dtype=torch.uint8)
    for layer in range(shape[0]):
        for expert in range(shape[1]):
            nibbles, scales = [], []
            for n, k in ((2 * i, h), (h, i)):
                nibbles.append(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8))
                scales.append(torch.randint(119, 123, (n, k // 32), generator=gen, dtype=torch.uint8))
            w2_rows[layer, expert] = pack_slot(w2_layout, nibbles_to_codes(nibbles[0]), scales[0],
                                               nibbles_to_codes(nibbles[1]), scales[1])
            fp4_rows[layer, expert] = pack_slot(fp4_layout, nibbles[0], scales[0], nibbles[1], scales[1])
    return w2_rows, fp4_rows


def tiered(geometry: MoEGeometry, rows: tuple[torch.Tensor, torch.Tensor], *, pool_slots: int, fp4_slots: int,
           **config) -> TieredRuntime:
    w2_rows, fp4_rows = rows
    return TieredRuntime(geometry, MemoryRowSource(w2_rows), pool_slots=pool_slots,
                         fp4_source=MemoryRowSource(fp4_rows), fp4_slots=fp4_slots,
                         config=RuntimeConfig(kpi_every=0, **config))


def assert_fp4_coherent(runtime: TieredRuntime, fp4_rows: torch.Tensor) -> None:
    """Under the tier's lock: table == mirror == owners == policy, and every mapped slot holds its host row."""
    tier = runtime.fp4
    with tier.lock:
        tier.pool.check_coherent()
        for layer, expert in tier.pool.resident_keys():
            row = fp4_rows[layer, expert]
            slot = tier.pool.slot_of((layer, expert))
            assert torch.equal(tier.pool.slots[slot, :row.numel()].cpu(), row), f"FP4 slot of {(layer, expert)} is stale"


def routing_counts(*keys, shape: tuple[int, int] = (2, 8)) -> np.ndarray:
    """int32 [L, E] routing counts of one window: +1 per (layer, expert) key, repeats counted."""
    counts = np.zeros(shape, dtype=np.int32)
    for key in keys:
        counts[key] += 1
    return counts


def decode_inputs(geometry: MoEGeometry, steps: int, seed: int = 0) -> list[torch.Tensor]:
    """One [1, H] hidden-state row per decode step, seeded."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, geometry.hidden, generator=gen) for _ in range(steps)]
