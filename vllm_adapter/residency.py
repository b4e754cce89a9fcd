"""Every local expert of a layer resident on the device: the default when no expert cache is set."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerSlots:
    """A layer's slot pool (tensors whose first dimension is the slot) and its slot table."""

    table: torch.Tensor  # [1, E] int32; slot e holds expert e
    slots: tuple[torch.Tensor, ...]  # each [E, ...]


def resident_layer(rows: Sequence[torch.Tensor], device: torch.device) -> LayerSlots:
    num_experts = rows[0].shape[0]
    table = torch.arange(num_experts, dtype=torch.int32, device=device).view(1, num_experts)
    return LayerSlots(table, tuple(r.to(device) for r in rows))
