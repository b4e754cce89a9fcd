"""Block GEMM over routed pairs, decoding packed W2 / FP4 weights in registers (tensor cores).

Grid (block, n-tile). A block is BT pairs routed to one expert (see route.py). The program
looks the expert up in the FP4 table first, then the W2 table, and computes, for its BN output
rows n and its pairs' activation rows a:

    acc[n, pair] = sum_k W[n, k] * A[a(pair), k]       (swap-AB: weights on the MMA M side)

Per K tile it loads each weight row's WPS words once, then for every bit slot decodes a
[BN, WPS] tile (one run of K) and feeds `tl.dot`; the power-of-two scale multiplies the fp32
partial sum of each 32-block. GATED runs gate rows n and up rows n + N_OUT together and writes
SwiGLU(gate, up) (gate clamped to <= limit, up to [-limit, limit] when HAS_LIMIT); otherwise the
accumulator is written as fp32. Rows are written only for the block's pairs: no atomics.

BT = 1 does not use tensor cores: one pair per program on CUDA-core / packed bf16x2 FMAs.

STREAM: a block whose expert has no W2 slot (the route's STREAM gave it blocks: it has a row in the pinned arena)
reads that row where it lies, `stream_at[expert]` bytes from the pool's slots, over the bus: the bytes a slot would
hold, hence the same result.
"""

import triton
import triton.language as tl

from .decode import (FP4_SCALE_UNBIAS, bf16x2_halves, decode_fp4_slot, decode_w2_slot, decode_w2_slot_scaled, fp4_scale_pairs,
                     fp4_scale_pairs_ref, fp4_word_dot_bf16x2, fp4_word_pairs, scale_from_bytes, w2_scale_pairs,
                     w2_word_dot_bf16x2)


@triton.jit
def _decode(words, SLOT: tl.constexpr, IS_W2: tl.constexpr):
    if IS_W2:
        return decode_w2_slot(words, SLOT)
    else:
        return decode_fp4_slot(words, SLOT)


@triton.jit
def _gate_up_offsets(rows, u, words_per_row, up_row_offset):
    """Word offsets [BN, WPS] of lanes u in the gate rows `rows` and in their up rows (rows + up_row_offset)."""
    gate_rows = rows[:, None] * words_per_row + u[None, :]
    up_rows = (rows[:, None] + up_row_offset) * words_per_row + u[None, :]
    return gate_rows, up_rows


@triton.jit
def _gate_up_words(words_ptr, gate_rows, up_rows, off, mask, GATED: tl.constexpr):
    """One K tile's words [BN, WPS] int32 at word offset `off`: gate, and up when GATED (else the gate words again)."""
    w_g = tl.load(words_ptr + gate_rows + off, mask=mask, other=0)
    w_u = w_g
    if GATED:
        w_u = tl.load(words_ptr + up_rows + off, mask=mask, other=0)
    return w_g, w_u


