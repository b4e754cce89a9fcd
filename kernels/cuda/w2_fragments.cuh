// Device code shared by w2_gate_up.cu and w2_down.cu: the W2 word tile (WPS = 32 words per bit slot, 512 K
// values, each bit slot one 32-value scale block), the decode of a word's slot pairs into bf16x2, the
// 16-byte tile loads of one lane and the 32 mma.m16n8k16 of one K tile.
//
// Decode: slot pair i of a word (slots 2i, 2i+1) becomes one bf16x2 register in two instructions:
// LOP3 (mask the pair's four bits where they lie) and LEA.HI (rotate left by 8 - 2i and add the pair's
// scale bytes, placed in both exponent fields). The magnitude bit lands on exponent bit 1 and the sign on
// bit 15/31, so the register is +-{1, 4} * 2^(byte - 127) for each half, exact.
//
// Fragments: a warp's mma A tile is two 8-row halves, `a` (A rows 0..7) and `b` (rows 8..15); lane
// (g = lane / 4, c = lane % 4) loads words 4c..4c+3 and 16+4c..16+4c+3 of each K tile of row g of each half
// (16-byte loads). A register a0 (row g) / a1 (row g+8) carries word 4c+m, a2 / a3 word 16+4c+m, slot pair i;
// B carries the matching activation pairs (`build_pairs` in each .cu: xp[t*256 + i*32 + 8c + 2m + h] = pair
// of word 16h + 4c + m), the same in all eight columns, so all columns of D are equal.

#pragma once

#include <cstdint>

#include "bf16_mma.cuh"  // part, mma_bf16, WordTile, load_tile, Unit, store_unit

// W2_DECODE_MAD 1 (v5, benchmarks/cuda-w2-notes.md): slot pairs 0..4 decoded by a multiply-add instead of a rotate-add
// (`w2_pair`); the same bits out. 0 (default): the SASS of before.
#ifndef W2_DECODE_MAD
#define W2_DECODE_MAD 0
#endif

// W2_PAIR_ORDER 1 (w2_gate_up.cu, w2_down.cu; with W2_EARLY, set on the command line): block b is routed pair b, its
// expert read from the router's topk ids instead of the route output, so the routing kernel may run beside the grid
// (kernels/moe_mm.py `moe_mm`). 0 (default): route order, the SASS of before.
#ifndef W2_PAIR_ORDER
#define W2_PAIR_ORDER 0
#endif
#if W2_PAIR_ORDER && !W2_EARLY
#error "W2_PAIR_ORDER needs W2_EARLY"
#endif

// W2_STREAM 1 (w2_gate_up.cu, w2_down.cu; with W2_PAIR_ORDER): a pair whose expert has no W2 slot but a row in the
// pinned host arena (the last argument, `stream_at`, nonzero) is computed from that row over the bus, the same bytes
// as a slot (tierstore/runtime/stream_rows.py). 0 (default): such a pair is skipped (a miss), the SASS of before.
#ifndef W2_STREAM
#define W2_STREAM 0
#endif
#if W2_STREAM && !W2_PAIR_ORDER
#error "W2_STREAM needs W2_PAIR_ORDER"
#endif
// W2_STREAM_PREFETCH 1 (with W2_STREAM): a streamed pair's block first asks its rows' bytes into L2 with bulk prefetches
// (`prefetch_region_l2`), so they cross the bus in large requests instead of the tile loads' 64-byte pieces; a hint
// only, the same bytes out.
#ifndef W2_STREAM_PREFETCH
#define W2_STREAM_PREFETCH 0
#endif
#if W2_STREAM_PREFETCH && !W2_STREAM
#error "W2_STREAM_PREFETCH needs W2_STREAM"
#endif
// W2_STREAM_STAGE 1 (with W2_STREAM): a streamed pair's block first copies its rows' words and scales, each a
// contiguous run of the arena row, into shared memory after its activation pairs (`stage_region`: every copy
// instruction of a warp reads 512 contiguous bytes, where the tile loads read 64 bytes of each of eight rows), then
// runs its K loop from there (SharedLoads). Only where the launch's dynamic shared memory holds the stage (the host
// sizes it: `stream_stage_bytes` in w2_gate_up.py / w2_down.py), else such a block reads as without (with the
// prefetch where built). Same bytes, same decode and mmas in the same order: the output does not change.
#ifndef W2_STREAM_STAGE
#define W2_STREAM_STAGE 0
#endif
#if W2_STREAM_STAGE && !W2_STREAM
#error "W2_STREAM_STAGE needs W2_STREAM"
#endif

