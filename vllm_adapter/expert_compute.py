"""How one MoE layer's routed experts are computed from device slots, on CPU and on CUDA.

Both backends hold experts in a slot pool (a tuple of tensors whose first dimension is the slot)
and serve a layer through a slot table int32 [1, E] (-1 = not resident). A routed pair whose
expert has no slot contributes exactly zero and is reported as missing.

* `ReferenceBackend` (CPU): slots hold the W2 values dequantized to float32; tierstore's
  reference MoE computes the layer.
* `KernelBackend` (CUDA): slots hold the kernels' packed W2 slot bytes; `tierstore.kernels.moe_mm`
  computes the layer (capture-safe, misses logged on the device).
"""

from __future__ import annotations

import torch

from tierstore.formats import W2Tensor
from tierstore.kernels.layout import w2_slot_layout
from tierstore.reference_moe import ExpertPool, ExpertTier, reference_moe


def w2_slot_bytes(hidden: int, inter: int) -> int:
    """Device bytes of one expert at the 2-bit base (the unit that sizes the expert cache)."""
    return w2_slot_layout(hidden, inter).slot_bytes


class ReferenceBackend:
    name = "reference"

    def __init__(self, hidden: int, inter: int):
        self.hidden, self.inter = hidden, inter

    def expert_rows(self, w13: W2Tensor, w2: W2Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return w13.dequantize().to(torch.float32), w2.dequantize().to(torch.float32)  # [2I, H], [H, I]

    def empty_slots(self, num_slots: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.zeros(num_slots, 2 * self.inter, self.hidden, device=device),  # [S, 2I, H]
                torch.zeros(num_slots, self.hidden, self.inter, device=device))  # [S, H, I]

    def run(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, table: torch.Tensor,
            slots: tuple[torch.Tensor, ...], swiglu_limit: float | None) -> tuple[torch.Tensor, list[int], int]:
        """(output [T, H] in x's dtype, sorted missing local expert ids, missing pairs)."""
        tier = ExpertTier("w2", table, ExpertPool(*slots))
        result = reference_moe(x, topk_ids, topk_weights, layer=0, tiers=[tier], swiglu_limit=swiglu_limit)
        return result.output.to(x.dtype), [expert for _, expert in result.missing_experts], result.missing_pairs


class KernelBackend:
    name = "kernels"

    def __init__(self, hidden: int, inter: int, num_experts: int):
        self.hidden, self.inter, self.num_experts = hidden, inter, num_experts
        self.layout = w2_slot_layout(hidden, inter)
        self._fp4_tier = None
        self._workspaces: dict[tuple, object] = {}

    def expert_rows(self, w13: W2Tensor, w2: W2Tensor) -> tuple[torch.Tensor]:
        from tierstore.kernels.layout import pack_slot

        return (pack_slot(self.layout, w13.unpacked_codes(), w13.scale_bytes(), w2.unpacked_codes(),
                          w2.scale_bytes()),)  # uint8 [slot_bytes]

    def empty_slots(self, num_slots: int, device: torch.device) -> tuple[torch.Tensor]:
        return (torch.zeros(num_slots, self.layout.slot_bytes, dtype=torch.uint8, device=device),)

    def miss_log(self, device: torch.device):
        from tierstore.kernels import MissLog

        return MissLog.allocate(self.num_experts, device)

    def run(self, x, topk_ids, topk_weights, table, slots, swiglu_limit, misses) -> torch.Tensor:
        """Output [T, H]; missing pairs are counted in `misses` on the device (no host sync)."""
        from tierstore.kernels import MoeWorkspace, TierPool, fp4_tier, moe_mm

        if self._fp4_tier is None:  # no FP4 slots until the tiered runtime promotes into them
            self._fp4_tier = fp4_tier(self.hidden, self.inter, 0, 1, self.num_experts, x.device)
        key = (x.shape[0], topk_ids.shape[1], x.dtype)
        if key not in self._workspaces:
            self._workspaces[key] = MoeWorkspace.allocate(x.shape[0], topk_ids.shape[1], self.num_experts,
                                                          self.hidden, self.inter, x.dtype, x.device)
        base = TierPool(slots[0], table, self.layout)
        return moe_mm(x.contiguous(), topk_ids.to(torch.int32).contiguous(), topk_weights.contiguous(), base,
                      self._fp4_tier, 0, misses, self._workspaces[key], swiglu_limit=swiglu_limit)
