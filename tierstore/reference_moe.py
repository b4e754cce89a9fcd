"""The plain-torch reference MoE: the oracle every kernel and the runtime are checked against.

Experts are SwiGLU MLPs held in slot pools; a tier is a pool plus a slot table
`[layers, E]` int32 (`-1` = absent). For each routed pair the first tier (in the order given,
e.g. FP4 before W2) that holds the expert serves it; a pair no tier holds is a miss: it
contributes exactly zero and is counted. Arithmetic is float32 and the weighted combine over
the top-k runs in a fixed order (j = 0, 1, ..., k-1), so the result does not depend on which
experts share a batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tierstore.errors import FormatError


@dataclass(frozen=True)
class ExpertPool:
    """Expert weights by slot, dequantized to float32 (exact for bf16, FP4 and W2 values)."""

    w13: torch.Tensor  # [S, 2I, H], gate rows [0, I) then up rows [I, 2I)
    w2: torch.Tensor  # [S, H, I]

    def __post_init__(self) -> None:
        if self.w13.dim() != 3 or self.w2.dim() != 3:
            raise FormatError(f"pool tensors must be 3-D, got w13 {tuple(self.w13.shape)} and w2 {tuple(self.w2.shape)}")
        slots, two_inter, hidden = self.w13.shape
        if two_inter % 2 or self.w2.shape != (slots, hidden, two_inter // 2):
            raise FormatError(
                f"pool shapes disagree: w13 {tuple(self.w13.shape)} needs w2 {(slots, hidden, two_inter // 2)}, "
                f"got {tuple(self.w2.shape)}"
            )

    @property
    def num_slots(self) -> int:
        return self.w13.shape[0]

    @classmethod
    def from_experts(cls, experts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> ExpertPool:
        """One slot per (w13 [2I, H], w2 [H, I]) pair, in the order given."""
        if not experts:
            raise FormatError("an expert pool needs at least one expert")
        w13 = torch.stack([e[0].to(torch.float32) for e in experts])
        w2 = torch.stack([e[1].to(torch.float32) for e in experts])
        return cls(w13=w13, w2=w2)


@dataclass(frozen=True)
class ExpertTier:
    """A pool and the slot table that maps (layer, expert) to its slots."""

    name: str
    table: torch.Tensor  # [layers, E] int32, -1 = absent
    pool: ExpertPool

    def __post_init__(self) -> None:
        if self.table.dim() != 2 or self.table.dtype != torch.int32:
            raise FormatError(f"tier {self.name!r}: slot table must be int32 [layers, E], got {self.table.dtype} {tuple(self.table.shape)}")
        bad = (self.table >= self.pool.num_slots) | (self.table < -1)
        if bool(bad.any()):
            layer, expert = (int(v) for v in bad.nonzero()[0])
            raise FormatError(
                f"tier {self.name!r}: table[{layer}, {expert}] = {int(self.table[layer, expert])} "
                f"is outside the pool's {self.pool.num_slots} slots"
            )


@dataclass(frozen=True)
class DenseMLP:
    """A shared expert: a plain SwiGLU MLP outside the tiering, optionally scaled by a sigmoid gate."""

    w13: torch.Tensor  # [2I_s, H]
    w2: torch.Tensor  # [H, I_s]
    gate: torch.Tensor | None = None  # [1, H] (Qwen2-MoE's shared_expert_gate)


@dataclass(frozen=True)
class ReferenceMoEOutput:
    output: torch.Tensor  # [T, H] float32
    served_by: torch.Tensor  # [T, k] int64: index of the serving tier, -1 for a miss
    missing_pairs: int
    missing_experts: tuple[tuple[int, int], ...]  # distinct (layer, expert), sorted


def swiglu(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up on [..., 2I] -> [..., I]; with a limit, gate is clamped above at `limit`
    and up to [-limit, limit] (the checkpoint's SwiGLU clamp)."""
    inter = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :inter], gate_up[..., inter:]
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return torch.nn.functional.silu(gate) * up