namespace {

constexpr int kWps = 32;                     // words per bit slot
constexpr int kTileK = 16 * kWps;            // 512 K values per word tile
constexpr int kPairWordsPerTile = 8 * kWps;  // 256 activation pairs per tile in shared memory

using Tile = WordTile<uint4>;  // one lane's share of one K tile (bf16_mma.cuh), 16 scale bytes per row

// Scale bytes 2i and 2i+1 of a tile -> (byte 2i << 7) | (byte 2i+1 << 23): both bf16 exponent fields.
__device__ __forceinline__ uint32_t scale_pair(const uint4& q, int i) {
  return __byte_perm(part(q, i >> 1), 0u, (i & 1) ? 0x4342u : 0x4140u) << 7;
}

// Slot pair i of word w as bf16x2 (slot 2i low), scaled: mask, rotate by 8 - 2i, add the exponents.
__device__ __forceinline__ uint32_t w2_pair(uint32_t w, int i, uint32_t scale) {
  const uint32_t rot = (8u - 2u * i) & 31u;
  const uint32_t mask = rot ? (0x81008100u >> rot) | (0x81008100u << (32u - rot)) : 0x81008100u;
  const uint32_t m = w & mask;
#if W2_DECODE_MAD
  if (i <= 4) {
    // The pair's four bits lie 8 - 2i places below theirs (none wraps), so the rotation is a shift: m * 2^rot + scale
    // in one IMAD, which runs on the FMA pipe instead of the integer ALU that the masks (LOP3) and the rotations of
    // pairs 5..7 (LEA.HI) keep busy. Written in PTX: as C, nvcc splits it into more instructions.
    uint32_t r;
    asm("mad.lo.u32 %0, %1, %2, %3;" : "=r"(r) : "r"(m), "r"(1u << rot), "r"(scale));
    return r;
  }
#endif
  return __funnelshift_l(m, m, rot) + scale;
}

// build_pairs (in each .cu) turns an activation row a [K] bf16 into xp [K / 2] in B register order, in units
// of 8 pairs: unit q = (t * 8 + i) * 4 + c is xp[8q .. 8q+7], the pairs of words 4c..4c+3 and 16+4c..16+4c+3
// of slot pair i of tile t, where the pair of word u is a[t*512 + 64i + u] | a[t*512 + 64i + 32 + u] << 16
// (`Unit`, `store_unit`: bf16_mma.cuh).
__device__ __forceinline__ Unit load_unit(const uint16_t* __restrict__ a, int q) {
  const int k = (q >> 5) * kTileK + ((q >> 2) & 7) * 64 + 4 * (q & 3);
  Unit u;
  u.la = *reinterpret_cast<const uint2*>(a + k);
  u.lb = *reinterpret_cast<const uint2*>(a + k + 16);
  u.ha = *reinterpret_cast<const uint2*>(a + k + 32);
  u.hb = *reinterpret_cast<const uint2*>(a + k + 48);
  return u;
}

// One K tile's 32 mmas (8 slot pairs x 4 words, 16 rows x 16 K each) with the scale words `scale(q, i, upper)` gives
// slot pair i of the tile's scale bytes q: A registers 0 / 1 (words 4c..4c+3) take upper = false, 2 / 3 (words
// 16+4c..) upper = true (`tile_mma`: the same scales for both; w2_half_tiles.cuh: each half its own 16-word tile's).
template <class Scale>
__device__ __forceinline__ void tile_mma_scaled(const Tile& w, const uint32_t* xp_tile, int c, float (&acc)[2][4],
                                                Scale scale) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t sa_lo = scale(w.sa, i, false), sa_hi = scale(w.sa, i, true);
    const uint32_t sb_lo = scale(w.sb, i, false), sb_hi = scale(w.sb, i, true);
    const uint4 b01 = *reinterpret_cast<const uint4*>(xp_tile + i * 32 + 8 * c);      // B of m = 0, 1
    const uint4 b23 = *reinterpret_cast<const uint4*>(xp_tile + i * 32 + 8 * c + 4);  // B of m = 2, 3
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const uint4& bq = m < 2 ? b01 : b23;
      mma_bf16(acc[m & 1], w2_pair(part(w.a0, m), i, sa_lo), w2_pair(part(w.b0, m), i, sb_lo),
               w2_pair(part(w.a1, m), i, sa_hi), w2_pair(part(w.b1, m), i, sb_hi),
               part(bq, 2 * (m & 1)), part(bq, 2 * (m & 1) + 1));
    }
  }
}

