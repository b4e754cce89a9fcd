// Device code of the FP4 tensor-core stages (fp4_moe.cu): the FP4 word tile, the exact e2m1 -> bf16x2 decode
// with the layout's scales, a lane's 16-byte tile loads, the 16 mma.m16n8k16 of one K tile and the activation
// pairs in shared memory. Independent of the W2 headers (so the W2 files can change independently) but for
// bf16_mma.cuh: the mma, `part`, the tile loads and the pair unit's store, the same for both formats.
//
// Layout (kernels/layout.py, fp4_slot_layout, K a multiple of 256): a row's words are cut into tiles of 32
// words x 8 nibbles = 256 K values; value k = 32 j + u of a tile is nibble j (bits 4j..4j+3) of word u, so
// nibble slot j of a tile is one 32-value scale block (the tile's scale byte j). A nibble is e2m1: bit 3 the
// sign, bits 0..2 the magnitude index v of {0, .5, 1, 1.5, 2, 3, 4, 6}; value = e2m1 * 2^(byte - 127).
//
// Decode of byte i of a word (nibbles 2i low half, 2i+1 high half) into one bf16x2 register:
//   1. the unscaled e2m1 values as bf16 bits, looked up with PRMT (every e2m1 value is 0 or a normal bf16):
//      low bytes from an 8-byte table indexed by v, high bytes (sign | exponent bits) from an 8-byte table
//      indexed by (sign, e1, v != 0); two PRMTs per 4 nibbles, then one PRMT per pair interleaves them;
//   2. one mul.rn.bf16x2 by the pair's scales as bf16, 2^(byte - 125) = exponent field byte + 2: exact,
//      because e2m1 * 2^(byte - 125) is zero or a normal bf16 for every byte 0..240 the layout admits
//      (smallest 0.5 * 2^-125 = 2^-126; largest 6 * 2^115). The stages multiply their fp32 sums by 0.25
//      once (exact): the 2^2 bias of the Triton v8 decode.
//
// Fragments (as the W2 stages): a warp's mma A tile is two 8-row halves, `a` (A rows 0..7) and `b` (rows
// 8..15); lane (g = lane / 4, c = lane % 4) loads words 4c..4c+3 and 16+4c..16+4c+3 of each K tile of row g
// of each half (two 16-byte loads per row) and the row's 8 tile scale bytes (one 8-byte load). A register a0
// (row g) / a1 (row g + 8) carries byte i of word 4c+m, a2 / a3 byte i of word 16+4c+m; B carries the matching
// activation pairs, xp[t*128 + 32i + 8c + 2m + h] = pair of word 16h + 4c + m, byte i, identical in all eight
// columns, so every column of D is the row's dot product.

#pragma once

#include <cstdint>

#include "bf16_mma.cuh"  // part, mma_bf16, WordTile, load_tile, Unit, store_unit

// FP4_DECODE_MAD 1: the decode's right shifts (the selectors' w >> 1, w >> 2 and upper halves >> 16) as the high word
// of a multiply by 2^(32 - n) (PTX mul.hi.u32: IMAD.HI on the FMA pipe) instead of SHF on the integer ALU, which the
// PRMT lookups and LOP3 masks keep busy. The same bits. 0 (default): the SASS of before.
#ifndef FP4_DECODE_MAD
#define FP4_DECODE_MAD 0
#endif

