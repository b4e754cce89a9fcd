// W2 matrices packed with 16 words per bit slot (WPS 16: K not a multiple of 512, e.g. the down matrix of an expert
// inter of 1408 or 768; kernels/layout.py), for the down kernels built with W2_WPS 16 (w2_down.cu, w2_down_multi.cu).
//
// Two 16-word tiles side by side, 2t in words 0..15 and 2t + 1 in words 16..31 of "pair tile" t, occupy exactly the
// bytes of one 32-word tile, so a pair tile goes through the 32-word tile's loads, decode and mmas
// (w2_fragments.cuh) with two changes:
//   - K order: word u < 16, bit slot j holds k = 512t + 16j + u, word 16 + u holds the same 256 values later; the
//     activation pairs in shared memory follow (`load_unit16`), zero from the matrix's real K on (the last tile's
//     padding, and the whole second half of a pair tile whose 16-word tile 2t + 1 does not exist);
//   - scales: slots 2i and 2i + 1 of a 16-word tile share one 32-value scale block, byte i of that tile's 8, so the
//     lower words' bf16x2 take byte i of tile 2t in both halves and the upper words' byte i of tile 2t + 1
//     (`scale_both`).
// A last pair tile with one 16-word tile (an odd count) reads that tile twice: the second copy meets activation pairs
// that are zero, and a finite weight (every scale byte <= 240 decodes finite) times zero adds an exact zero. The same
// holds for the padding inside the last real tile.

#pragma once

#include <cstdint>

#include "w2_fragments.cuh"

// W2_WPS: words per bit slot of the w2 matrix the including down kernel reads (kernels/layout.py): 32 (the default:
// these helpers go unused) or 16 (inter not a multiple of 512).
#ifndef W2_WPS
#define W2_WPS 32
#endif
#if W2_WPS != 32 && W2_WPS != 16
#error "W2_WPS is 32 or 16"
#endif

namespace {

// Scale byte j (< 16) of q in both bf16 exponent fields: (byte j << 7) | (byte j << 23).
__device__ __forceinline__ uint32_t scale_both(const uint4& q, int j) {
  return __byte_perm(part(q, j >> 2), 0u, 0x4040u | (j & 3) * 0x0101u) << 7;
}

// Pair tile t of a warp's two A rows (ra / rb: words as uint4; sa / sb: scales, 8 bytes per 16-word tile); tiles16:
// the rows' 16-word tiles. The same 16-byte word loads as load_tile; the scale bytes of tile 2t in .sa / .sb bytes
// 0..7, of tile 2t + 1 in bytes 8..15. Where tile 2t + 1 does not exist (an odd count), words and scales of tile 2t
// are loaded again in its place (no load past the row; no branch): finite weights, which meet zero activations.
template <class Loads = GlobalLoads>
__device__ __forceinline__ Tile load_tile16(const uint4* ra, const uint4* rb, const uint2* sa, const uint2* sb, int t,
                                            int c, int tiles16, Loads ld = {}) {
  const int hi = min(2 * t + 1, tiles16 - 1);  // the upper 16-word tile, or tile 2t again
  Tile r;
  r.a0 = ld(ra + 8 * t + c);
  r.a1 = ld(ra + 4 * hi + c);
  r.b0 = ld(rb + 8 * t + c);
  r.b1 = ld(rb + 4 * hi + c);
  const uint2 sa_lo = ld(sa + 2 * t), sa_hi = ld(sa + hi), sb_lo = ld(sb + 2 * t), sb_hi = ld(sb + hi);
  r.sa = make_uint4(sa_lo.x, sa_lo.y, sa_hi.x, sa_hi.y);
  r.sb = make_uint4(sb_lo.x, sb_lo.y, sb_hi.x, sb_hi.y);
  return r;
}

// tile_mma of a pair tile: A registers 0 / 1 (words 4c..4c+3) scaled by tile 2t's bytes, 2 / 3 (words 16+4c..) by
// tile 2t + 1's; the B pairs as tile_mma reads them.
__device__ __forceinline__ void tile_mma16(const Tile& w, const uint32_t* xp_tile, int c, float (&acc)[2][4]) {
  tile_mma_scaled(w, xp_tile, c, acc, [](const uint4& q, int i, bool upper) { return scale_both(q, upper ? 8 + i : i); });
}

// Unit q = (t * 8 + i) * 4 + c of a pair tile's activations, in load_unit's Unit order: the pair of word u < 16 is
// a[512t + 32i + u] | a[512t + 32i + 16 + u] << 16, of word 16 + u the same 256 values on; runs of 4 at or past
// k_real (a multiple of 4) are zero and not read. load(p): the 4 activations (uint2) at p.
template <class Load>
__device__ __forceinline__ Unit load_unit16(const uint16_t* __restrict__ a, int q, int k_real, Load load) {
  const int k = (q >> 5) * kTileK + ((q >> 2) & 7) * 32 + 4 * (q & 3);
  const auto run = [&](int at) { return at < k_real ? load(a + at) : make_uint2(0u, 0u); };
  Unit u;
  u.la = run(k);
  u.lb = run(k + 256);
  u.ha = run(k + 16);
  u.hb = run(k + 272);
  return u;
}

// Four activations at p with a plain load (the non-PDL builds' act reads).
__device__ __forceinline__ uint2 load_act4(const uint16_t* p) { return *reinterpret_cast<const uint2*>(p); }

// Pair tiles of a row of `words_per_row` words (16 per 16-word tile): the last one may hold a single 16-word tile.
__host__ __device__ __forceinline__ int pair_tiles(int words_per_row) { return (words_per_row + 31) / 32; }

}  // namespace
