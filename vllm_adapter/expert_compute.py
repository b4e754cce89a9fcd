"""How a layer whose experts are all resident is computed, on CPU and on CUDA.

Both backends keep the layer's experts as a slot pool (a tuple of tensors whose first dimension
is the expert) served through the slot table int32 [1, E] (slot e = expert e).

* `ReferenceBackend` (CPU): slots hold the W2 values dequantized to float32; tierstore's
  reference MoE computes the layer.
* `KernelBackend` (CUDA): slots hold the kernels' packed W2 slot bytes; `tierstore.kernels.moe_mm`
  computes the layer (capture-safe: static workspaces per batch shape, no host sync). With the CUDA_W2
  knob it hands moe_mm the CUDA C++ whole op for the batch sizes the runtime's rule gives it
  (`tierstore.runtime.compute.cuda_w2_block_tokens`: decode and prefill batches up to 64 pairs per expert).

With an expert cache (BASE_CACHE_GB) or an FP4 pool (DELTA_GB) layers go through
`tierstore.vllm_adapter.tiered` instead.
"""

from __future__ import annotations

import torch

from tierstore.errors import ConfigError
from tierstore.formats import W2Tensor
from tierstore.kernels.layout import fp4_slot_layout, pack_slot, unpack_matrix_ref, w2_slot_layout
from tierstore.reference_moe import ExpertPool, ExpertTier, reference_moe


def w2_slot_bytes(hidden: int, inter: int) -> int:
    """Device bytes of one expert at the 2-bit base (the unit that sizes the expert cache)."""
    return w2_slot_layout(hidden, inter).slot_bytes


def w2_slot_row(w13: W2Tensor, w2: W2Tensor) -> torch.Tensor:
    """One expert (w13 [2I, H], w2 [H, I]) as the kernels' W2 slot bytes uint8 [slot_bytes]."""
    layout = w2_slot_layout(w13.shape[1], w2.shape[1])
    return pack_slot(layout, w13.unpacked_codes(), w13.scale_bytes(), w2.unpacked_codes(), w2.scale_bytes())


def fp4_slot_row(w13: W2Tensor, w2: W2Tensor) -> torch.Tensor:
    """The same expert at the FP4 tier (its e2m1 nibbles, same scales) as the kernels' FP4 slot
    bytes uint8 [fp4 slot_bytes]: what the FP4 pool holds."""
    layout = fp4_slot_layout(w13.shape[1], w2.shape[1])
    return pack_slot(layout, w13.nibbles(), w13.scale_bytes(), w2.nibbles(), w2.scale_bytes())


class ReferenceBackend:
    name = "reference"

    def __init__(self, hidden: int, inter: int, num_experts: int):
        self.layout = w2_slot_layout(hidden, inter)

    def expert_rows(self, w13: W2Tensor, w2: W2Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return w13.dequantize().to(torch.float32), w2.dequantize().to(torch.float32)  # [2I, H], [H, I]

    def rows_from_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Kernel slot bytes uint8 [E, slot_bytes] (e.g. from a pack) -> (w13 [E, 2I, H], w2 [E, H, I])."""
        return (torch.stack([unpack_matrix_ref(s, self.layout, "w13") for s in slots]),
                torch.stack([unpack_matrix_ref(s, self.layout, "w2") for s in slots]))

    def run(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, table: torch.Tensor,
            slots: tuple[torch.Tensor, ...], swiglu_limit: float | None) -> torch.Tensor:
        """x [T, H], topk [T, k] -> [T, H] in x's dtype."""
        tier = ExpertTier("w2", table, ExpertPool(*slots))
        return reference_moe(x, topk_ids, topk_weights, layer=0, tiers=[tier], swiglu_limit=swiglu_limit).output.to(x.dtype)


_CUDA_W2: dict[tuple, object] = {}  # (hidden, inter, device) -> the CUDA whole op, built once per process


def cuda_w2_kernels(hidden: int, inter: int, device: torch.device):
    """The CUDA C++ whole op for resident W2 layers of this shape (`load_cuda_w2`: ConfigError naming what is
    missing), built on the first call and shared by every layer after it."""
    from tierstore.runtime.compute import load_cuda_w2

    key = (hidden, inter, str(device))
    if key not in _CUDA_W2:
        _CUDA_W2[key] = load_cuda_w2(w2_slot_layout(hidden, inter), None, device)
    return _CUDA_W2[key]


class KernelBackend:
    name = "kernels"

    def __init__(self, hidden: int, inter: int, num_experts: int, cuda_w2=None):
        """cuda_w2: the CUDA whole op (`cuda_w2_kernels`), or None for the Triton stages at every batch size."""
        self.hidden, self.inter, self.num_experts = hidden, inter, num_experts
        self.layout = w2_slot_layout(hidden, inter)
        self.cuda_w2 = cuda_w2
        self._fp4_tier = self._misses = None
        self._workspaces: dict[tuple, tuple] = {}

    def expert_rows(self, w13: W2Tensor, w2: W2Tensor) -> tuple[torch.Tensor]:
        return (w2_slot_row(w13, w2),)  # uint8 [slot_bytes]

    def rows_from_slots(self, slots: torch.Tensor) -> tuple[torch.Tensor]:
        return (slots,)

    def run(self, x, topk_ids, topk_weights, table, slots, swiglu_limit) -> torch.Tensor:
        from tierstore.kernels import MissLog, MoeWorkspace, TierPool, fp4_tier, moe_mm
        from tierstore.runtime.compute import cuda_w2_block_tokens

        if self._fp4_tier is None:  # an empty FP4 tier (DELTA_GB layers go through the runtime) and a miss log
            self._fp4_tier = fp4_tier(self.hidden, self.inter, 0, 1, self.num_experts, x.device)
            self._misses = MissLog.allocate(self.num_experts, x.device)
        key = (x.shape[0], topk_ids.shape[1], x.dtype)
        if key not in self._workspaces:
            block_tokens = (cuda_w2_block_tokens(x.shape[0] * topk_ids.shape[1], self.num_experts)
                            if self.cuda_w2 is not None else None)
            workspace = MoeWorkspace.allocate(x.shape[0], topk_ids.shape[1], self.num_experts, self.hidden,
                                              self.inter, x.dtype, x.device, block_tokens=block_tokens)
            self._workspaces[key] = (workspace, self.cuda_w2 if block_tokens is not None else None)
        workspace, cuda_w2 = self._workspaces[key]
        if cuda_w2 is not None and x.dtype != torch.bfloat16:
            raise ConfigError(f"CUDA_W2=1 needs bfloat16 hidden states, got {x.dtype}; unset the knob")
        base = TierPool(slots[0], table, self.layout)
        return moe_mm(x.contiguous(), topk_ids.to(torch.int32).contiguous(), topk_weights.contiguous(), base,
                      self._fp4_tier, 0, self._misses, workspace, swiglu_limit=swiglu_limit, cuda_w2=cuda_w2)
