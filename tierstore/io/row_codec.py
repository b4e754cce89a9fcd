"""The byte layout of one pack row: one routed expert's w13 [2I, H] and w2 [H, I] in a tier.

Tag `base` (the 2-bit tier), segments in this order:
  w13.codes   uint8 [2I, H/4]   four 2-bit codes per byte along K (W2Tensor.packed_codes)
  w13.scales  uint8 [2I, H/32]  UE8M0 byte per 32 weights along K
  w2.codes    uint8 [H, I/4]
  w2.scales   uint8 [H, I/32]
Tag `fp4` (the FP4 tier): the same with `nibbles` uint8 [N, K/2] (two e2m1 nibbles per byte,
even k low; W2Tensor.packed_nibbles) in place of `codes`.
Each segment starts at a multiple of 64 bytes (zero padding between), so 16-byte vector loads
from any segment are aligned. Bit order inside codes/nibbles/scales is the formats ABI
(W2_ABI_TAG), which enters the pack identity together with this layout's own version.
"""

from __future__ import annotations

from typing import Protocol

import torch

from tierstore.errors import PackFormatError
from tierstore.formats import W2_ABI_TAG, W2Tensor
from tierstore.geometry import MoEGeometry
from tierstore.io.layout import RowSegment

ROW_LAYOUT_VERSION = "row64-v1"
SEGMENT_ALIGN = 64
TAGS = ("base", "fp4")


def pack_abi_tag() -> str:
    """What enters every pack identity: the quantizer/bit-layout ABI and this row layout."""
    return f"{W2_ABI_TAG}+{ROW_LAYOUT_VERSION}"


def _payload_name(tag: str) -> str:
    if tag not in TAGS:
        raise PackFormatError(f"unknown pack tag {tag!r}; known tags: {', '.join(TAGS)}")
    return "codes" if tag == "base" else "nibbles"


def row_segments(tag: str, geometry: MoEGeometry) -> tuple[RowSegment, ...]:
    payload, per_byte = _payload_name(tag), (4 if tag == "base" else 2)
    hidden, inter = geometry.hidden, geometry.expert_inter
    segments, offset = [], 0
    for matrix, (rows, k) in (("w13", (2 * inter, hidden)), ("w2", (hidden, inter))):
        if k % 32:
            raise PackFormatError(f"{matrix}: K={k} is not a multiple of 32")
        for name, shape in ((payload, (rows, k // per_byte)), ("scales", (rows, k // 32))):
            nbytes = shape[0] * shape[1]
            segments.append(RowSegment(f"{matrix}.{name}", offset, nbytes, shape))
            offset = -(-(offset + nbytes) // SEGMENT_ALIGN) * SEGMENT_ALIGN
    return tuple(segments)


def row_bytes(segments: tuple[RowSegment, ...]) -> int:
    last = segments[-1]
    return last.offset + last.nbytes


def encode_row(tag: str, segments: tuple[RowSegment, ...], w13: W2Tensor, w2: W2Tensor) -> torch.Tensor:
    """The row as a uint8 CPU tensor [row_bytes]."""
    payload = _payload_name(tag)
    parts = {}
    for matrix, tensor in (("w13", w13), ("w2", w2)):
        tensor = tensor.to("cpu")
        parts[f"{matrix}.{payload}"] = tensor.packed_codes() if tag == "base" else tensor.packed_nibbles()
        parts[f"{matrix}.scales"] = tensor.scale_bytes()
    row = torch.zeros(row_bytes(segments), dtype=torch.uint8)
    for segment in segments:
        part = parts[segment.name]
        if tuple(part.shape) != segment.shape:
            raise PackFormatError(f"{segment.name} has shape {tuple(part.shape)}, the row layout expects {segment.shape}")
        row[segment.offset:segment.offset + segment.nbytes] = part.reshape(-1)
    return row


def decode_row(row: torch.Tensor, segments: tuple[RowSegment, ...]) -> dict[str, torch.Tensor]:
    """Views of a row's segments by name, each uint8 of its segment shape (zero-copy)."""
    if row.dtype != torch.uint8 or row.dim() != 1 or row.numel() < row_bytes(segments):
        raise PackFormatError(f"a row must be uint8 [>= {row_bytes(segments)}], got {row.dtype} {tuple(row.shape)}")
    return {s.name: row[s.offset:s.offset + s.nbytes].view(s.shape) for s in segments}


class RowCodec(Protocol):
    """How one expert's (w13, w2) W2Tensors become a pack row. Injectable so that a pack can hold
    another layout (e.g. the kernels' slot layout, so a fetch is a plain copy) without tierstore.io
    knowing that layout; `abi_tag` enters the pack identity."""

    @property
    def abi_tag(self) -> str: ...

    def segments(self, tag: str, geometry: MoEGeometry) -> tuple[RowSegment, ...]: ...

    def encode(self, tag: str, segments: tuple[RowSegment, ...], w13: W2Tensor, w2: W2Tensor) -> torch.Tensor: ...


class Row64Codec:
    """The layout described at the top of this module."""

    @property
    def abi_tag(self) -> str:
        return pack_abi_tag()

    def segments(self, tag: str, geometry: MoEGeometry) -> tuple[RowSegment, ...]:
        return row_segments(tag, geometry)

    def encode(self, tag: str, segments: tuple[RowSegment, ...], w13: W2Tensor, w2: W2Tensor) -> torch.Tensor:
        return encode_row(tag, segments, w13, w2)


DEFAULT_ROW_CODEC = Row64Codec()