namespace {

constexpr int kF4Wps = 32;              // words per nibble slot
constexpr int kF4TileK = 8 * kF4Wps;    // 256 K values per word tile
constexpr int kF4TilePairs = kF4TileK / 2;  // 128 activation pairs per tile in shared memory

// PRMT tables. Low bytes by v = e1 e0 m: {00, 00, 80, C0, 00, 40, 80, C0}; high bytes by
// (s << 2 | e1 << 1 | (v != 0)): {00, 3F, --, 40, 80, BF, --, C0} (index 2 and 6 cannot occur).
constexpr uint32_t kLoTable0 = 0xC0800000u, kLoTable1 = 0xC0804000u;
constexpr uint32_t kHiTable0 = 0x40003F00u, kHiTable1 = 0xC080BF80u;

using F4Tile = WordTile<uint2>;  // one lane's share of one K tile (bf16_mma.cuh), 8 scale bytes per row

// The word's PRMT selectors: lo nibble k = v_k; hi nibble k = s_k << 2 | e1_k << 1 | (v_k != 0). Bit 3 of each
// selector nibble is 0 (PRMT's sign-replicate mode is never used).
struct Selectors {
  uint32_t lo, hi;
};

// x >> n for n in 0..31 (FP4_DECODE_MAD: for n > 0 the high word of x * 2^(32 - n)).
__device__ __forceinline__ uint32_t f4_shr(uint32_t x, int n) {
#if FP4_DECODE_MAD
  if (n == 0) return x;
  uint32_t r;
  asm("mul.hi.u32 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(1u << (32 - n)));
  return r;
#else
  return x >> n;
#endif
}

__device__ __forceinline__ Selectors f4_selectors(uint32_t w) {
  const uint32_t nonzero = (w | f4_shr(w, 2)) & 0x11111111u;  // bit 4k: m | e1 (e0 comes in from w >> 1 below)
  return {w & 0x77777777u, (f4_shr(w, 1) & 0x77777777u) | nonzero};
}

// prmt.b32 (default mode) in inline PTX: the compiler does not re-mask the selector's unused upper half, as it
// does for __byte_perm (3 instead of 2 instructions per selector pair in SASS).
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// Byte i of the word (nibbles 2i, 2i+1) as unscaled bf16x2 (nibble 2i in the low half).
__device__ __forceinline__ uint32_t f4_pair_bits(const Selectors& s, int i) {
  const int shift = (i >> 1) * 16;  // PRMT reads selector bits 0..15: nibbles 4 (i >> 1) .. 4 (i >> 1) + 3
  const uint32_t lo = prmt(kLoTable0, kLoTable1, f4_shr(s.lo, shift));
  const uint32_t hi = prmt(kHiTable0, kHiTable1, f4_shr(s.hi, shift));
  return __byte_perm(lo, hi, (i & 1) ? 0x7362u : 0x5140u);
}

// Scale bytes 2i and 2i+1 of a tile (q: the 8 bytes with the bias 2 already added) -> the bf16x2
// 2^(byte - 125) of each half: (byte 2i + 2) << 7 | (byte 2i+1 + 2) << 23.
__device__ __forceinline__ uint32_t f4_scale_pair(const uint2& q, int i) {
  const uint32_t word = (i >> 1) ? q.y : q.x;
  return __byte_perm(word, 0u, (i & 1) ? 0x4342u : 0x4140u) << 7;
}

// The exponent bias 2 on all 8 scale bytes (bytes <= 240: no carry between bytes).
__device__ __forceinline__ uint2 f4_biased(uint2 q) {
  return make_uint2(q.x + 0x02020202u, q.y + 0x02020202u);
}

__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

// One K tile's 16 mmas (4 words x 4 bytes, 16 rows x 16 K each), word by word (the word's four pairs decoded once),
// acc[i & 1] alternating, with the bf16x2 scales of byte i: rows g / g + 8 of words 4c.. (A registers 0 / 1) by
// sa_lo / sb_lo, of words 16+4c.. (2 / 3) by sa_hi / sb_hi (`tile_mma`: the same for both halves; fp4_half_tiles.cuh:
// each half its own 16-word tile's).
__device__ __forceinline__ void tile_mma_scaled(const F4Tile& w, const uint32_t* xp_tile, int c, float (&acc)[2][4],
                                                const uint32_t (&sa_lo)[4], const uint32_t (&sb_lo)[4],
                                                const uint32_t (&sa_hi)[4], const uint32_t (&sb_hi)[4]) {
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const Selectors s0 = f4_selectors(part(w.a0, m)), s1 = f4_selectors(part(w.b0, m));
    const Selectors s2 = f4_selectors(part(w.a1, m)), s3 = f4_selectors(part(w.b1, m));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint2 bq = *reinterpret_cast<const uint2*>(xp_tile + i * 32 + 8 * c + 2 * m);  // B: words 4c+m, 16+4c+m
      mma_bf16(acc[i & 1], mul_bf16x2(f4_pair_bits(s0, i), sa_lo[i]), mul_bf16x2(f4_pair_bits(s1, i), sb_lo[i]),
               mul_bf16x2(f4_pair_bits(s2, i), sa_hi[i]), mul_bf16x2(f4_pair_bits(s3, i), sb_hi[i]), bq.x, bq.y);
    }
  }
}

