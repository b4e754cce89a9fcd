"""Synthetic expert rows for benchmarks: a few random experts in kernel slot layout, tiled over
every (layer, expert). Timings do not depend on the bytes, and generating a few experts instead
of every one keeps a pack build at the speed of the disk."""

from __future__ import annotations

import torch

from tierstore.geometry import MoEGeometry
from tierstore.kernels.layout import fp4_slot_layout, pack_slot, w2_slot_layout


def random_experts(geometry: MoEGeometry, fp4: bool, count: int, seed: int = 0) -> torch.Tensor:
    """uint8 [count, slot bytes]: codes (W2) or nibbles (FP4) uniform, scale bytes 119..122."""
    h, i = geometry.hidden, geometry.expert_inter
    layout = fp4_slot_layout(h, i) if fp4 else w2_slot_layout(h, i)
    gen = torch.Generator().manual_seed(seed)
    experts = []
    for _ in range(count):
        parts = []
        for n, k in ((2 * i, h), (h, i)):
            parts.append(torch.randint(0, 16 if fp4 else 4, (n, k), generator=gen, dtype=torch.uint8))
            parts.append(torch.randint(119, 123, (n, k // 32), generator=gen, dtype=torch.uint8))
        experts.append(pack_slot(layout, *parts))
    return torch.stack(experts)


def tiled_rows(geometry: MoEGeometry, fp4: bool, distinct: int = 4, seed: int = 0) -> torch.Tensor:
    """uint8 [L, E, slot bytes]: row (l, e) is random expert (l * E + e) % distinct."""
    shape = (geometry.num_moe_layers, geometry.num_experts)
    index = torch.arange(shape[0] * shape[1]) % distinct
    return random_experts(geometry, fp4, distinct, seed)[index].view(*shape, -1)
