// FP4 matrices packed with 16 words per nibble slot (WPS 16: K not a multiple of 256, e.g. the down matrix of an
// expert inter of 1408; kernels/layout.py), for the FP4 down kernels built with FP4_WPS 16 (fp4_moe.cu,
// fp4_moe_multi.cu): the FP4 counterpart of w2_half_tiles.cuh.
//
// A 16-word FP4 tile holds 128 K values, k = 16j + u in nibble j of word u, and 4 scale bytes (nibbles 2i and 2i + 1
// of a word, byte i, share 32-value block i). Two of them side by side, 2t in words 0..15 and 2t + 1 in words 16..31
// of "pair tile" t, occupy the bytes of one 32-word tile and go through its loads, PRMT decode and mmas
// (fp4_fragments.cuh) with three changes:
//   - K order: word u < 16, byte i holds k = 256t + 32i + u (low nibble) and + 16 (high nibble); word 16 + u the same
//     128 values later. The activation pairs follow (`f4_load_unit16`), zero from the matrix's real K on;
//   - scales: the lower words' bf16x2 take byte i of tile 2t's 4 in both halves, the upper words' byte i of tile
//     2t + 1's (`f4_scale_both`), with the fragments' exponent bias of 2;
//   - a last pair tile with one 16-word tile (an odd count) reads that tile twice (index clamped: no read past the
//     row); the copy meets zero activation pairs, and every decoded value is finite (zero or a normal bf16 for every
//     scale byte the layout admits), so it adds exact zeros, as does the padding inside the last real tile.

#pragma once

#include <cstdint>

#include "fp4_fragments.cuh"

// FP4_WPS: words per nibble slot of the down's w2 matrix (kernels/layout.py): 32 (the default: these helpers go
// unused) or 16 (inter not a multiple of 256).
#ifndef FP4_WPS
#define FP4_WPS 32
#endif
#if FP4_WPS != 32 && FP4_WPS != 16
#error "FP4_WPS is 32 or 16"
#endif

namespace {

// One lane's share of a pair tile: F4Tile's words, .sa / .sb = (tile 2t's 4 scale bytes, tile 2t + 1's). A type of
// its own, so that `tile_mma` picks the pair tiles' mmas.
struct F4PairTile : F4Tile {};

// A warp's two A rows over pair tiles: words as uint4 (ra, rb), scales 4 bytes per 16-word tile (sa, sb), and the
// rows' count of 16-word tiles.
struct F4PairRows {
  const uint4 *ra, *rb;
  const uint32_t *sa, *sb;
  int tiles16;
};

__device__ __forceinline__ int pair_tiles(const F4PairRows& r) { return (r.tiles16 + 1) / 2; }

// A lane's two down rows over pair tiles (both down kernels): ra (scales sa) at row n of the slot at `base`, rb (sb)
// 8 rows further.
__device__ __forceinline__ F4PairRows pair_rows_at(const uint8_t* base, long long words_off, long long scales_off,
                                                   int words_per_row, int blocks_per_row, int n) {
  const long long row_vecs = words_per_row / 4, scale_words = blocks_per_row / 4;
  F4PairRows r;
  r.ra = reinterpret_cast<const uint4*>(base + words_off) + n * row_vecs;
  r.rb = r.ra + 8 * row_vecs;
  r.sa = reinterpret_cast<const uint32_t*>(base + scales_off) + n * scale_words;
  r.sb = r.sa + 8 * scale_words;
  r.tiles16 = words_per_row / 16;
  return r;
}

// Pair tile t (bf16_mma.cuh's K loop calls it by the rows' type): the upper 16-word tile is 2t + 1, or 2t again.
__device__ __forceinline__ F4PairTile load_rows(const F4PairRows& r, int t, int c) {
  const int hi = min(2 * t + 1, r.tiles16 - 1);
  F4PairTile w;
  w.a0 = __ldg(r.ra + 8 * t + c);
  w.a1 = __ldg(r.ra + 4 * hi + c);
  w.b0 = __ldg(r.rb + 8 * t + c);
  w.b1 = __ldg(r.rb + 4 * hi + c);
  w.sa = make_uint2(__ldg(r.sa + 2 * t), __ldg(r.sa + hi));
  w.sb = make_uint2(__ldg(r.sb + 2 * t), __ldg(r.sb + hi));
  return w;
}

// Byte i (< 4) of a biased scale word in both bf16 exponent fields: 2^(byte - 125) in each half.
__device__ __forceinline__ uint32_t f4_scale_both(uint32_t word, int i) {
  return __byte_perm(word, 0u, 0x4040u | i * 0x0101u) << 7;
}

// tile_mma of a pair tile: A registers 0 / 1 (words 4c..4c+3) scaled by tile 2t's bytes, 2 / 3 (words 16+4c..) by
// tile 2t + 1's; the B pairs as tile_mma reads them.
__device__ __forceinline__ void tile_mma(const F4PairTile& w, const uint32_t* xp_tile, int c, float (&acc)[2][4]) {
  const uint2 qa = f4_biased(w.sa), qb = f4_biased(w.sb);
  uint32_t sa_lo[4], sa_hi[4], sb_lo[4], sb_hi[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    sa_lo[i] = f4_scale_both(qa.x, i);
    sa_hi[i] = f4_scale_both(qa.y, i);
    sb_lo[i] = f4_scale_both(qb.x, i);
    sb_hi[i] = f4_scale_both(qb.y, i);
  }
  tile_mma_scaled(w, xp_tile, c, acc, sa_lo, sb_lo, sa_hi, sb_hi);
}

// Unit q = (t * 4 + i) * 4 + c of a pair tile's activations, in f4_load_unit's Unit order: the pair of word u < 16,
// byte i, is a[256t + 32i + u] | a[256t + 32i + 16 + u] << 16, of word 16 + u the same 128 values on; runs of 4 at
// or past k_real (a multiple of 4) are zero and not read. load(p): the 4 activations (uint2) at p.
template <class Load>
__device__ __forceinline__ Unit f4_load_unit16(const uint16_t* __restrict__ a, int q, int k_real, Load load) {
  const int k = 256 * (q >> 4) + 32 * ((q >> 2) & 3) + 4 * (q & 3);
  const auto run = [&](int at) { return at < k_real ? load(a + at) : make_uint2(0u, 0u); };
  return {run(k), run(k + 128), run(k + 16), run(k + 144)};
}

// Four activations at p with a plain load (the non-PDL builds' act reads).
__device__ __forceinline__ uint2 f4_load_act4(const uint16_t* p) { return *reinterpret_cast<const uint2*>(p); }

// f4_build_pairs over pair tiles: xp [k_len / 2] (k_len: 256 per pair tile) from a [k_real], zero past k_real.
__device__ __forceinline__ void f4_build_pairs16(const uint16_t* __restrict__ a, uint32_t* xp, int k_len, int k_real) {
  constexpr int kUnroll = 4;
  const int units = k_len / 16, step = static_cast<int>(blockDim.x);
  for (int q0 = threadIdx.x; q0 < units; q0 += kUnroll * step) {
    Unit u[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) u[j] = f4_load_unit16(a, min(q0 + j * step, units - 1), k_real, f4_load_act4);
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      if (q0 + j * step < units) store_unit(xp, q0 + j * step, u[j]);
    }
  }
}

}  // namespace