// One K tile: 4 words x 4 bytes = 16 mmas, every word scaled by the tile's bytes 2i, 2i+1.
__device__ __forceinline__ void tile_mma(const F4Tile& w, const uint32_t* xp_tile, int c, float (&acc)[2][4]) {
  const uint2 qa = f4_biased(w.sa), qb = f4_biased(w.sb);
  uint32_t sa[4], sb[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    sa[i] = f4_scale_pair(qa, i);
    sb[i] = f4_scale_pair(qb, i);
  }
  tile_mma_scaled(w, xp_tile, c, acc, sa, sb, sa, sb);
}

// Activation row a [K] bf16 bits -> xp [K / 2] in B register order. Unit q = (t * 4 + i) * 4 + c holds
// xp[8q .. 8q+7]: xp[8q + 2m + h] = a[k0 + 16h + m] | a[k0 + 32 + 16h + m] << 16, k0 = 64 (q >> 2) + 4 (q & 3).
__device__ __forceinline__ Unit f4_load_unit(const uint16_t* __restrict__ a, int q) {
  const int k0 = 64 * (q >> 2) + 4 * (q & 3);
  return {*reinterpret_cast<const uint2*>(a + k0), *reinterpret_cast<const uint2*>(a + k0 + 16),
          *reinterpret_cast<const uint2*>(a + k0 + 32), *reinterpret_cast<const uint2*>(a + k0 + 48)};
}

using Rows = TileRows<uint2>;  // a warp's two A rows for first_loads / k_loop (bf16_mma.cuh), 32-word tiles

// A lane's two A rows of the slot at `base`: ra (scales sa) at row n, rb (sb) `apart` rows further (the gate_ups: the
// up row, inter rows on; the downs: 8).
__device__ __forceinline__ Rows rows_at(const uint8_t* base, long long words_off, long long scales_off,
                                        int words_per_row, int blocks_per_row, int n, int apart) {
  const long long row_vecs = words_per_row / 4, scale_vecs = blocks_per_row / 8;
  Rows r;
  r.ra = reinterpret_cast<const uint4*>(base + words_off) + n * row_vecs;
  r.rb = r.ra + apart * row_vecs;
  r.sa = reinterpret_cast<const uint2*>(base + scales_off) + n * scale_vecs;
  r.sb = r.sa + apart * scale_vecs;
  return r;
}

// All of a block's threads: up to 4 units per thread per round, every load of a round issued before its stores.
__device__ __forceinline__ void f4_build_pairs(const uint16_t* __restrict__ a, uint32_t* xp, int k_len) {
  constexpr int kUnroll = 4;
  const int units = k_len / 16, step = static_cast<int>(blockDim.x);
  for (int q0 = threadIdx.x; q0 < units; q0 += kUnroll * step) {
    Unit u[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) u[j] = f4_load_unit(a, min(q0 + j * step, units - 1));
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      if (q0 + j * step < units) store_unit(xp, q0 + j * step, u[j]);
    }
  }
}

}  // namespace
