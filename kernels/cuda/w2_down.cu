// W2 down stage for decode (one routed pair per block row, the Triton path's BT = 1), on tensor cores.
//
//   y[pair, n] = W2_e[n] . act[pair]      (float32, n < H, K = I)
//
// Inputs are the Triton down stage's: the W2 pool's slot bytes (layout: kernels/layout.py, the w2 section
// [H, I]), its table and the FP4 table, the BT = 1 route output (block b -> expert, pair) and the gate_up
// stage's act [P, I] bf16. Output: the per-pair rows y [P, H] float32 the combine reads. H must be a multiple of
// 64 * GROUPS; K (= inter) a multiple of 512 (whole 32-word tiles, each bit slot one scale block), or, built with
// W2_WPS 16, any K the layout packs in 16-word tiles (w2_half_tiles.cuh: two of them read as one 32-word tile).
//
// An FP4-resident expert's pair is not this kernel's work, and no kernel of the CUDA path computes it: its
// y rows are written as NaN, so a layer with FP4 pairs run through the CUDA path shows up in the output
// instead of reading stale rows (kernels/cuda/w2_moe.py).
//
// Same decode and fragment mapping as w2_gate_up.cu (both: w2_fragments.cuh), ungated: one warp owns 16
// output rows = one mma.m16n8k16 A tile; lane (g = lane / 4, c = lane % 4) loads words 4c..4c+3 and
// 16+4c..16+4c+3 of each K tile of rows g and g + 8 (16-byte loads): a0 (row g) / a1 (row g+8) carry word
// 4c+m, a2 / a3 word 16+4c+m, slot pair i; B carries the matching activation pairs of act[pair], identical in
// all columns, so lane (g, 0) finds row g in d0 and lane (g, 1) row g + 8 in d2. fp32 accumulation, two
// accumulators alternating; no atomics, fixed order: repeated launches give identical bytes.
//
// Each warp runs GROUPS row groups of 16 one after another; the register ring of weight loads runs across
// group boundaries (W2_AHEAD tiles in flight while one is computed), so the next group's first loads are
// issued before the current group's last tile is computed.

#include <cstdint>
#include <cuda_bf16.h>

#include "w2_fragments.cuh"

#ifndef W2_AHEAD
#define W2_AHEAD 2  // K tiles whose loads are in flight while one is computed
#endif
#ifndef W2_GROUPS
#define W2_GROUPS 1  // 16-row groups per warp
#endif

// v3 build defines (benchmarks/cuda-w2-notes.md "v3"; off: the kernel above, the same SASS), as in w2_gate_up.cu:
//   W2_EARLY 1: route words (num_blocks, block_expert[b], block_pairs[b]) in one round trip, the expert's table words
//     (f4_table, w2_table) in the next, each round closed by one exit / FP4 branch that reads all its words (default:
//     num_blocks -> block_expert -> f4_table -> w2_table, 4 dependent round trips before the first weight load).
//   W2_ROUTE_MAJOR 1: (route block, row tile) from the dispatch index with the route block slowest, so the live
//     route blocks' CUDA blocks are dispatched before the exiting ones (b >= num_blocks) instead of between them.
//   W2_PDL 1: for a launch with programmatic stream serialization (W2DownCuda(pdl=True)): the prologue and the first
//     weight loads (route words, tables, weights: none written by the gate_up stage) run while the preceding kernel
//     may still be running; `griddepcontrol.wait` (all of it complete, its writes visible) comes before the first read
//     of act and before any write of y (an FP4 pair's NaN rows included). Requires W2_EARLY (its FP4 branch). Launched
//     normally, the wait returns at once.
#ifndef W2_EARLY
#define W2_EARLY 0
#endif
#ifndef W2_PDL
#define W2_PDL 0
#endif
#if W2_PDL && !W2_EARLY
#error "W2_PDL needs W2_EARLY (the FP4 branch that waits before writing y)"
#endif
#ifndef W2_ROUTE_MAJOR
#define W2_ROUTE_MAJOR 0
#endif
#include "w2_half_tiles.cuh"  // W2_WPS (32 or 16) and, for 16, the pair tiles

