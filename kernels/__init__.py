"""GPU kernels for tierstore (installed as `tierstore.kernels`). Depends on torch and triton only."""

import importlib.util

from .layout import ABI_TAG, SlotLayout, fp4_slot_layout, pack_slot, unpack_matrix_ref, w2_slot_layout

HAS_TRITON = importlib.util.find_spec("triton") is not None

__all__ = ["ABI_TAG", "HAS_TRITON", "SlotLayout", "fp4_slot_layout", "pack_slot", "unpack_matrix_ref", "w2_slot_layout"]

if HAS_TRITON:
    from .confidence import confidence, confidence_ref  # noqa: F401  (the gate's signal on the device)
    from .moe_mm import (MissLog, MoeWorkspace, TierPool, fp4_tier, moe_combine, moe_down,
                         moe_gate_up, moe_mm, moe_mm_ref, moe_route, moe_route_ref, route_blocks, w2_tier)

    __all__ += ["MissLog", "MoeWorkspace", "TierPool", "fp4_tier", "moe_combine", "moe_down",
                "moe_gate_up", "moe_mm", "moe_mm_ref", "moe_route", "moe_route_ref", "route_blocks", "w2_tier"]
