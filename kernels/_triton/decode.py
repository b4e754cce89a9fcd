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


def _w2_word_dot_asm() -> str:
    """PTX for `w2_word_dot_bf16x2` (built once at import; GPU path only)."""
    lines = ["{", ".reg .b32 r, d, acc, lo, hi;"]
    for i in range(8):
        rot = (8 - 2 * i) % 32
        src = "$1" if rot == 0 else "r"
        if rot:
            lines.append(f"shf.l.wrap.b32 r, $1, $1, {rot};")  # slots 2i, 2i+1 -> bits 8/15 and 24/31
        lines.append(f"and.b32 d, {src}, 0x81008100;")
        lines.append(f"add.s32 d, d, ${10 + i};")  # (+-1 or +-4) * 2^(scale byte - 127) as two bf16
        if i == 0:
            lines.append("mul.rn.bf16x2 acc, d, $2;")
        else:
            lines.append(f"fma.rn.bf16x2 acc, d, ${2 + i}, acc;")
    lines += ["shl.b32 lo, acc, 16;", "and.b32 hi, acc, 0xffff0000;", "add.f32 $0, lo, hi;", "}"]
    return "\n".join(lines)


_W2_WORD_DOT_ASM = tl.constexpr(_w2_word_dot_asm())


@triton.jit
def w2_word_dot_bf16x2(w, x0, x1, x2, x3, x4, x5, x6, x7, s0, s1, s2, s3, s4, s5, s6, s7):
    """Inline PTX (GPU only): sum over the 16 weights of W2 word w of weight * activation, as float32.

    x_i: the activations of bit slots 2i (low half) and 2i+1 (high half) of this word as bfloat16x2;
    s_i = (scale byte of slot 2i) << 7 | (scale byte of slot 2i+1) << 23. Per slot pair: one funnel
    rotate, one and, one integer add (the scale enters both exponent fields) give the two weights as
    bf16x2; one packed bf16 FMA. The eight products of a word are summed in bf16x2, then in float32.
    """
    return tl.inline_asm_elementwise(
        _W2_WORD_DOT_ASM, "=r" + ",r" * 17, [w, x0, x1, x2, x3, x4, x5, x6, x7, s0, s1, s2, s3, s4, s5, s6, s7],
        dtype=tl.float32, is_pure=True, pack=1,
    )


def _w2_scale_pairs_asm(wps: int) -> str:
    """PTX for `w2_scale_pairs`: bytes of the tile's scale words -> the eight s_i of `w2_word_dot_bf16x2`."""
    lines = ["{", ".reg .b32 z, d;", "mov.b32 z, 0;"]
    for i in range(8):
        lo, hi = (2 * i * wps) // 32, ((2 * i + 1) * wps) // 32  # scale blocks of slots 2i and 2i+1
        sel = (4 << 12) | ((hi % 4) << 8) | (4 << 4) | (lo % 4)  # [lo byte, 0, hi byte, 0]
        lines.append(f"prmt.b32 d, ${8 + lo // 4}, z, {sel:#x};")
        lines.append(f"shl.b32 ${i}, d, 7;")
    lines.append("}")
    return "\n".join(lines)


_W2_SCALE_PAIRS_ASM_32 = tl.constexpr(_w2_scale_pairs_asm(32))
_W2_SCALE_PAIRS_ASM_16 = tl.constexpr(_w2_scale_pairs_asm(16))


@triton.jit
def w2_scale_pairs(q0, q1, q2, q3, WPS: tl.constexpr):
    """Inline PTX (GPU only): the K tile's scale bytes, as int32 words q0..q3 (16 blocks; 8 when WPS = 16,
    q2/q3 unused), -> the eight per-slot-pair exponent addends of `w2_word_dot_bf16x2` (one prmt + one shl each)."""
    if WPS == 32:
        return tl.inline_asm_elementwise(_W2_SCALE_PAIRS_ASM_32, "=r," * 8 + "r,r,r,r", [q0, q1, q2, q3],
                                         dtype=(tl.int32,) * 8, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(_W2_SCALE_PAIRS_ASM_16, "=r," * 8 + "r,r,r,r", [q0, q1, q2, q3],
                                         dtype=(tl.int32,) * 8, is_pure=True, pack=1)


def _w2_word_dot2_asm() -> str:
    """PTX for `w2_word_dot2_bf16x2`: `_w2_word_dot_asm` with each decoded slot pair used by two lanes.

    Operands: $0, $1 = lane a, lane b results; $2 = word; $3..$10 = lane a activations; $11..$18 =
    lane b activations; $19..$26 = scale addends. Each lane's instruction sequence (mul, then fma in
    slot-pair order, then the float32 join) is the single-lane one, so a lane's bits do not depend on
    the other lane.
    """
    lines = ["{", ".reg .b32 r, d, acca, accb, lo, hi;"]
    for i in range(8):
        rot = (8 - 2 * i) % 32
        src = "$2" if rot == 0 else "r"
        if rot:
            lines.append(f"shf.l.wrap.b32 r, $2, $2, {rot};")
        lines.append(f"and.b32 d, {src}, 0x81008100;")
        lines.append(f"add.s32 d, d, ${19 + i};")
        if i == 0:
            lines.append("mul.rn.bf16x2 acca, d, $3;")
            lines.append("mul.rn.bf16x2 accb, d, $11;")
        else:
            lines.append(f"fma.rn.bf16x2 acca, d, ${3 + i}, acca;")
            lines.append(f"fma.rn.bf16x2 accb, d, ${11 + i}, accb;")
    for out, acc in (("$0", "acca"), ("$1", "accb")):
        lines += [f"shl.b32 lo, {acc}, 16;", f"and.b32 hi, {acc}, 0xffff0000;", f"add.f32 {out}, lo, hi;"]
    lines.append("}")
    return "\n".join(lines)


_W2_WORD_DOT2_ASM = tl.constexpr(_w2_word_dot2_asm())


@triton.jit
def w2_word_dot2_bf16x2(w, a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7,
                        s0, s1, s2, s3, s4, s5, s6, s7):
    """Inline PTX (GPU only): `w2_word_dot_bf16x2` for two activation rows a and b sharing one decode.

    Returns (dot with a, dot with b) as float32; each equals `w2_word_dot_bf16x2(w, a.., s..)`
    resp. `(w, b.., s..)` bit for bit (same per-lane instruction sequence).
    """
    return tl.inline_asm_elementwise(
        _W2_WORD_DOT2_ASM, "=r,=r" + ",r" * 25,
        [w, a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7, s0, s1, s2, s3, s4, s5, s6, s7],
        dtype=(tl.float32, tl.float32), is_pure=True, pack=1,
    )