namespace {

constexpr int kAhead = W2_AHEAD;
constexpr int kGroups = W2_GROUPS;
constexpr int kWarps = 4;
constexpr int kRowsPerGroup = 16;
constexpr int kRowsPerBlock = kWarps * kGroups * kRowsPerGroup;

#if W2_PDL
// act is written by the preceding grid while this one may already run: `load_unit` with coherent loads
// (bf16_mma.cuh `load_coherent`), after the griddepcontrol.wait.
__device__ __forceinline__ Unit load_unit_act(const uint16_t* a, int q) {
  const int k = (q >> 5) * kTileK + ((q >> 2) & 7) * 64 + 4 * (q & 3);  // as load_unit
  Unit u;
  u.la = load_coherent(a + k);
  u.lb = load_coherent(a + k + 16);
  u.ha = load_coherent(a + k + 32);
  u.hb = load_coherent(a + k + 48);
  return u;
}
#else
#define load_unit_act load_unit
#endif

#if W2_WPS == 16
// a: bf16 bits [k_real] -> xp [k_len / 2] (k_len: the pair tiles' K), ordered as the lanes read B
// (w2_half_tiles.cuh: `load_unit16`), zero from k_real on.
__device__ void build_pairs(const uint16_t* __restrict__ a, uint32_t* xp, int k_len, int k_real) {
  const int units = k_len / 16;  // unit q = (t * 8 + i) * 4 + c: 8 pairs
#if W2_PDL
  const auto load = [](const uint16_t* p) { return load_coherent(p); };
#else
  const auto load = load_act4;
#endif
  for (int q = threadIdx.x; q < units; q += blockDim.x) store_unit(xp, q, load_unit16(a, q, k_real, load));
}
#else
// a: bf16 bits [K] -> xp [K / 2], ordered as the lanes read B (w2_fragments.cuh: `load_unit`, `store_unit`).
__device__ void build_pairs(const uint16_t* __restrict__ a, uint32_t* xp, int k_len) {
  const int units = k_len / 16;  // unit q = (t * 8 + i) * 4 + c: 8 pairs
  for (int q = threadIdx.x; q < units; q += blockDim.x) store_unit(xp, q, load_unit_act(a, q));
}
#endif

#if W2_WPS == 16
using ScaleVec = uint2;  // one 16-word tile's 8 scale bytes
#else
using ScaleVec = uint4;  // one 32-word tile's 16 scale bytes
#endif
constexpr int kScaleVecBytes = sizeof(ScaleVec);
static_assert(kRowsPerBlock * kScaleVecBytes % 16 == 0, "a block's scales are whole 16-byte vectors");

#if W2_STREAM_STAGE
// Bytes of the activation pairs xp in dynamic shared memory: 2 x K (K = inter, or the pair tiles' K).
__device__ __forceinline__ unsigned long long xp_bytes(int words_per_row, int inter) {
#if W2_WPS == 16
  return 2ull * pair_tiles(words_per_row) * kTileK;
#else
  return 2ull * inter;
#endif
}
#endif

}  // namespace

// One warp's K loop over its row groups (rows `words` / scales `scales`, row g of group 0, read with `ld`), the y rows
// written as each group completes. GlobalLoads: `pairs()` builds the activation pairs after the first loads are issued
// and the block waits; SharedLoads (a staged block): they were built before.
template <class Loads, class Pairs>
__device__ __forceinline__ void down_rows(const uint4* words, const ScaleVec* scales, Loads ld, Pairs pairs,
                                          long long row_vecs, long long scale_vecs, int words_per_row, int tiles,
                                          int c, const uint32_t* xp, float* y_row, int n0, float (&acc)[2][4]) {
  const int steps = kGroups * tiles;  // (group, tile) in order; step s = group s / tiles, tile s % tiles
  // Load cursor: the tile and the row-group offset of the next step to be loaded.
  int load_t = 0;
  long long load_w = 0, load_s = 0;  // row offsets (uint4) of the loaded group's row g: words, scales
  auto load_next = [&]() {
#if W2_WPS == 16
    const Tile r = load_tile16(words + load_w, words + load_w + 8 * row_vecs, scales + load_s,
                               scales + load_s + 8 * scale_vecs, load_t, c, words_per_row / 16, ld);
#else
    const Tile r = load_tile(words + load_w, words + load_w + 8 * row_vecs, scales + load_s,
                             scales + load_s + 8 * scale_vecs, load_t, c, ld);
#endif
    if (++load_t == tiles) {
      load_t = 0;
      load_w += kRowsPerGroup * row_vecs;
      load_s += kRowsPerGroup * scale_vecs;
    }
    return r;
  };

  Tile ring[kAhead + 1];  // step s lives in ring[s % (kAhead + 1)]
#pragma unroll
  for (int j = 0; j < kAhead; ++j) {
    if (j < steps) ring[j] = load_next();
  }
  if constexpr (!Loads::kShared) {
    pairs();
    __syncthreads();
  }
  int t = 0, n = n0;  // compute cursor: tile, row g of the current group
  for (int s0 = 0; s0 < steps; s0 += kAhead + 1) {
#pragma unroll
    for (int j = 0; j <= kAhead; ++j) {
      const int s = s0 + j;
      if (s < steps) {
        if (s + kAhead < steps) ring[(j + kAhead) % (kAhead + 1)] = load_next();
#if W2_WPS == 16
        tile_mma16(ring[j], xp + t * kPairWordsPerTile, c, acc);
#else
        tile_mma(ring[j], xp + t * kPairWordsPerTile, c, acc);
#endif
        if (++t == tiles) {  // the group's rows are complete
          if (c < 2) y_row[n + 8 * c] = acc[0][2 * c] + acc[1][2 * c];
#pragma unroll
          for (int q = 0; q < 4; ++q) acc[0][q] = acc[1][q] = 0.f;
          t = 0;
          n += kRowsPerGroup;
        }
      }
    }
  }
}

