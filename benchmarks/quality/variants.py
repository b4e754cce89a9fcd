"""Expert weights of each precision, from the NVFP4 checkpoint through tierstore's formats.

Per checkpoint tensor (one expert's gate, up or down projection, float64 exact from NVFP4):
- `fp4_checkpoint`: the checkpoint's own values (the reference);
- `fp4_tier`: tierstore's FP4 tier (the W2 requant's e2m1 nibbles with UE8M0 block-32 scales);
- `w2_sym`: the 2-bit base as served, levels {-4, -1, 1, 4};
- `w2_asym`: the same nibbles and scales mapped to the tensor's L2-optimal 4 levels (the
  sign-asymmetric control, an experiment path, never served).
The per-tensor codebook report comes from the same W2 requant.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tierstore.checkpoint import open_checkpoint
from tierstore.formats import W2_BLOCK, codebook_report, quantize_w2
from tierstore.formats.codebook import assign_levels
from tierstore.formats.fp_codecs import e8m0_scales

PRECISIONS = ("fp4_checkpoint", "fp4_tier", "w2_sym", "w2_asym")
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def w2_with_levels(w2, levels: tuple[float, ...]) -> torch.Tensor:
    """float64 [N, K]: each nibble's nearest level in `levels` (codebook tie rules) times its block scale."""
    table = assign_levels(torch.tensor([levels], dtype=torch.float64))[0]  # [16] level per nibble
    scales = e8m0_scales(w2.scale_bytes(), "scale_bytes").repeat_interleave(W2_BLOCK, dim=1)  # [N, K]
    return table[w2.nibbles().long()] * scales


def tensor_variants(weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict]:
    """({precision: float64 [N, K]}, codebook report) of one checkpoint tensor."""
    w2 = quantize_w2(weight)
    report = codebook_report(w2)
    values = {"fp4_checkpoint": weight, "fp4_tier": w2.dequantize_fp4(), "w2_sym": w2.dequantize(),
              "w2_asym": w2_with_levels(w2, report["asym"]["levels"])}
    return values, report


class CheckpointExperts:
    """Every expert tensor of an NVFP4 checkpoint in every precision, stacked per layer in `dtype`.

    `stacked[precision][layer]` = (gate_up [E, 2I, H], down [E, H, I]); `reports` has one
    codebook report per tensor, labelled with layer (dense MoE index), expert and projection.
    """

    def __init__(self, path: Path, dtype: torch.dtype, device: torch.device):
        self.stacked: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {p: [] for p in PRECISIONS}
        self.reports: list[dict] = []
        with open_checkpoint(path) as ckpt:
            if ckpt.source_format != "nvfp4":
                raise ValueError(f"{path}: experts are {ckpt.source_format}, the quality lab expects nvfp4")
            inter = ckpt.geometry.expert_inter
            for layer in ckpt.iter_layers():
                per_precision = {p: ([], []) for p in PRECISIONS}
                for weights in layer.experts:
                    w13 = weights.w13.dequantize()  # [2I, H] gate rows, then up rows
                    matrices = {"gate_proj": w13[:inter], "up_proj": w13[inter:], "down_proj": weights.w2.dequantize()}
                    parts = {p: {} for p in PRECISIONS}
                    for projection, matrix in matrices.items():
                        values, report = tensor_variants(matrix)
                        self.reports.append({"layer": layer.index, "expert": weights.expert,
                                             "projection": projection, **report})
                        for precision, value in values.items():
                            parts[precision][projection] = value
                    for precision, mats in parts.items():
                        gate_up = torch.cat([mats["gate_proj"], mats["up_proj"]], dim=0)
                        per_precision[precision][0].append(gate_up.to(dtype))
                        per_precision[precision][1].append(mats["down_proj"].to(dtype))
                for precision, (gate_ups, downs) in per_precision.items():
                    self.stacked[precision].append((torch.stack(gate_ups).to(device), torch.stack(downs).to(device)))