@triton.jit
def _tier_tile(
    words_ptr, scales_ptr, rows, n_mask, a_ptr, a_rows, stride_a, K, num_blocks_k, words_per_row, blocks_per_row,
    up_row_offset,
    GATED: tl.constexpr, IS_W2: tl.constexpr, WPS: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    VPW: tl.constexpr = 16 if IS_W2 else 8
    EXP_OFFSET: tl.constexpr = 2 if IS_W2 else 14
    SLOTS_PER_BLOCK: tl.constexpr = 32 // WPS
    TILE_K: tl.constexpr = VPW * WPS
    u = tl.arange(0, WPS)
    gate_rows, up_rows = _gate_up_offsets(rows, u, words_per_row, up_row_offset)  # [BN, WPS]
    acc_g = tl.zeros([BN, BT], tl.float32)
    acc_u = tl.zeros([BN, BT], tl.float32)
    for t in range(0, words_per_row // WPS):
        w_g, w_u = _gate_up_words(words_ptr, gate_rows, up_rows, t * WPS, n_mask[:, None], GATED)  # [BN, WPS] int32
        for j in tl.static_range(VPW):
            k = t * TILE_K + j * WPS + u  # [WPS]
            a_t = tl.load(a_ptr + a_rows[None, :] * stride_a + k[:, None], mask=(k < K)[:, None], other=0.0)  # [WPS, BT]
            d_g = _decode(w_g, j, IS_W2).to(a_t.dtype)
            if j % SLOTS_PER_BLOCK == 0:
                part_g = tl.dot(d_g, a_t, input_precision=PRECISION)
            else:
                part_g = tl.dot(d_g, a_t, part_g, input_precision=PRECISION)
            if GATED:
                d_u = _decode(w_u, j, IS_W2).to(a_t.dtype)
                if j % SLOTS_PER_BLOCK == 0:
                    part_u = tl.dot(d_u, a_t, input_precision=PRECISION)
                else:
                    part_u = tl.dot(d_u, a_t, part_u, input_precision=PRECISION)
            if j % SLOTS_PER_BLOCK == SLOTS_PER_BLOCK - 1:
                blk = (t * TILE_K + j * WPS) // 32
                live = n_mask & (tl.zeros([BN], tl.int32) + blk < num_blocks_k)
                s_g = tl.load(scales_ptr + rows * blocks_per_row + blk, mask=live, other=0)
                acc_g += part_g * tl.where(live, scale_from_bytes(s_g, EXP_OFFSET), 0.0)[:, None]
                if GATED:
                    s_u = tl.load(scales_ptr + (rows + up_row_offset) * blocks_per_row + blk, mask=live, other=0)
                    acc_u += part_u * tl.where(live, scale_from_bytes(s_u, EXP_OFFSET), 0.0)[:, None]
    return acc_g, acc_u


@triton.jit
def _tier_tile_fma(
    words_ptr, scales_ptr, rows, n_mask, a_row_ptr, K, num_blocks_k, words_per_row, blocks_per_row,
    up_row_offset,
    GATED: tl.constexpr, IS_W2: tl.constexpr, WPS: tl.constexpr, BN: tl.constexpr,
):
    """One pair (BT = 1), activation row at a_row_ptr: CUDA-core FMAs on [BN, WPS] accumulators, reduced over WPS at the end.

    W2 adds the scale to the decoded value's exponent (no multiply); FP4 multiplies by it.
    """
    VPW: tl.constexpr = 16 if IS_W2 else 8
    SLOTS_PER_BLOCK: tl.constexpr = 32 // WPS
    TILE_K: tl.constexpr = VPW * WPS
    u = tl.arange(0, WPS)
    gate_rows, up_rows = _gate_up_offsets(rows, u, words_per_row, up_row_offset)  # [BN, WPS]
    acc_g = tl.zeros([BN, WPS], tl.float32)
    acc_u = tl.zeros([BN, WPS], tl.float32)
    for t in range(0, words_per_row // WPS):
        w_g, w_u = _gate_up_words(words_ptr, gate_rows, up_rows, t * WPS, n_mask[:, None], GATED)  # [BN, WPS] int32
        for j in tl.static_range(VPW):
            k = t * TILE_K + j * WPS + u  # [WPS]
            x = tl.load(a_row_ptr + k, mask=k < K, other=0.0).to(tl.float32)[None, :]  # [1, WPS]
            if j % SLOTS_PER_BLOCK == 0:
                blk = (t * TILE_K + j * WPS) // 32
                live = n_mask & (tl.zeros([BN], tl.int32) + blk < num_blocks_k)
                s_g = tl.load(scales_ptr + rows * blocks_per_row + blk, mask=live, other=0).to(tl.int32)
                if GATED:
                    s_u = tl.load(scales_ptr + (rows + up_row_offset) * blocks_per_row + blk, mask=live, other=0)
                    s_u = s_u.to(tl.int32)
            if IS_W2:
                acc_g += decode_w2_slot_scaled(w_g, j, ((s_g - 125) << 23)[:, None]) * x
                if GATED:
                    acc_u += decode_w2_slot_scaled(w_u, j, ((s_u - 125) << 23)[:, None]) * x
            else:
                acc_g += decode_fp4_slot(w_g, j) * tl.where(live, scale_from_bytes(s_g, 14), 0.0)[:, None] * x
                if GATED:
                    acc_u += decode_fp4_slot(w_u, j) * tl.where(live, scale_from_bytes(s_u, 14), 0.0)[:, None] * x
    return tl.sum(acc_g, axis=1)[:, None], tl.sum(acc_u, axis=1)[:, None]


@triton.jit
def _prefetch_start(words_ptr, rows, n_mask, words_per_row, up_row_offset, GATED: tl.constexpr, WPS: tl.constexpr,
                    BN: tl.constexpr):
    """Set-up of a BT = 1 K loop that prefetches (`_next_tile_words`): lanes u, gate / up word offsets [BN, WPS],
    zero float32 accumulators [BN, WPS] (gate, up), the tile count and tile 0's words."""
    u = tl.arange(0, WPS)
    gate_rows, up_rows = _gate_up_offsets(rows, u, words_per_row, up_row_offset)
    acc_g = tl.zeros([BN, WPS], tl.float32)
    acc_u = tl.zeros([BN, WPS], tl.float32)
    tiles = words_per_row // WPS
    w_g, w_u = _gate_up_words(words_ptr, gate_rows, up_rows, 0, n_mask[:, None], GATED)
    return u, gate_rows, up_rows, acc_g, acc_u, tiles, w_g, w_u


@triton.jit
def _next_tile_words(words_ptr, gate_rows, up_rows, n_mask, t, tiles, GATED: tl.constexpr, WPS: tl.constexpr):
    """Tile t + 1's gate / up words (zeros past the last tile), loaded before tile t is decoded."""
    more = n_mask[:, None] & (t + 1 < tiles)
    return _gate_up_words(words_ptr, gate_rows, up_rows, (t + 1) * WPS, more, GATED)


@triton.jit
def _x_bits(a_row_ptr, k, K):
    """bfloat16 activations at k (0 past K) as their 16 bits in the low half of an int32."""
    return tl.load(a_row_ptr + k, mask=k < K, other=0.0).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _scale_pairs(scales_ptr, rows, n_mask, blocks_per_row, t, WPS: tl.constexpr):
    """Exponent addends of the 8 slot pairs of K tile t for `rows`, each [BN, 1] (one word load per 4 blocks)."""
    words = scales_ptr.to(tl.pointer_type(tl.int32)) + (rows * blocks_per_row) // 4 + t * (WPS // 8)
    q0 = tl.load(words, mask=n_mask, other=0)
    q1 = tl.load(words + 1, mask=n_mask, other=0)
    q2 = q0
    q3 = q1
    if WPS == 32:
        q2 = tl.load(words + 2, mask=n_mask, other=0)
        q3 = tl.load(words + 3, mask=n_mask, other=0)
    s0, s1, s2, s3, s4, s5, s6, s7 = w2_scale_pairs(q0, q1, q2, q3, WPS)
    return s0[:, None], s1[:, None], s2[:, None], s3[:, None], s4[:, None], s5[:, None], s6[:, None], s7[:, None]


@triton.jit
def _x_pairs4(a_row_ptr, k0, K, WPS: tl.constexpr):
    """Four bfloat16x2 activation pairs from k0 (slots 2i | 2i+1 << 16, i < 4), each [1, WPS]."""
    x0 = (_x_bits(a_row_ptr, k0, K) | (_x_bits(a_row_ptr, k0 + WPS, K) << 16))[None, :]
    x1 = (_x_bits(a_row_ptr, k0 + 2 * WPS, K) | (_x_bits(a_row_ptr, k0 + 3 * WPS, K) << 16))[None, :]
    x2 = (_x_bits(a_row_ptr, k0 + 4 * WPS, K) | (_x_bits(a_row_ptr, k0 + 5 * WPS, K) << 16))[None, :]
    x3 = (_x_bits(a_row_ptr, k0 + 6 * WPS, K) | (_x_bits(a_row_ptr, k0 + 7 * WPS, K) << 16))[None, :]
    return x0, x1, x2, x3


@triton.jit
def _x_pairs(a_row_ptr, k0, K, WPS: tl.constexpr):
    """The eight bfloat16x2 activation pairs of one W2 K tile (slots 2i | 2i+1 << 16), each [1, WPS]."""
    x0, x1, x2, x3 = _x_pairs4(a_row_ptr, k0, K, WPS)
    x4, x5, x6, x7 = _x_pairs4(a_row_ptr, k0 + 8 * WPS, K, WPS)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _w2_tile_bf16x2(
    words_ptr, scales_ptr, rows, n_mask, a_row_ptr, K, words_per_row, blocks_per_row, up_row_offset,
    GATED: tl.constexpr, WPS: tl.constexpr, BN: tl.constexpr,
):
    """GPU fast path of `_tier_tile_fma` for W2 with bfloat16 activations (inline PTX, packed bf16x2 FMA).

    Same result as the plain path up to bf16 rounding of the eight products of each word, which
    are summed in bf16x2 before joining the float32 accumulator. The next K tile's words are
    loaded before the current one is decoded (two tiles in flight per thread).
    """
    TILE_K: tl.constexpr = 16 * WPS
    u, gate_rows, up_rows, acc_g, acc_u, tiles, w_g, w_u = _prefetch_start(
        words_ptr, rows, n_mask, words_per_row, up_row_offset, GATED, WPS, BN)
    for t in range(0, tiles):
        w_g_next, w_u_next = _next_tile_words(words_ptr, gate_rows, up_rows, n_mask, t, tiles, GATED, WPS)
        k0 = t * TILE_K + u
        x0, x1, x2, x3, x4, x5, x6, x7 = _x_pairs(a_row_ptr, k0, K, WPS)
        g0, g1, g2, g3, g4, g5, g6, g7 = _scale_pairs(scales_ptr, rows, n_mask, blocks_per_row, t, WPS)
        acc_g += w2_word_dot_bf16x2(w_g, x0, x1, x2, x3, x4, x5, x6, x7, g0, g1, g2, g3, g4, g5, g6, g7)
        if GATED:
            v0, v1, v2, v3, v4, v5, v6, v7 = _scale_pairs(scales_ptr, rows + up_row_offset, n_mask, blocks_per_row,
                                                          t, WPS)
            acc_u += w2_word_dot_bf16x2(w_u, x0, x1, x2, x3, x4, x5, x6, x7, v0, v1, v2, v3, v4, v5, v6, v7)
        w_g = w_g_next
        w_u = w_u_next
    return tl.sum(acc_g, axis=1)[:, None], tl.sum(acc_u, axis=1)[:, None]


@triton.jit
def _fp4_scale_words(scales_ptr, rows, n_mask, blocks_per_row, t, WPS: tl.constexpr):
    """The scale words of FP4 K tile t for `rows` ([BN] each): 8 blocks (q0, q1) when WPS = 32, 4 (q0) when 16."""
    words = scales_ptr.to(tl.pointer_type(tl.int32)) + (rows * blocks_per_row) // 4 + t * (WPS // 16)
    q0 = tl.load(words, mask=n_mask, other=0)
    q1 = q0
    if WPS == 32:
        q1 = tl.load(words + 1, mask=n_mask, other=0)
    return q0, q1


@triton.jit
def _fp4_tile_bf16x2(
    words_ptr, scales_ptr, rows, n_mask, a_row_ptr, K, words_per_row, blocks_per_row, up_row_offset,
    GATED: tl.constexpr, WPS: tl.constexpr, BN: tl.constexpr,
):
    """GPU fast path of `_tier_tile_fma` for FP4 with bfloat16 activations (v8, inline PTX).

    Per word: e2m1 -> bf16x2 by lookup (`fp4_word_dot_bf16x2`, exact), one packed multiply by the
    power-of-two scale pair times 4 (exact for every scale byte; the 4 is removed per row at the end),
    one packed FMA per slot pair; the four
    products of a word are summed in bf16x2, then join the float32 accumulator. Scale pairs from
    one or two word loads per row and tile; next tile's words prefetched (as `_w2_tile_bf16x2`).
    """
    TILE_K: tl.constexpr = 8 * WPS
    u, gate_rows, up_rows, acc_g, acc_u, tiles, w_g, w_u = _prefetch_start(
        words_ptr, rows, n_mask, words_per_row, up_row_offset, GATED, WPS, BN)
    for t in range(0, tiles):
        w_g_next, w_u_next = _next_tile_words(words_ptr, gate_rows, up_rows, n_mask, t, tiles, GATED, WPS)
        k0 = t * TILE_K + u
        x0, x1, x2, x3 = _x_pairs4(a_row_ptr, k0, K, WPS)
        q0, q1 = _fp4_scale_words(scales_ptr, rows, n_mask, blocks_per_row, t, WPS)
        g0, g1, g2, g3 = fp4_scale_pairs(q0, q1, WPS)
        acc_g += fp4_word_dot_bf16x2(w_g, x0, x1, x2, x3, g0[:, None], g1[:, None], g2[:, None], g3[:, None])
        if GATED:
            q0, q1 = _fp4_scale_words(scales_ptr, rows + up_row_offset, n_mask, blocks_per_row, t, WPS)
            v0, v1, v2, v3 = fp4_scale_pairs(q0, q1, WPS)
            acc_u += fp4_word_dot_bf16x2(w_u, x0, x1, x2, x3, v0[:, None], v1[:, None], v2[:, None], v3[:, None])
        w_g = w_g_next
        w_u = w_u_next
    return tl.sum(acc_g, axis=1)[:, None] * FP4_SCALE_UNBIAS, tl.sum(acc_u, axis=1)[:, None] * FP4_SCALE_UNBIAS


@triton.jit
def _fp4_pairs_fma(acc, w, s0, s1, s2, s3, a_row_ptr, k0, K, WPS: tl.constexpr):
    """Plain twin of one FP4 word tile: the bf16x2 pairs and scale pairs of the PTX path, bit for bit,
    then float32 arithmetic (slot order 0..7, (weight * scale) * x added to acc, as `_tier_tile_fma`)."""
    p0, p1, p2, p3 = fp4_word_pairs(w)
    for i in tl.static_range(4):
        if i == 0:
            p = p0
            s = s0
        elif i == 1:
            p = p1
            s = s1
        elif i == 2:
            p = p2
            s = s2
        else:
            p = p3
            s = s3
        v_lo, v_hi = bf16x2_halves(p)
        c_lo, c_hi = bf16x2_halves(s)
        k_lo = k0 + 2 * i * WPS
        k_hi = k_lo + WPS
        x_lo = tl.load(a_row_ptr + k_lo, mask=k_lo < K, other=0.0).to(tl.float32)[None, :]
        x_hi = tl.load(a_row_ptr + k_hi, mask=k_hi < K, other=0.0).to(tl.float32)[None, :]
        acc += v_lo * c_lo * x_lo
        acc += v_hi * c_hi * x_hi
    return acc


@triton.jit
def _fp4_tile_pairs(
    words_ptr, scales_ptr, rows, n_mask, a_row_ptr, K, words_per_row, blocks_per_row, up_row_offset,
    GATED: tl.constexpr, WPS: tl.constexpr, BN: tl.constexpr,
):
    """Plain-Triton twin of `_fp4_tile_bf16x2` (CPU interpreter, fp32/fp16, or forced on the GPU): the same
    integer bit construction of weights and scales; float32 products and sums, so its result equals
    `_tier_tile_fma`'s for FP4 bit for bit (products exact in both, the bias of 4 removed exactly) unless
    a product or sum falls below float32's normal range."""
    TILE_K: tl.constexpr = 8 * WPS
    u = tl.arange(0, WPS)
    gate_rows, up_rows = _gate_up_offsets(rows, u, words_per_row, up_row_offset)  # [BN, WPS]
    acc_g = tl.zeros([BN, WPS], tl.float32)
    acc_u = tl.zeros([BN, WPS], tl.float32)
    for t in range(0, words_per_row // WPS):
        k0 = t * TILE_K + u
        w_g = tl.load(words_ptr + gate_rows + t * WPS, mask=n_mask[:, None], other=0)
        q0, q1 = _fp4_scale_words(scales_ptr, rows, n_mask, blocks_per_row, t, WPS)
        g0, g1, g2, g3 = fp4_scale_pairs_ref(q0[:, None], q1[:, None], WPS)
        acc_g = _fp4_pairs_fma(acc_g, w_g, g0, g1, g2, g3, a_row_ptr, k0, K, WPS)
        if GATED:
            w_u = tl.load(words_ptr + up_rows + t * WPS, mask=n_mask[:, None], other=0)
            q0, q1 = _fp4_scale_words(scales_ptr, rows + up_row_offset, n_mask, blocks_per_row, t, WPS)
            v0, v1, v2, v3 = fp4_scale_pairs_ref(q0[:, None], q1[:, None], WPS)
            acc_u = _fp4_pairs_fma(acc_u, w_u, v0, v1, v2, v3, a_row_ptr, k0, K, WPS)
    return tl.sum(acc_g, axis=1)[:, None] * FP4_SCALE_UNBIAS, tl.sum(acc_u, axis=1)[:, None] * FP4_SCALE_UNBIAS


@triton.jit
def _w2_base(w2_table_ptr, stream_at_ptr, key, w2_slot_bytes, STREAM: tl.constexpr):
    """The expert's W2 bytes as an offset from the pool's slots: its slot's, or (STREAM) for an expert without a slot
    its row in the pinned arena (`TierPool.stream_at`, the route gave it blocks only when it has one)."""
    slot = tl.load(w2_table_ptr + key).to(tl.int64)
    base = slot * w2_slot_bytes
    if STREAM:
        base = tl.where(slot >= 0, base, tl.load(stream_at_ptr + key, mask=slot < 0, other=0))
    return base


@triton.jit
def _fma_one_pair(
    a_row_ptr, rows, n_mask, K, num_blocks_k, N_OUT, f4_slot, expert, table_row, w2_table_ptr, stream_at_ptr,
    w2_words_ptr, w2_scales_ptr, w2_slot_bytes, w2_words_off, w2_scales_off, w2_words_per_row, w2_blocks_per_row,
    f4_words_ptr, f4_scales_ptr, f4_slot_bytes, f4_words_off, f4_scales_off, f4_words_per_row, f4_blocks_per_row,
    GATED: tl.constexpr, W2_WPS: tl.constexpr, F4_WPS: tl.constexpr, BN: tl.constexpr, PTX_W2: tl.constexpr,
    FP4_MODE: tl.constexpr = 0, STREAM: tl.constexpr = False,
):
    """One pair on CUDA-core FMAs (the BT = 1 path): FP4 slot if present, else W2 (inline PTX when PTX_W2; STREAM:
    from the arena row of an expert without a W2 slot, `_w2_base`).

    FP4_MODE: 0 = nibble decode via float16 bits; 1 = v8 bf16x2 bit construction, plain-Triton twin;
    2 = v8 inline PTX (bf16 on CUDA, the default). All three decode every scale byte exactly.
    """
    if f4_slot >= 0:
        base = f4_slot.to(tl.int64) * f4_slot_bytes
        if FP4_MODE == 2:
            acc_g, acc_u = _fp4_tile_bf16x2(
                f4_words_ptr + tl.multiple_of((base + f4_words_off) // 4, 4), f4_scales_ptr + base + f4_scales_off,
                rows, n_mask, a_row_ptr, K, f4_words_per_row, f4_blocks_per_row, N_OUT, GATED, F4_WPS, BN,
            )
        elif FP4_MODE == 1:
            acc_g, acc_u = _fp4_tile_pairs(
                f4_words_ptr + (base + f4_words_off) // 4, f4_scales_ptr + base + f4_scales_off,
                rows, n_mask, a_row_ptr, K, f4_words_per_row, f4_blocks_per_row, N_OUT, GATED, F4_WPS, BN,
            )
        else:
            acc_g, acc_u = _tier_tile_fma(
                f4_words_ptr + (base + f4_words_off) // 4, f4_scales_ptr + base + f4_scales_off, rows, n_mask,
                a_row_ptr, K, num_blocks_k, f4_words_per_row, f4_blocks_per_row, N_OUT,
                GATED, False, F4_WPS, BN,
            )
    else:
        base = _w2_base(w2_table_ptr, stream_at_ptr, table_row + expert, w2_slot_bytes, STREAM)
        if PTX_W2:
            acc_g, acc_u = _w2_tile_bf16x2(
                w2_words_ptr + tl.multiple_of((base + w2_words_off) // 4, 4), w2_scales_ptr + base + w2_scales_off,
                rows, n_mask, a_row_ptr, K, w2_words_per_row, w2_blocks_per_row, N_OUT, GATED, W2_WPS, BN,
            )
        else:
            acc_g, acc_u = _tier_tile_fma(
                w2_words_ptr + (base + w2_words_off) // 4, w2_scales_ptr + base + w2_scales_off, rows, n_mask,
                a_row_ptr, K, num_blocks_k, w2_words_per_row, w2_blocks_per_row, N_OUT,
                GATED, True, W2_WPS, BN,
            )
    return acc_g, acc_u


@triton.jit
def moe_gemm_kernel(
    a_ptr, stride_a, out_ptr, stride_out,
    w2_words_ptr, w2_scales_ptr, w2_slot_bytes, w2_words_off, w2_scales_off, w2_words_per_row, w2_blocks_per_row,
    f4_words_ptr, f4_scales_ptr, f4_slot_bytes, f4_words_off, f4_scales_off, f4_words_per_row, f4_blocks_per_row,
    w2_table_ptr, f4_table_ptr, table_row, stream_at_ptr,
    block_expert_ptr, block_fill_ptr, block_pairs_ptr, num_blocks_ptr,
    N_OUT, K, top_k, limit,
    GATED: tl.constexpr, HAS_LIMIT: tl.constexpr, ROWS_ARE_TOKENS: tl.constexpr,
    W2_WPS: tl.constexpr, F4_WPS: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr, PRECISION: tl.constexpr,
    PTX_W2: tl.constexpr, FP4_MODE: tl.constexpr = 0, STREAM: tl.constexpr = False,
):
    b = tl.program_id(0)
    if b >= tl.load(num_blocks_ptr):
        return
    n_tile = tl.program_id(1)
    expert = tl.load(block_expert_ptr + b)
    fill = tl.load(block_fill_ptr + b)
    lanes = tl.arange(0, BT)
    lane_ok = lanes < fill
    pairs = tl.load(block_pairs_ptr + b * BT + lanes, mask=lane_ok, other=0)  # [BT]
    a_rows = pairs // top_k if ROWS_ARE_TOKENS else pairs
    rows = n_tile * BN + tl.arange(0, BN)  # [BN]
    n_mask = rows < N_OUT
    num_blocks_k = K // 32

    f4_slot = tl.load(f4_table_ptr + table_row + expert)
    if BT == 1:
        a_row_ptr = a_ptr + tl.sum(a_rows, axis=0).to(tl.int64) * stride_a
        acc_g, acc_u = _fma_one_pair(
            a_row_ptr, rows, n_mask, K, num_blocks_k, N_OUT, f4_slot, expert, table_row, w2_table_ptr, stream_at_ptr,
            w2_words_ptr, w2_scales_ptr, w2_slot_bytes, w2_words_off, w2_scales_off, w2_words_per_row, w2_blocks_per_row,
            f4_words_ptr, f4_scales_ptr, f4_slot_bytes, f4_words_off, f4_scales_off, f4_words_per_row, f4_blocks_per_row,
            GATED, W2_WPS, F4_WPS, BN, PTX_W2, FP4_MODE, STREAM,
        )
    elif f4_slot >= 0:
        base = f4_slot.to(tl.int64) * f4_slot_bytes
        acc_g, acc_u = _tier_tile(
            f4_words_ptr + (base + f4_words_off) // 4, f4_scales_ptr + base + f4_scales_off, rows, n_mask,
            a_ptr, a_rows, stride_a, K, num_blocks_k, f4_words_per_row, f4_blocks_per_row, N_OUT,
            GATED, False, F4_WPS, BN, BT, PRECISION,
        )
    else:
        base = _w2_base(w2_table_ptr, stream_at_ptr, table_row + expert, w2_slot_bytes, STREAM)
        acc_g, acc_u = _tier_tile(
            w2_words_ptr + (base + w2_words_off) // 4, w2_scales_ptr + base + w2_scales_off, rows, n_mask,
            a_ptr, a_rows, stride_a, K, num_blocks_k, w2_words_per_row, w2_blocks_per_row, N_OUT,
            GATED, True, W2_WPS, BN, BT, PRECISION,
        )

    if GATED:
        gate = acc_g
        up = acc_u
        if HAS_LIMIT:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        result = gate * tl.sigmoid(gate) * up
    else:
        result = acc_g
    out = out_ptr + pairs[None, :].to(tl.int64) * stride_out + rows[:, None]  # [BN, BT]
    tl.store(out, result.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & lane_ok[None, :])
