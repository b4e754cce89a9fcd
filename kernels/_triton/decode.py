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


# Shared epilogue of the word-dot PTX: the bf16x2 sum `acc` -> $0 = low + high as float32, block closed.
_BF16X2_SUM_TO_F32 = ["shl.b32 lo, acc, 16;", "and.b32 hi, acc, 0xffff0000;", "add.f32 $0, lo, hi;", "}"]


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
    lines += _BF16X2_SUM_TO_F32
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


# ---------------------------------------------------------------------------------------------
# FP4 (e2m1) -> bfloat16x2 by integer bit construction (v8; the BT = 1 default on CUDA with bf16).
#
# Every e2m1 magnitude {0, .5, 1, 1.5, 2, 3, 4, 6} is zero or a normal bfloat16, so its 16 bits are
# looked up, never produced by scaling an exponent (which would make 0.5 a subnormal): `prmt` with
# the 3-bit magnitude as selector picks the low byte from the 8-byte table FP4_BF16_LO and the high
# byte from FP4_BF16_HI (entry m = byte m of {b, a}, a holding entries 0..3). Per word (8 nibbles,
# 4 bf16x2 pairs: slots 2i | 2i+1 << 16):
#   idx = w & 0x77777777; idh = idx >> 16; v = w << 4
#   per nibble quad q (nibbles 4q..4q+3, selectors idx resp. idh):
#     l = prmt(LO_a, LO_b, sel); h = prmt(HI_a, HI_b, sel)       low / high bytes of the 4 magnitudes
#     s = prmt(v, w, 0x5140 + 0x2222 * q); h |= s & 0x80808080    nibble signs -> bit 7 of each high byte
#     pair 2q = prmt(l, h, 0x5140); pair 2q + 1 = prmt(l, h, 0x7362)
# 17 integer instructions per 8 weights (~2.1 per weight). The block scale enters as one packed
# multiply by the bf16x2 of 2^(byte - 127 + FP4_SCALE_BIAS) ((byte_lo + 2) << 7 | (byte_hi + 2) << 23; the
# + 2 is one SWAR add on each scale word, no carry since bytes are <= 240): a normal bf16 times a power
# of two is exact while the product stays normal, which holds for every byte the layout admits, 0..240
# (smallest product 0.5 * 2^(0 - 125) = 2^-126, largest 6 * 2^115 < bf16 max). Unbiased (2^(byte - 127))
# bytes 0 and 1 would give a zero scale resp. a bf16 subnormal product. The tile's float32 sums carry
# the factor 2^FP4_SCALE_BIAS = 4 until one exact multiply by 0.25 per row at the end; scaling every
# product and partial sum by 4 leaves each rounding unchanged (outside the subnormal range).

FP4_BF16_LO = (0xC0800000, 0xC0804000)  # low bytes of bf16(m) for m = 0..7: 00 00 80 C0 | 00 40 80 C0
FP4_BF16_HI = (0x3F3F3F00, 0x40404040)  # high bytes: 00 3F 3F 3F | 40 40 40 40
FP4_SCALE_BIAS = 2  # exponent added to every FP4 block scale of the bf16x2 decode (undone per row)
FP4_SCALE_UNBIAS = tl.constexpr(2.0 ** -FP4_SCALE_BIAS)  # the exact multiply per row that removes the bias
_FP4_BIAS_BYTES = tl.constexpr(0x01010101 * FP4_SCALE_BIAS)


def _fp4_decode_lines(word: str, pair_regs: tuple[str, str, str, str]) -> list[str]:
    """PTX lines that build the four bf16x2 magnitude+sign pairs of FP4 word `word` into pair_regs."""
    lines = [
        f"mov.b32 tla, {FP4_BF16_LO[0]:#010x};", f"mov.b32 tlb, {FP4_BF16_LO[1]:#010x};",
        f"mov.b32 tha, {FP4_BF16_HI[0]:#010x};", f"mov.b32 thb, {FP4_BF16_HI[1]:#010x};",
        f"and.b32 idx, {word}, 0x77777777;",
        "shr.b32 idh, idx, 16;",
        f"shl.b32 v, {word}, 4;",
    ]
    for q, sel in ((0, "idx"), (1, "idh")):
        lines += [
            f"prmt.b32 l, tla, tlb, {sel};",
            f"prmt.b32 h, tha, thb, {sel};",
            f"prmt.b32 s, v, {word}, {0x5140 + 0x2222 * q:#x};",
            "and.b32 s, s, 0x80808080;",
            "or.b32 h, h, s;",
            f"prmt.b32 {pair_regs[2 * q]}, l, h, 0x5140;",
            f"prmt.b32 {pair_regs[2 * q + 1]}, l, h, 0x7362;",
        ]
    return lines


