"""Routed-expert compute over the device pool, one MoE layer per call.

Two backends with the same contract: weights come from the FP4 pool's slot when the expert has one,
else from the base pool's, through their slot tables; a pair whose expert has neither contributes
exactly zero and is logged in the PassLog;
the top-k combine runs in a fixed order, so a token's result does not depend on other tokens.

- `TorchExperts`: plain torch (float32) decoding the same slot bytes with the kernels' reference
  decoder; the CPU variant of the runtime (no sync-free guarantee: it reads the table on the host).
- `TritonExperts`: `tierstore.kernels.moe_mm` (route, gate_up, down, combine), capture-safe.
"""

from __future__ import annotations

import torch

from tierstore.kernels.layout import SlotLayout, unpack_matrix_ref
from tierstore.reference_moe import swiglu
from tierstore.runtime.passlog import PassLog
from tierstore.runtime.pools import DevicePool


class TorchExperts:
    def __init__(self, pool: DevicePool, layout: SlotLayout, log: PassLog, swiglu_limit: float | None,
                 fp4_pool: DevicePool | None = None, fp4_layout: SlotLayout | None = None):
        self.pool, self.layout, self.log, self.swiglu_limit = pool, layout, log, swiglu_limit
        self.tiers = [(pool, layout)] + ([(fp4_pool, fp4_layout)] if fp4_pool is not None else [])
        self._decoded: dict[tuple[int, int], tuple[int, torch.Tensor, torch.Tensor]] = {}  # (tier, slot) -> (gen, w13, w2)

    def _weights(self, tier: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool, layout = self.tiers[tier]
        generation = int(pool.generation[slot])
        cached = self._decoded.get((tier, slot))
        if cached is None or cached[0] != generation:
            raw = pool.slots[slot]
            cached = (generation, unpack_matrix_ref(raw, layout, "w13"), unpack_matrix_ref(raw, layout, "w2"))
            self._decoded[(tier, slot)] = cached
        return cached[1], cached[2]  # [2I, H], [H, I] float32

    def _slots(self, layer: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(tier int64 [T, k], slot int64 [T, k]); tier 1 = FP4 where resident, slot -1 = miss."""
        slots = self.pool.table[layer].to(torch.int64)[ids]  # [T, k]
        tiers = torch.zeros_like(slots)
        if len(self.tiers) > 1:
            fp4 = self.tiers[1][0].table[layer].to(torch.int64)[ids]  # [T, k]
            tiers = (fp4 >= 0).to(torch.int64)
            slots = torch.where(fp4 >= 0, fp4, slots)
        return tiers, slots

    def __call__(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        x = hidden.to(torch.float32)  # [T, H]
        ids = topk_ids.to(torch.int64)  # [T, k]
        tokens, top_k = ids.shape
        self.log.record(layer, ids)
        tiers, slots = self._slots(layer, ids)  # [T, k], slot -1 = miss
        missing = slots < 0
        self._log_misses(layer, ids[missing])
        pair_out = torch.zeros(tokens, top_k, x.shape[1], dtype=torch.float32, device=x.device)  # [T, k, H]
        stride = max(pool.num_slots for pool, _ in self.tiers)
        tier_slot = tiers * stride + slots  # [T, k], one id per (tier, slot)
        for both in tier_slot[~missing].unique().tolist():
            rows, cols = (tier_slot == both).nonzero(as_tuple=True)
            w13, w2 = self._weights(*divmod(both, stride))
            pair_out[rows, cols] = swiglu(x[rows] @ w13.T, self.swiglu_limit) @ w2.T  # [n, H]
        weights = topk_weights.to(torch.float32).masked_fill(missing, 0.0)  # [T, k]
        out = torch.zeros_like(x)  # [T, H]
        for j in range(top_k):
            out += weights[:, j:j + 1] * pair_out[:, j]
        return out.to(hidden.dtype)

    def _log_misses(self, layer: int, missing_ids: torch.Tensor) -> None:
        if missing_ids.numel() == 0:
            return
        experts = missing_ids.unique()  # sorted
        first = int(self.log.counts[1])
        room = max(0, min(experts.numel(), self.log.entries.shape[0] - first))
        self.log.entries[first:first + room, 0] = layer
        self.log.entries[first:first + room, 1] = experts[:room].to(torch.int32)
        self.log.counts[0] += missing_ids.numel()
        self.log.counts[1] += experts.numel()


class TritonExperts:
    def __init__(self, pool: DevicePool, layout: SlotLayout, log: PassLog, swiglu_limit: float | None,
                 fp4_pool: DevicePool | None = None, fp4_layout: SlotLayout | None = None):
        from tierstore.kernels.moe_mm import MissLog, TierPool, fp4_tier

        self.log, self.swiglu_limit = log, swiglu_limit
        self.w2_pool = TierPool(pool.slots, pool.table, layout)
        if fp4_pool is None:  # the kernels always take an FP4 tier: an empty one
            self.fp4_pool = fp4_tier(layout.hidden, layout.inter, 1, pool.num_layers, pool.num_experts, pool.device)
        else:
            self.fp4_pool = TierPool(fp4_pool.slots, fp4_pool.table, fp4_layout)
        self.misses = MissLog(log.counts, log.entries)
        self.num_experts = pool.num_experts
        self._workspaces: dict = {}

    def _workspace(self, tokens: int, top_k: int, dtype: torch.dtype):
        from tierstore.kernels.moe_mm import MoeWorkspace

        key = (tokens, top_k, dtype)
        if key not in self._workspaces:
            layout = self.w2_pool.layout
            self._workspaces[key] = MoeWorkspace.allocate(tokens, top_k, self.num_experts, layout.hidden, layout.inter,
                                                          dtype, self.w2_pool.slots.device)
        return self._workspaces[key]

    def __call__(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        from tierstore.kernels.moe_mm import moe_mm

        ids = topk_ids.to(torch.int32).contiguous()  # [T, k]
        self.log.record(layer, ids)
        workspace = self._workspace(ids.shape[0], ids.shape[1], hidden.dtype)
        return moe_mm(hidden.contiguous(), ids, topk_weights.to(torch.float32).contiguous(), self.w2_pool,
                      self.fp4_pool, layer, self.misses, workspace, swiglu_limit=self.swiglu_limit)