// One K tile: 8 slot pairs x 4 words = 32 mmas (16 rows x 16 K each), both word halves scaled by bytes 2i, 2i+1.
__device__ __forceinline__ void tile_mma(const Tile& w, const uint32_t* xp_tile, int c, float (&acc)[2][4]) {
  tile_mma_scaled(w, xp_tile, c, acc, [](const uint4& q, int i, bool) { return scale_pair(q, i); });
}


// A block's (route block b, row tile): blockIdx (x, y), or with kRouteMajor (the v3 W2_ROUTE_MAJOR of w2_gate_up.cu /
// w2_down.cu) from the dispatch index (x fastest) with the route block slowest.
struct BlockTile {
  int b, row_tile;
};

template <bool kRouteMajor>
__device__ __forceinline__ BlockTile block_tile() {
  if (kRouteMajor) {
    const unsigned linear = blockIdx.y * gridDim.x + blockIdx.x;  // dispatch order: x fastest
    return {static_cast<int>(linear / gridDim.y), static_cast<int>(linear % gridDim.y)};
  }
  return {static_cast<int>(blockIdx.x), static_cast<int>(blockIdx.y)};
}

#if W2_STREAM_PREFETCH
// [at, at + bytes) (widened to 16-byte bounds, inside the arena row's page-aligned slot) asked into L2 by the block's
// threads, one bulk prefetch of up to kPrefetchChunk bytes each; no wait, no result.
constexpr unsigned kPrefetchChunk = 1024;
__device__ __forceinline__ void prefetch_region_l2(const uint8_t* at, long long bytes) {
  const unsigned long long begin = reinterpret_cast<unsigned long long>(at) & ~15ull;
  const unsigned long long end = (reinterpret_cast<unsigned long long>(at) + bytes + 15) & ~15ull;
  for (unsigned long long p = begin + threadIdx.x * kPrefetchChunk; p < end; p += blockDim.x * kPrefetchChunk) {
    const unsigned size = static_cast<unsigned>(end - p < kPrefetchChunk ? end - p : kPrefetchChunk);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(size) : "memory");
  }
}
#endif

using Rows = TileRows<uint4>;  // a warp's two A rows for first_loads / k_loop (bf16_mma.cuh)

__device__ __forceinline__ void copy_async_16(uint4* dst, const uint4* src) {
  const unsigned to = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(to), "l"(src) : "memory");
}

__device__ __forceinline__ void commit_copies() { asm volatile("cp.async.commit_group;" ::: "memory"); }

// Wait until at most `kPending` of this thread's committed copy groups are still in flight.
template <int kPending>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kPending) : "memory");
}

// The launch's dynamic shared memory in bytes (what the host passed).
__device__ __forceinline__ unsigned dynamic_shared_bytes() {
  unsigned bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
  return bytes;
}

// vecs 16-byte vectors from `at` (16-byte aligned) into shared memory `to`, by all of the block's threads, thread i
// copying vectors i, i + blockDim.x, ...: a warp's copy instruction reads 512 contiguous bytes. Not committed.
__device__ __forceinline__ void stage_region(uint4* to, const uint8_t* at, long long vecs) {
  const uint4* from = reinterpret_cast<const uint4*>(at);
  for (long long v = threadIdx.x; v < vecs; v += blockDim.x) copy_async_16(to + v, from + v);
}

}  // namespace
