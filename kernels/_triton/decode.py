"""In-register decode of packed words (layout: kernels/layout.py), plain Triton.

Each helper takes a tile of int32 words [BN, WPS] and a constexpr bit slot, and returns
the slot's values as float32 [BN, WPS] up to a per-tier power of two that the caller folds
into the scale (`scale_from_bytes`: EXP_OFFSET 2 for W2, 14 for FP4). Plain integer ops only, so the CPU interpreter runs them.
"""

import triton
import triton.language as tl


@triton.jit
def _rotl(w, r: tl.constexpr):
    # w: uint32 tensor; rotate left by the constant r (0..31)
    if r == 0:
        return w
    else:
        return (w << r) | (w >> (32 - r))


@triton.jit
def decode_w2_slot(words, SLOT: tl.constexpr):
    """W2 bit slot -> float32 {+-0.25, +-1} (= level / 4)."""
    w = words.to(tl.uint32, bitcast=True)
    mag_bit: tl.constexpr = (2 * (SLOT // 2) + 16 * (SLOT % 2)) % 32
    rot = _rotl(w, (24 - mag_bit + 32) % 32)
    bits = (rot & 0x81000000) | 0x3E800000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def decode_w2_slot_scaled(words, SLOT: tl.constexpr, scale_bits):
    """W2 bit slot -> float32 level * 2^(byte - 127), the scale added to the exponent field.

    scale_bits = (byte - 125) << 23 (int32, broadcastable); exact for scale bytes 1..252.
    """
    w = words.to(tl.uint32, bitcast=True)
    mag_bit: tl.constexpr = (2 * (SLOT // 2) + 16 * (SLOT % 2)) % 32
    rot = _rotl(w, (24 - mag_bit + 32) % 32)
    bits = ((rot & 0x81000000) | 0x3E800000).to(tl.int32, bitcast=True) + scale_bits
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _shift(w, s: tl.constexpr):
    # logical shift of a uint32 tensor: left by s if s >= 0 else right by -s
    if s >= 0:
        return w << s
    else:
        return w >> (-s)


@triton.jit
def decode_fp4_slot(words, SLOT: tl.constexpr):
    """FP4 nibble slot -> float32 e2m1 * 2^-14 (built as an exact float16, subnormals included)."""
    w = words.to(tl.uint32, bitcast=True)
    sign = _shift(w, 12 - 4 * SLOT) & 0x8000
    mag = _shift(w, 9 - 4 * SLOT) & 0x0E00
    half = (sign | mag).to(tl.uint16).to(tl.float16, bitcast=True)
    return half.to(tl.float32)


@triton.jit
def scale_from_bytes(byte, EXP_OFFSET: tl.constexpr):
    """UE8M0 byte -> float32 2^(byte - 127 + EXP_OFFSET), built from exponent bits."""
    return ((byte.to(tl.int32) + EXP_OFFSET) << 23).to(tl.float32, bitcast=True)