// Grid (route block, H / kRowsPerBlock), 128 threads; dynamic shared memory 2 * K bytes (act pairs; K = inter, or
// with W2_WPS 16 the pair tiles' 512 each), then in a W2_STREAM_STAGE build, where the host gave room for it, a
// streamed block's stage (its rows' words, then their scales).
extern "C" __global__ void __launch_bounds__(kWarps * 32, 4) w2_down_mma(
    const uint16_t* __restrict__ act, long long stride_act,                              // act bf16 [P, I]
    const uint8_t* __restrict__ slots, long long slot_bytes, long long words_off,
    long long scales_off, int words_per_row, int blocks_per_row,
    const int* __restrict__ w2_table, const int* __restrict__ f4_table, int table_row,  // [layers * E]
    const int* __restrict__ block_expert, const int* __restrict__ block_pairs,         // route, BT = 1
    const int* __restrict__ num_blocks,
    float* __restrict__ y, long long stride_y, int inter                                // y float32 [P, H]
#if W2_STREAM
    , const long long* __restrict__ stream_at  // [layers * E] arena row - slots (bytes), 0: not in the arena
#endif
    ) {
  extern __shared__ uint4 smem[];
  uint32_t* xp = reinterpret_cast<uint32_t*>(smem);  // [I / 2] activation pairs
  const auto [b, row_tile] = block_tile<W2_ROUTE_MAJOR != 0>();  // w2_fragments.cuh
#if W2_EARLY
  // Round 1: the route words; `|` (not `||`) so that the exit reads all three and none is sunk below it.
#if W2_PAIR_ORDER
  // Pair order: block b is routed pair b, block_expert the router's topk ids [P], num_blocks the table's expert count
  // (an id outside it is no block; block_pairs unread).
  const int experts = *num_blocks, expert = block_expert[b], pair = b;
  if ((expert < 0) | (expert >= experts)) return;
#else
  const int route_blocks = *num_blocks, expert = block_expert[b], pair = block_pairs[b];
  if ((b >= route_blocks) | (expert < 0) | (pair < 0)) return;
#endif
  // Round 2: both table words, read by one branch (a W2 route block's expert has a W2 slot: w2_slot < 0 with
  // f4_slot < 0 does not occur; it would exit without writing).
  const int f4_slot = f4_table[table_row + expert], w2_slot = w2_table[table_row + expert];
  const bool fp4 = f4_slot >= 0;
#else
  if (b >= *num_blocks) return;
  const int expert = block_expert[b];
  const int pair = block_pairs[b];
#endif
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int n0 = row_tile * kRowsPerBlock + (threadIdx.x >> 5) * (kGroups * kRowsPerGroup) + g;  // group 0, row g
  float* y_row = y + pair * stride_y;
#if W2_EARLY
  const long long row_vecs = words_per_row / 4, scale_vecs = blocks_per_row / kScaleVecBytes;
  // The lane's rows in slot 0 while the table words are in flight (the empty asm keeps nvcc from sinking them below
  // the branch; no instruction), so that the slot's offset is added once after they arrive.
  const uint8_t* lo_at = slots + (words_off + 16 * (n0 * row_vecs));
  const uint8_t* sl_at = slots + (scales_off + kScaleVecBytes * (n0 * scale_vecs));
  asm volatile("" ::"l"(lo_at), "l"(sl_at));
#if W2_STREAM
  // Streamed pair (W2_STREAM, as in w2_gate_up.cu): no W2 slot, the expert's row read in the pinned arena.
  const long long streamed = w2_slot >= 0 ? 0 : stream_at[table_row + expert];
  if (fp4 | ((w2_slot < 0) & (streamed == 0))) {
#else
  if (fp4 | (w2_slot < 0)) {
#endif
#if W2_PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");  // y rows are written only once the preceding grid is done
#endif
    if (fp4 && c < 2) {  // FP4 pair: not computed on this path, marked
#pragma unroll
      for (int r = 0; r < kGroups; ++r) y_row[n0 + r * kRowsPerGroup + 8 * c] = __int_as_float(0x7fc00000);
    }
    return;
  }
#if W2_STREAM
  const long long slot_at = w2_slot >= 0 ? static_cast<long long>(w2_slot) * slot_bytes : streamed;
#if W2_STREAM_STAGE
  // the block's rows, then their scales: [64 * groups][row_vecs] uint4, then [64 * groups][scale_vecs] ScaleVec
  const long long stage_words = kRowsPerBlock * row_vecs;
  const long long stage_scales = kRowsPerBlock * scale_vecs * kScaleVecBytes / 16;
  const bool staged = (w2_slot < 0) & (dynamic_shared_bytes() >= xp_bytes(words_per_row, inter) +
                                                                      16ull * (stage_words + stage_scales));
#else
  constexpr bool staged = false;
#endif
#if W2_STREAM_PREFETCH
  if ((w2_slot < 0) & !staged) {  // the block's rows and their scales, asked into L2 before the first tile load
    const long long first = static_cast<long long>(row_tile) * kRowsPerBlock;
    prefetch_region_l2(slots + slot_at + words_off + 16 * (first * row_vecs), 16 * kRowsPerBlock * row_vecs);
    prefetch_region_l2(slots + slot_at + scales_off + kScaleVecBytes * (first * scale_vecs),
                       kScaleVecBytes * kRowsPerBlock * scale_vecs);
  }
#endif
#else
  const long long slot_at = static_cast<long long>(w2_slot) * slot_bytes;
#endif
  const uint4* lo = reinterpret_cast<const uint4*>(lo_at + slot_at);
  const ScaleVec* sl = reinterpret_cast<const ScaleVec*>(sl_at + slot_at);
#else
  if (f4_table[table_row + expert] >= 0) {  // FP4 pair: not computed on this path, marked
    if (c < 2) {
#pragma unroll
      for (int r = 0; r < kGroups; ++r) y_row[n0 + r * kRowsPerGroup + 8 * c] = __int_as_float(0x7fc00000);
    }
    return;
  }

  const uint8_t* base = slots + static_cast<long long>(w2_table[table_row + expert]) * slot_bytes;
  const long long row_vecs = words_per_row / 4, scale_vecs = blocks_per_row / kScaleVecBytes;
  const uint4* lo = reinterpret_cast<const uint4*>(base + words_off) + n0 * row_vecs;
  const ScaleVec* sl = reinterpret_cast<const ScaleVec*>(base + scales_off) + n0 * scale_vecs;
#endif
#if W2_WPS == 16
  const int tiles = pair_tiles(words_per_row);
#else
  const int tiles = words_per_row / kWps;
#endif

  float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  // Build the activation pairs (after the preceding gate_up, whose output act is) and wait for the block.
  auto pairs = [&]() {
#if W2_PDL
    asm volatile("griddepcontrol.wait;" ::: "memory");  // act is the preceding gate_up's output
#endif
#if W2_WPS == 16
    build_pairs(act + pair * stride_act, xp, tiles * kTileK, inter);
#else
    build_pairs(act + pair * stride_act, xp, inter);
#endif
  };
#if W2_STREAM_STAGE
  if (staged) {  // a streamed block: its rows into shared memory in contiguous runs, the K loop from there
    uint4* stage = smem + xp_bytes(words_per_row, inter) / 16;  // after xp
    const long long first = static_cast<long long>(row_tile) * kRowsPerBlock;
    const uint8_t* row = slots + slot_at;
    stage_region(stage, row + words_off + 16 * (first * row_vecs), stage_words);
    stage_region(stage + stage_words, row + scales_off + kScaleVecBytes * (first * scale_vecs), stage_scales);
    commit_copies();
    pairs();
    wait_copies<0>();
    __syncthreads();
    const long long local = n0 - first;  // the lane's row g of group 0 in the block
    down_rows(stage + local * row_vecs, reinterpret_cast<const ScaleVec*>(stage + stage_words) + local * scale_vecs,
              SharedLoads{}, pairs, row_vecs, scale_vecs, words_per_row, tiles, c, xp, y_row, n0, acc);
    return;
  }
#endif
  down_rows(lo, sl, GlobalLoads{}, pairs, row_vecs, scale_vecs, words_per_row, tiles, c, xp, y_row, n0, acc);
}
