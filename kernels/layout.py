"""Offline repack of expert weights into the kernels' slot layout, and its ABI tag.

Inputs are the quantizer's unpacked form, per expert matrix [N, K] (K = contraction):

* W2: codes uint8 [N, K], values 0..3 meaning the levels {-4, -1, +1, +4};
* FP4: e2m1 nibbles uint8 [N, K] (bit 3 = sign, bits 0..2 index {0, .5, 1, 1.5, 2, 3, 4, 6});
* scale bytes uint8 [N, K/32] (UE8M0: value 2^(byte - 127)), shared by both tiers.

Packed layout of one matrix (both tiers): int32 words [N, K_pad / VPW], VPW values per word
(16 for W2, 8 for FP4). Along K a row is cut into tiles of VPW * WPS values, WPS = words per
slot (32, or 16 when K does not divide by the 32-word tile). Inside a tile, value `k = j * WPS + u`
lives in bit slot `j` of word `u`, so every bit slot of a word tile is one contiguous run of WPS
values along K (one or half a scale block) and a kernel decodes it with constant shifts.

W2 bit slots: slot j = 2i + h stores its magnitude bit (|level| = 4) at bit (2i + 16h) mod 32 and
its sign bit (negative) at (2i + 7 + 16h) mod 32. Rotating a word left by (24 - mag_bit) puts a
code's magnitude bit at 24 and sign at 31: `(rot & 0x81000000) | 0x3E800000` is the float32
{+-0.25, +-1}, i.e. the level / 4. Rotating by (8 - 2i) places slots 2i and 2i + 1 at bits 8/15 and
24/31 at once: `(rot & 0x81008100) | 0x3E803E80` is the same pair as two bfloat16.

FP4 bit slots: nibble j at bits [4j, 4j + 4) (the input nibble unchanged).

Scales stay [N, K_pad / 32] row-major (block b covers K [32b, 32b + 32)); padding bytes are 0 and
kernels give padded blocks a zero scale. Scale bytes above 240 are rejected (the kernels fold a
power of two into the exponent: W2 uses 2^(byte - 125), FP4 2^(byte - 113)).

A slot holds one whole expert: w13 [2I, H] words, w13 scales, w2 [H, I] words, w2 scales, each
section 16-byte aligned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ABI_TAG = "tierstore-kernels/slot-v1:w2=rot7-pair16,fp4=nib8,tile=32x32|16,ue8m0=rowmajor"

W2_VALUES_PER_WORD = 16
FP4_VALUES_PER_WORD = 8
SCALE_BLOCK = 32
MAX_SCALE_BYTE = 240
_ALIGN = 16

W2_LEVELS = (-4.0, -1.0, 1.0, 4.0)
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def w2_mag_bit(slot: int) -> int:
    """Bit position of the magnitude bit of W2 bit slot `slot` (0..15) in its word."""
    pair, half = divmod(slot, 2)
    return (2 * pair + 16 * half) % 32


def w2_sign_bit(slot: int) -> int:
    return (w2_mag_bit(slot) + 7) % 32


def words_per_slot(k: int, values_per_word: int) -> int:
    """32 words per bit slot when K fills whole 32-word tiles, else 16."""
    return 32 if k % (values_per_word * 32) == 0 else 16


def padded_k(k: int, values_per_word: int) -> int:
    tile = values_per_word * words_per_slot(k, values_per_word)
    return -(-k // tile) * tile


@dataclass(frozen=True)
class MatrixLayout:
    """Geometry of one packed matrix [N, K] at one tier."""

    n: int
    k: int
    values_per_word: int

    @property
    def wps(self) -> int:
        return words_per_slot(self.k, self.values_per_word)

    @property
    def k_pad(self) -> int:
        return padded_k(self.k, self.values_per_word)

    @property
    def words_per_row(self) -> int:
        return self.k_pad // self.values_per_word

    @property
    def blocks_per_row(self) -> int:
        return self.k_pad // SCALE_BLOCK

    @property
    def word_bytes(self) -> int:
        return 4 * self.n * self.words_per_row

    @property
    def scale_bytes(self) -> int:
        return self.n * self.blocks_per_row


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class SlotLayout:
    """Byte offsets of the four sections of one expert slot at one tier."""

    hidden: int
    inter: int
    values_per_word: int

    def __post_init__(self) -> None:
        if self.hidden % SCALE_BLOCK or self.inter % SCALE_BLOCK:
            raise ValueError(f"hidden {self.hidden} and inter {self.inter} must be multiples of {SCALE_BLOCK}")
        if self.values_per_word not in (W2_VALUES_PER_WORD, FP4_VALUES_PER_WORD):
            raise ValueError(f"values_per_word must be 16 (W2) or 8 (FP4), got {self.values_per_word}")

    @property
    def w13(self) -> MatrixLayout:
        return MatrixLayout(2 * self.inter, self.hidden, self.values_per_word)

    @property
    def w2(self) -> MatrixLayout:
        return MatrixLayout(self.hidden, self.inter, self.values_per_word)

    @property
    def w13_words_offset(self) -> int:
        return 0

    @property
    def w13_scales_offset(self) -> int:
        return _aligned(self.w13.word_bytes)

    @property
    def w2_words_offset(self) -> int:
        return self.w13_scales_offset + _aligned(self.w13.scale_bytes)

    @property
    def w2_scales_offset(self) -> int:
        return self.w2_words_offset + _aligned(self.w2.word_bytes)

    @property
    def slot_bytes(self) -> int:
        return self.w2_scales_offset + _aligned(self.w2.scale_bytes)


def w2_slot_layout(hidden: int, inter: int) -> SlotLayout:
    return SlotLayout(hidden, inter, W2_VALUES_PER_WORD)


def fp4_slot_layout(hidden: int, inter: int) -> SlotLayout:
    return SlotLayout(hidden, inter, FP4_VALUES_PER_WORD)


def _check_matrix(values: torch.Tensor, scales: torch.Tensor, limit: int, what: str) -> None:
    if values.dtype != torch.uint8 or scales.dtype != torch.uint8 or values.dim() != 2:
        raise ValueError(f"{what}: expected uint8 [N, K] values and uint8 scales, got {values.dtype} {tuple(values.shape)}")
    n, k = values.shape
    if k % SCALE_BLOCK or scales.shape != (n, k // SCALE_BLOCK):
        raise ValueError(f"{what}: scales must be [N, K/32] = {(n, k // SCALE_BLOCK)}, got {tuple(scales.shape)}")
    if int(values.max()) > limit:
        raise ValueError(f"{what}: values must be <= {limit}, found {int(values.max())}")
    if int(scales.max()) > MAX_SCALE_BYTE:
        raise ValueError(f"{what}: scale bytes must be <= {MAX_SCALE_BYTE}, found {int(scales.max())}")


def _tile_order(values: torch.Tensor, m: MatrixLayout) -> torch.Tensor:
    """[N, K] -> [N, words, VPW]: the values of each word, by bit slot."""
    padded = torch.zeros(m.n, m.k_pad, dtype=torch.int64, device=values.device)
    padded[:, : m.k] = values.to(torch.int64)
    tiles = padded.view(m.n, m.k_pad // (m.values_per_word * m.wps), m.values_per_word, m.wps)  # [N, tiles, slot, u]
    return tiles.transpose(2, 3).reshape(m.n, m.words_per_row, m.values_per_word)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    return (words - ((words >> 31) << 32)).to(torch.int32)  # two's complement wrap of uint32 values


def _slot_bits(values_per_word: int):
    """numpy uint32 [VPW, 256]: the word bits that value v (a W2 code or an FP4 nibble; larger
    values are rejected before packing) sets in bit slot j."""
    import numpy as np

    bits = np.zeros((values_per_word, 256), dtype=np.uint32)
    for j in range(values_per_word):
        if values_per_word == W2_VALUES_PER_WORD:
            for code in range(4):
                large, negative = code in (0, 3), code < 2
                bits[j, code] = (large << w2_mag_bit(j)) | (negative << w2_sign_bit(j))
        else:
            bits[j, :16] = np.arange(16, dtype=np.uint32) << (4 * j)
    return bits


_SLOT_BITS: dict = {}


def _pack_words_cpu(values: torch.Tensor, m: MatrixLayout) -> torch.Tensor | None:
    """The numba path of pack_w2_words / pack_fp4_words for CPU tensors (byte-identical to the torch
    path below), or None where it does not apply."""
    if values.device.type != "cpu" or values.numel() == 0:
        return None
    from ._cpu_pack import pack_words_cpu

    if m.values_per_word not in _SLOT_BITS:
        _SLOT_BITS[m.values_per_word] = _slot_bits(m.values_per_word)
    bits = _SLOT_BITS[m.values_per_word]
    return torch.from_numpy(pack_words_cpu(values.contiguous().numpy(), m.k_pad, m.values_per_word, m.wps, bits))


def pack_w2_words(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """W2 codes uint8 [N, K] -> int32 words [N, K_pad / 16]."""
    _check_matrix(codes, scales, 3, "W2 codes")
    m = MatrixLayout(codes.shape[0], codes.shape[1], W2_VALUES_PER_WORD)
    fast = _pack_words_cpu(codes, m)
    return fast if fast is not None else _pack_w2_words_torch(codes, m)


def _pack_w2_words_torch(codes: torch.Tensor, m: MatrixLayout) -> torch.Tensor:
    slots = _tile_order(codes, m)  # [N, words, 16]
    negative = (slots < 2).to(torch.int64)
    large = ((slots == 0) | (slots == 3)).to(torch.int64)
    mag_shift = torch.tensor([w2_mag_bit(j) for j in range(16)], dtype=torch.int64, device=codes.device)
    sign_shift = torch.tensor([w2_sign_bit(j) for j in range(16)], dtype=torch.int64, device=codes.device)
    words = ((large << mag_shift) | (negative << sign_shift)).sum(dim=2)  # bits are disjoint
    return _to_int32(words)


def pack_fp4_words(nibbles: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """FP4 nibbles uint8 [N, K] -> int32 words [N, K_pad / 8]."""
    _check_matrix(nibbles, scales, 15, "FP4 nibbles")
    m = MatrixLayout(nibbles.shape[0], nibbles.shape[1], FP4_VALUES_PER_WORD)
    fast = _pack_words_cpu(nibbles, m)
    return fast if fast is not None else _pack_fp4_words_torch(nibbles, m)


def _pack_fp4_words_torch(nibbles: torch.Tensor, m: MatrixLayout) -> torch.Tensor:
    slots = _tile_order(nibbles, m)  # [N, words, 8]
    shift = 4 * torch.arange(8, dtype=torch.int64, device=nibbles.device)
    return _to_int32((slots << shift).sum(dim=2))


def pad_scales(scales: torch.Tensor, m: MatrixLayout) -> torch.Tensor:
    out = torch.zeros(m.n, m.blocks_per_row, dtype=torch.uint8, device=scales.device)
    out[:, : scales.shape[1]] = scales
    return out


def pack_slot(layout: SlotLayout, w13_values, w13_scales, w2_values, w2_scales) -> torch.Tensor:
    """One expert (unpacked codes or nibbles + scale bytes of w13 [2I, H] and w2 [H, I]) -> uint8 [slot_bytes]."""
    pack = pack_w2_words if layout.values_per_word == W2_VALUES_PER_WORD else pack_fp4_words
    out = torch.zeros(layout.slot_bytes, dtype=torch.uint8, device=w13_values.device)
    sections = (
        (layout.w13_words_offset, pack(w13_values, w13_scales).view(torch.uint8)),
        (layout.w13_scales_offset, pad_scales(w13_scales, layout.w13)),
        (layout.w2_words_offset, pack(w2_values, w2_scales).view(torch.uint8)),
        (layout.w2_scales_offset, pad_scales(w2_scales, layout.w2)),
    )
    for offset, data in sections:
        flat = data.reshape(-1)
        out[offset : offset + flat.numel()] = flat
    return out


def _section(slot: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    return slot[offset : offset + nbytes]


def unpack_matrix_ref(slot: torch.Tensor, layout: SlotLayout, which: str) -> torch.Tensor:
    """Plain-torch decode of one packed matrix of a slot to float32 [N, K] (the kernels' reference)."""
    m = layout.w13 if which == "w13" else layout.w2
    words_off = layout.w13_words_offset if which == "w13" else layout.w2_words_offset
    scales_off = layout.w13_scales_offset if which == "w13" else layout.w2_scales_offset
    words = _section(slot, words_off, m.word_bytes).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    words = words.view(m.n, m.words_per_row, 1)
    scales = _section(slot, scales_off, m.scale_bytes).view(m.n, m.blocks_per_row)
    if m.values_per_word == W2_VALUES_PER_WORD:
        mag = torch.tensor([w2_mag_bit(j) for j in range(16)], device=slot.device)
        sign = torch.tensor([w2_sign_bit(j) for j in range(16)], device=slot.device)
        magnitude = torch.where((words >> mag) & 1 == 1, 4.0, 1.0)
        values = torch.where((words >> sign) & 1 == 1, -magnitude, magnitude)  # [N, words, 16]
    else:
        nib = (words >> (4 * torch.arange(8, device=slot.device))) & 0xF
        table = torch.tensor(E2M1_MAGNITUDES, device=slot.device)
        values = torch.where(nib >= 8, -table[nib & 7], table[nib & 7])  # [N, words, 8]
    tiles = values.view(m.n, -1, m.wps, m.values_per_word).transpose(2, 3).reshape(m.n, m.k_pad)
    scale = torch.exp2(scales.to(torch.float64) - 127.0).repeat_interleave(SCALE_BLOCK, dim=1)
    return (tiles.to(torch.float64) * scale)[:, : m.k].to(torch.float32)


def dequant_w2_ref(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Unpacked W2 codes + scale bytes -> float32 [N, K], straight from the format definition."""
    levels = torch.tensor(W2_LEVELS, dtype=torch.float64, device=codes.device)[codes.long()]
    return (levels * torch.exp2(scales.to(torch.float64) - 127.0).repeat_interleave(SCALE_BLOCK, dim=1)).float()


def dequant_fp4_ref(nibbles: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Unpacked e2m1 nibbles + scale bytes -> float32 [N, K], straight from the format definition."""
    table = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64, device=nibbles.device)
    mag = table[(nibbles & 7).long()]
    values = torch.where(nibbles >= 8, -mag, mag)
    return (values * torch.exp2(scales.to(torch.float64) - 127.0).repeat_interleave(SCALE_BLOCK, dim=1)).float()
