"""A training-friendly forward for transformers' stacked MoE experts: one padded batched matmul
per projection instead of a Python loop over experts.

transformers >= 5 keeps a layer's experts as `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]
and calls `experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])`. Its grouped_mm path
needs bf16 weights on CUDA, which fp32 master weights under autocast are not; torch.bmm autocasts,
runs on CPU too, and is deterministic (the combine is a fixed-order sum, no atomics).
"""

from __future__ import annotations

import types

import torch
from torch import nn


def padded_experts_forward(experts: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor) -> torch.Tensor:
    """Same result as transformers' eager experts forward, computed as [E, capacity, *] bmm."""
    num_tokens, top_k = top_k_index.shape
    num_experts, _, hidden_dim = experts.gate_up_proj.shape
    flat_expert = top_k_index.reshape(-1)  # [T*k]
    order = torch.argsort(flat_expert, stable=True)  # [T*k] pairs grouped by expert
    counts = torch.bincount(flat_expert, minlength=num_experts)  # [E]
    capacity = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts  # [E]
    sorted_expert = flat_expert[order]  # [T*k]
    slot = torch.arange(order.numel(), device=order.device) - starts[sorted_expert]  # [T*k] row within expert
    token = order // top_k  # [T*k]
    grouped = hidden.new_zeros(num_experts, capacity, hidden_dim)  # [E, C, H]
    grouped = grouped.index_put((sorted_expert, slot), hidden[token])
    gate, up = torch.bmm(grouped, experts.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [E, C, I] each
    projected = torch.bmm(experts.act_fn(gate) * up, experts.down_proj.transpose(1, 2))  # [E, C, H]
    pair_out = projected[sorted_expert, slot] * top_k_weights.reshape(-1)[order, None].to(projected.dtype)
    unsorted = pair_out[torch.argsort(order)]  # [T*k, H] back in (token, k) order
    return unsorted.view(num_tokens, top_k, hidden_dim).sum(dim=1).to(hidden.dtype)  # [T, H]


def use_padded_experts(model: nn.Module) -> int:
    """Route every stacked-experts module of `model` through `padded_experts_forward`; returns how many.

    Only the forward is replaced (an instance attribute), so parameter names and saving are unchanged.
    """
    count = 0
    for module in model.modules():
        if isinstance(getattr(module, "gate_up_proj", None), nn.Parameter) and module.gate_up_proj.dim() == 3:
            module.forward = types.MethodType(padded_experts_forward, module)
            count += 1
    if count == 0:
        raise RuntimeError(f"{type(model).__name__} has no stacked experts (gate_up_proj [E, 2I, H]); "
                           "transformers >= 5 is required")
    return count