_FP4_DECODE_REGS = ".reg .b32 tla, tlb, tha, thb, idx, idh, v, l, h, s;"


def _fp4_word_dot_asm() -> str:
    """PTX for `fp4_word_dot_bf16x2`: $0 = result (f32), $1 = word, $2..$5 = activation pairs, $6..$9 = scale pairs."""
    lines = ["{", _FP4_DECODE_REGS, ".reg .b32 p0, p1, p2, p3, acc, lo, hi;"]
    lines += _fp4_decode_lines("$1", ("p0", "p1", "p2", "p3"))
    for i in range(4):
        lines.append(f"mul.rn.bf16x2 p{i}, p{i}, ${6 + i};")  # exact: power-of-two scale, normal product
        if i == 0:
            lines.append("mul.rn.bf16x2 acc, p0, $2;")
        else:
            lines.append(f"fma.rn.bf16x2 acc, p{i}, ${2 + i}, acc;")
    lines += _BF16X2_SUM_TO_F32
    return "\n".join(lines)


def _fp4_scale_pairs_asm(wps: int) -> str:
    """PTX for `fp4_scale_pairs`: the tile's scale words -> four bf16x2 scales ((byte_lo + 2) << 7 | (byte_hi + 2) << 23)."""
    lines = ["{", ".reg .b32 z, d, q0, q1;", "mov.b32 z, 0;"]
    for word in range(wps // 16):
        lines.append(f"add.s32 q{word}, ${4 + word}, {0x01010101 * FP4_SCALE_BIAS:#x};")  # bytes <= 240: no carry
    for i, (word, sel) in enumerate(fp4_scale_pair_selectors(wps)):
        lines.append(f"prmt.b32 d, q{word}, z, {sel:#x};")
        lines.append(f"shl.b32 ${i}, d, 7;")
    lines.append("}")
    return "\n".join(lines)


def fp4_scale_pair_selectors(wps: int) -> list[tuple[int, int]]:
    """(scale word, prmt selector) of slot pair i of an FP4 tile: bytes [lo block, 0, hi block, 0]."""
    out = []
    for i in range(4):
        lo, hi = (2 * i * wps) // 32, ((2 * i + 1) * wps) // 32  # scale blocks of slots 2i and 2i + 1
        assert lo // 4 == hi // 4
        out.append((lo // 4, (4 << 12) | ((hi % 4) << 8) | (4 << 4) | (lo % 4)))
    return out


_FP4_WORD_DOT_ASM = tl.constexpr(_fp4_word_dot_asm())
_FP4_SCALE_PAIRS_ASM_32 = tl.constexpr(_fp4_scale_pairs_asm(32))
_FP4_SCALE_PAIRS_ASM_16 = tl.constexpr(_fp4_scale_pairs_asm(16))


@triton.jit
def fp4_word_dot_bf16x2(w, x0, x1, x2, x3, s0, s1, s2, s3):
    """Inline PTX (GPU only): sum over the 8 weights of FP4 word w of weight * activation, as float32.

    x_i: activations of slots 2i (low) and 2i+1 (high) as bfloat16x2; s_i: their scales times
    2^FP4_SCALE_BIAS as bfloat16x2 powers of two (`fp4_scale_pairs`), so the result is 2^FP4_SCALE_BIAS times the dot. Decode by lookup (`_fp4_decode_lines`), one exact packed
    multiply by the scale per pair, one packed FMA per pair; four products summed in bf16x2, then joined
    as float32.
    """
    return tl.inline_asm_elementwise(
        _FP4_WORD_DOT_ASM, "=r" + ",r" * 9, [w, x0, x1, x2, x3, s0, s1, s2, s3],
        dtype=tl.float32, is_pure=True, pack=1,
    )


@triton.jit
def fp4_scale_pairs(q0, q1, WPS: tl.constexpr):
    """Inline PTX (GPU only): scale words of an FP4 K tile (8 blocks in q0, q1 when WPS = 32; 4 in q0 when
    WPS = 16) -> the four bf16x2 scale pairs of `fp4_word_dot_bf16x2`, 2^FP4_SCALE_BIAS times the block scales
    (one add per scale word, one prmt + one shl per pair)."""
    if WPS == 32:
        return tl.inline_asm_elementwise(_FP4_SCALE_PAIRS_ASM_32, "=r,=r,=r,=r,r,r", [q0, q1],
                                         dtype=(tl.int32,) * 4, is_pure=True, pack=1)
    else:
        return tl.inline_asm_elementwise(_FP4_SCALE_PAIRS_ASM_16, "=r,=r,=r,=r,r,r", [q0, q1],
                                         dtype=(tl.int32,) * 4, is_pure=True, pack=1)


# Plain-Triton twin: the same instructions on uint32 tensors (what the CPU interpreter runs).

@triton.jit
def _prmt_byte(a, b, c, J: tl.constexpr):
    sel = (c >> (4 * J)) & 0xF
    n = sel & 7
    src = tl.where(n < 4, a, b)
    byte = (src >> ((n & 3) * 8)) & 0xFF
    return tl.where((sel & 8) != 0, ((byte >> 7) & 1) * 0xFF, byte)


@triton.jit
def prmt_ref(a, b, c):
    """`prmt.b32 d, a, b, c` (default mode, msb-replicate included) on uint32 tensors."""
    return (_prmt_byte(a, b, c, 0) | (_prmt_byte(a, b, c, 1) << 8) | (_prmt_byte(a, b, c, 2) << 16)
            | (_prmt_byte(a, b, c, 3) << 24))


@triton.jit
def fp4_word_pairs(words):
    """FP4 words (int32) -> the four bf16x2 pairs (uint32) exactly as `_fp4_decode_lines` builds them."""
    w = words.to(tl.uint32, bitcast=True)
    zero = w & 0
    tla = zero | 0xC0800000
    tlb = zero | 0xC0804000
    tha = zero | 0x3F3F3F00
    thb = zero | 0x40404040
    idx = w & 0x77777777
    idh = idx >> 16
    v = w << 4
    l0 = prmt_ref(tla, tlb, idx)
    h0 = prmt_ref(tha, thb, idx) | (prmt_ref(v, w, zero | 0x5140) & 0x80808080)
    l1 = prmt_ref(tla, tlb, idh)
    h1 = prmt_ref(tha, thb, idh) | (prmt_ref(v, w, zero | 0x7362) & 0x80808080)
    return (prmt_ref(l0, h0, zero | 0x5140), prmt_ref(l0, h0, zero | 0x7362),
            prmt_ref(l1, h1, zero | 0x5140), prmt_ref(l1, h1, zero | 0x7362))


@triton.jit
def _scale_pair_ref(q, SEL: tl.constexpr):
    u = q.to(tl.uint32, bitcast=True) + _FP4_BIAS_BYTES  # FP4_SCALE_BIAS in every byte (bytes <= 240)
    return (prmt_ref(u, u & 0, (u & 0) | SEL) << 7).to(tl.int32, bitcast=True)


@triton.jit
def fp4_scale_pairs_ref(q0, q1, WPS: tl.constexpr):
    """Plain-Triton twin of `fp4_scale_pairs` (same bias add, prmt selectors and shift)."""
    if WPS == 32:
        return (_scale_pair_ref(q0, 0x4140), _scale_pair_ref(q0, 0x4342), _scale_pair_ref(q1, 0x4140),
                _scale_pair_ref(q1, 0x4342))
    else:
        return (_scale_pair_ref(q0, 0x4040), _scale_pair_ref(q0, 0x4141), _scale_pair_ref(q0, 0x4242),
                _scale_pair_ref(q0, 0x4343))


@triton.jit
def bf16x2_halves(p):
    """bf16x2 bits (uint32 or int32) -> (low, high) as float32 (exact)."""
    u = p.to(tl.uint32, bitcast=True)
    return (u << 16).to(tl.float32, bitcast=True), (u & 0xFFFF0000).to(tl.float32, bitcast=True)
