"""Pack rows in the kernels' slot layout, so that fetching an expert is a plain copy of its row
into a device slot (no repacking on the fetch path).

`KernelSlotCodec` plugs into `tierstore.io.pack_build` as its row codec: tier `base` rows are
W2 slots (`tierstore.kernels.layout.w2_slot_layout`), tier `fp4` rows are FP4 slots. The pack
identity carries the quantizer ABI and a digest of the kernels' ABI tag, so a layout change makes
every old pack stale.
"""

from __future__ import annotations

import hashlib

import torch

from tierstore.errors import PackFormatError
from tierstore.formats import W2_ABI_TAG, W2Tensor
from tierstore.geometry import MoEGeometry
from tierstore.io.layout import RowSegment
from tierstore.kernels.layout import ABI_TAG as KERNEL_ABI_TAG
from tierstore.kernels.layout import SlotLayout, fp4_slot_layout, pack_slot, w2_slot_layout


def slot_layout(tag: str, hidden: int, inter: int) -> SlotLayout:
    """The kernels' slot layout of pack tier `tag` (`base` = W2, `fp4` = FP4)."""
    if tag == "base":
        return w2_slot_layout(hidden, inter)
    if tag == "fp4":
        return fp4_slot_layout(hidden, inter)
    raise PackFormatError(f"unknown pack tag {tag!r}; the kernel slot codec knows base and fp4")


class KernelSlotCodec:
    """Row codec whose rows are byte-identical to the kernels' expert slots."""

    @property
    def abi_tag(self) -> str:
        digest = hashlib.sha256(KERNEL_ABI_TAG.encode()).hexdigest()[:16]
        return f"{W2_ABI_TAG}+kslot-{digest}"

    def segments(self, tag: str, geometry: MoEGeometry) -> tuple[RowSegment, ...]:
        try:
            layout = slot_layout(tag, geometry.hidden, geometry.expert_inter)
        except ValueError as exc:
            raise PackFormatError(f"{geometry.name}: {exc}") from None
        w13, w2 = layout.w13, layout.w2
        return (
            RowSegment("w13.words", layout.w13_words_offset, w13.word_bytes, (w13.n, 4 * w13.words_per_row)),
            RowSegment("w13.scales", layout.w13_scales_offset, w13.scale_bytes, (w13.n, w13.blocks_per_row)),
            RowSegment("w2.words", layout.w2_words_offset, w2.word_bytes, (w2.n, 4 * w2.words_per_row)),
            RowSegment("w2.scales", layout.w2_scales_offset, w2.scale_bytes, (w2.n, w2.blocks_per_row)),
        )

    def encode(self, tag: str, segments: tuple[RowSegment, ...], w13: W2Tensor, w2: W2Tensor) -> torch.Tensor:
        """uint8 CPU tensor [row_bytes]: one expert's slot up to the end of its last section (the
        slot's trailing alignment padding is never read, so it is not stored)."""
        (inter2, hidden), inter = w13.shape, w2.shape[1]
        layout = slot_layout(tag, hidden, inter2 // 2)
        if w2.shape != (hidden, inter) or inter2 != 2 * inter:
            raise PackFormatError(f"w13 {w13.shape} and w2 {w2.shape} are not one expert's [2I, H] and [H, I]")
        values = (lambda t: t.unpacked_codes()) if tag == "base" else (lambda t: t.nibbles())
        w13, w2 = w13.to("cpu"), w2.to("cpu")
        slot = pack_slot(layout, values(w13), w13.scale_bytes(), values(w2), w2.scale_bytes())
        end = segments[-1].offset + segments[-1].nbytes
        if end > slot.numel() or segments[-1].offset != layout.w2_scales_offset:
            raise PackFormatError(f"row segments (ending at {end}) do not match the {slot.numel()}-byte slot")
        return slot[:end]


KERNEL_SLOT_CODEC = KernelSlotCodec()
