"""Random tiered expert pools for the kernel tests and the kernel benchmark."""

from __future__ import annotations

import torch

from tierstore.kernels.layout import pack_slot


def random_expert(hidden: int, inter: int, fp4: bool, gen: torch.Generator):
    """Unpacked (w13 values, w13 scales, w2 values, w2 scales) with scales near 2^0."""
    levels = 16 if fp4 else 4

    def matrix(n, k):
        values = torch.randint(0, levels, (n, k), dtype=torch.uint8, generator=gen)
        scales = torch.randint(121, 126, (n, k // 32), dtype=torch.uint8, generator=gen)
        return values, scales

    return (*matrix(2 * inter, hidden), *matrix(hidden, inter))


def fill_pool(pool, gen: torch.Generator, fp4: bool) -> None:
    """Writes a fresh random expert into every slot of `pool` (a kernels.TierPool)."""
    for slot in range(pool.slots.shape[0]):
        expert = random_expert(pool.layout.hidden, pool.layout.inter, fp4, gen)
        pool.slots[slot] = pack_slot(pool.layout, *expert).to(pool.slots.device)


def random_routing(num_tokens: int, top_k: int, num_experts: int, gen: torch.Generator, device):
    """Distinct experts per token; weights in (0, 1]."""
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]).to(torch.int32)
    weights = torch.rand(num_tokens, top_k, generator=gen) + 0.05
    return ids.to(device), weights.to(device)