def dense_mlp(hidden: torch.Tensor, mlp: DenseMLP, limit: float | None = None) -> torch.Tensor:
    x = hidden.to(torch.float32)  # [T, H]
    y = swiglu(x @ mlp.w13.to(torch.float32).T, limit) @ mlp.w2.to(torch.float32).T  # [T, H]
    if mlp.gate is not None:
        y = y * torch.sigmoid(x @ mlp.gate.to(torch.float32).T)
    return y


def reference_moe(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    layer: int,
    tiers: Sequence[ExpertTier],
    swiglu_limit: float | None = None,
    shared: DenseMLP | None = None,
) -> ReferenceMoEOutput:
    """Routed experts of one MoE layer (plus its shared expert, if given) for `hidden` [T, H].

    `tiers` are tried in order for every routed pair; the first that holds the expert serves it.
    """
    _check_inputs(hidden, topk_ids, topk_weights, layer, tiers)
    x = hidden.to(torch.float32)  # [T, H]
    tokens, top_k = topk_ids.shape
    served_by = torch.full((tokens, top_k), -1, dtype=torch.int64)
    slot_of_pair = torch.full((tokens, top_k), -1, dtype=torch.int64)
    for tier_index in reversed(range(len(tiers))):  # earlier tiers overwrite later ones
        slots = tiers[tier_index].table[layer].to(torch.int64)[topk_ids.cpu().to(torch.int64)]  # [T, k]
        present = slots >= 0
        served_by[present] = tier_index
        slot_of_pair[present] = slots[present]

    pair_out = torch.zeros(tokens, top_k, x.shape[1], dtype=torch.float32)  # [T, k, H]
    for tier_index, tier in enumerate(tiers):
        for slot in slot_of_pair[served_by == tier_index].unique().tolist():
            rows, cols = ((served_by == tier_index) & (slot_of_pair == slot)).nonzero(as_tuple=True)
            act = swiglu(x[rows] @ tier.pool.w13[slot].T, swiglu_limit)  # [n, I]
            pair_out[rows, cols] = act @ tier.pool.w2[slot].T  # [n, H]

    weights = topk_weights.to(torch.float32).cpu().masked_fill(served_by < 0, 0.0)  # [T, k]
    output = torch.zeros(tokens, x.shape[1], dtype=torch.float32)  # [T, H]
    for j in range(top_k):
        output += weights[:, j : j + 1] * pair_out[:, j]
    if shared is not None:
        output += dense_mlp(x, shared, swiglu_limit)

    missing = served_by < 0
    missing_ids = sorted({int(e) for e in topk_ids.cpu()[missing].tolist()})
    return ReferenceMoEOutput(
        output=output,
        served_by=served_by,
        missing_pairs=int(missing.sum()),
        missing_experts=tuple((layer, e) for e in missing_ids),
    )


def _check_inputs(hidden, topk_ids, topk_weights, layer, tiers) -> None:
    if hidden.dim() != 2:
        raise FormatError(f"hidden must be [T, H], got shape {tuple(hidden.shape)}")
    if topk_ids.dim() != 2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != hidden.shape[0]:
        raise FormatError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} must both be [T, k] "
            f"with T = {hidden.shape[0]}"
        )
    if topk_ids.dtype.is_floating_point:
        raise FormatError(f"topk_ids must be an integer tensor, got {topk_ids.dtype}")
    if not tiers:
        raise FormatError("reference_moe needs at least one tier")
    layers, experts = tiers[0].table.shape
    for tier in tiers:
        if tier.table.shape != (layers, experts):
            raise FormatError(f"tier {tier.name!r} table {tuple(tier.table.shape)} differs from {(layers, experts)}")
        if tier.pool.w13.shape[2] != hidden.shape[1]:
            raise FormatError(f"tier {tier.name!r} has hidden size {tier.pool.w13.shape[2]}, hidden states have {hidden.shape[1]}")
    if not 0 <= layer < layers:
        raise FormatError(f"layer {layer} is outside the slot tables' {layers} layers")
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= experts):
        raise FormatError(f"topk_ids must lie in [0, {experts}), got range [{int(topk_ids.min())}, {int(topk_ids.max())}]")
