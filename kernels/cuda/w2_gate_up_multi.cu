// W2 gate_up stage, multi-token: one CUDA block = one route block's 64 output rows (block_tokens = 16, 32 or 64 pairs
// of one expert), its pairs in column groups of 8 (w2_multi.cuh), so the expert's bytes are loaded and decoded once
// per row tile for up to 8 pairs.
//
//   act[pair, n] = SwiGLU(gate, up),  gate = W13_e[n] . x[token],  up = W13_e[n + I] . x[token]
//
// Same inputs as w2_gate_up.cu plus block_fill and block_tokens; the same loads, decode and tile_mma
// (w2_fragments.cuh), with B column g = the activation pairs of the group's pair g instead of one pair replicated:
// lane (g, c) finds gate in d0 / d1 and up in d2 / d3 of columns 2c / 2c + 1 and stores both of its pairs' act for
// row n. Each column's arithmetic is the single-token kernel's (same A, same K order, same accumulators), so a
// pair's bytes should not depend on which kernel ran it or on the other pairs of its group.
//
// 8 warps x 8 rows = 64 rows per block; shared memory 8 columns x (H / 2 + 4) words (114.8 KB at H = 7168), so 2
// blocks (16 warps) per SM, the single-token kernel's 4 x 4 warps. FP4-resident experts' pairs: skipped. No
// atomics, fixed order: repeats are byte-identical.
//
// v2 build defines (defaults: the kernel above, unchanged):
//   W2_STAGE_COLS S (1..8): shared memory holds S columns and the block runs its pairs in passes of S
//     (pairs z0 .. z0 + S - 1, z0 = 0, S, 2S, ..) instead of 8: S x (H / 2 + 4) words, 57.4 KB at S = 4, so the
//     SM keeps more of its unified L1 / shared memory as L1 (w2_multi.py sets the carveout to fit). Per pair the
//     arithmetic is unchanged (same A, same K order, same accumulators; an mma's D column depends only on its
//     own B column), so the bytes equal the default's; a block with fill > S re-reads its expert's bytes.
//   W2_WARPS 4 or 8: warps per block (rows per block 8 x W2_WARPS), 16 / W2_WARPS blocks per SM at 128
//     registers: 4 is the single-token kernel's block shape.
//   W2_EARLY 1: the prologue's route and table loads in two dependent round trips instead of five (num_blocks ->
//     block_expert -> f4_table -> block_fill -> w2_table -> the first weight loads; nvcc keeps them behind the
//     early exits), so a new block's first weight loads issue ~3 L2 latencies sooner. No arithmetic change.

#include <cstdint>
#include <cuda_bf16.h>

#include "w2_multi.cuh"

#ifndef W2_AHEAD
#define W2_AHEAD 2  // K tiles whose loads are in flight while one is computed
#endif

#ifndef W2_WARPS
#define W2_WARPS 8  // warps per block
#endif

#ifndef W2_EARLY
#define W2_EARLY 0  // 1: the block's route and table words loaded in two round trips (see the prologue)
#endif

#ifndef W2_STAGE_COLS
#define W2_STAGE_COLS 8  // columns staged in shared memory per pass (kCols: a whole column group)
#endif

namespace {

constexpr int kAhead = W2_AHEAD;
constexpr int kWarps = W2_WARPS;
constexpr int kStage = W2_STAGE_COLS;
constexpr int kRowsPerWarp = 8;                       // the gate half of one m16 tile
constexpr int kRowsPerBlock = kWarps * kRowsPerWarp;  // 64 (default), 32 at 4 warps
static_assert(kWarps == 4 || kWarps == 8, "W2_WARPS must be 4 or 8");
static_assert(kStage >= 1 && kStage <= kCols, "W2_STAGE_COLS must be 1..8");

}  // namespace

// Grid (route blocks, I / kRowsPerBlock), kWarps * 32 threads; dynamic shared memory kStage * (2 * H + 16) bytes
// (default: 256 threads, I / 64 row tiles, 8 * (2 * H + 16) bytes).
extern "C" __global__ void __launch_bounds__(kWarps * 32, 16 / kWarps) w2_gate_up_multi(
    const uint16_t* __restrict__ x, long long stride_x,              // activations bf16 [T, H]
    const uint8_t* __restrict__ slots, long long slot_bytes,         // W2 pool uint8 [S, slot_bytes]
    long long words_off, long long scales_off, int words_per_row, int blocks_per_row,
    const int* __restrict__ w2_table, const int* __restrict__ f4_table, int table_row,  // [layers * E]
    const int* __restrict__ block_expert, const int* __restrict__ block_fill,           // route, BT = block_tokens
    const int* __restrict__ block_pairs, const int* __restrict__ num_blocks, int block_tokens, int top_k,
    __nv_bfloat16* __restrict__ act, long long stride_act, int inter, int hidden,       // act bf16 [P, I]
    float limit, int has_limit) {
  extern __shared__ uint4 smem[];
  uint32_t* xp = reinterpret_cast<uint32_t*>(smem);  // [kStage][H / 2 + kPadWords] activation pairs
  const int b = blockIdx.x;
#if W2_EARLY
  // The block's route words in one round trip (block_expert / block_fill have gridDim.x entries), then the
  // expert's two table entries in one more: 2 dependent L2 latencies before the first weight load instead of 5.
  // One exit after both rounds, on every loaded word: nvcc sinks a load below any exit that does not need it
  // (the default's chain). fill < 1 and w2_slot < 0 (a route block of a W2 expert has a slot) exit with no work.
  const int route_blocks = *num_blocks, routed = block_expert[b], fill = block_fill[b];
  const int expert = b < route_blocks ? routed : 0;  // past the route: any valid table index (not used)
  const int f4_slot = f4_table[table_row + expert], w2_slot = w2_table[table_row + expert];
  if (b >= route_blocks || f4_slot >= 0 || fill < 1 || w2_slot < 0) return;
#else
  if (b >= *num_blocks) return;
  const int expert = block_expert[b];
  if (f4_table[table_row + expert] >= 0) return;
  const int fill = block_fill[b];
#endif
  const int* pairs = block_pairs + b * block_tokens;
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int n = blockIdx.y * kRowsPerBlock + (threadIdx.x >> 5) * kRowsPerWarp + g;  // output row
  const int stride = hidden / 2 + kPadWords;

#if W2_EARLY
  const uint8_t* base = slots + static_cast<long long>(w2_slot) * slot_bytes;
#else
  const uint8_t* base = slots + static_cast<long long>(w2_table[table_row + expert]) * slot_bytes;
#endif
  const long long row_vecs = words_per_row / 4, scale_vecs = blocks_per_row / 16;
  const uint4* gate = reinterpret_cast<const uint4*>(base + words_off) + n * row_vecs;
  const uint4* up = gate + inter * row_vecs;
  const uint4* gs = reinterpret_cast<const uint4*>(base + scales_off) + n * scale_vecs;
  const uint4* us = gs + inter * scale_vecs;
  const Rows rows{gate, up, gs, us};
  const int tiles = words_per_row / kWps;

  for (int z0 = 0; z0 < fill; z0 += kStage) {  // column groups (passes): pairs z0 .. z0 + count - 1
    const int count = min(fill - z0, kStage);
    const uint32_t* xp_lane = xp + min(g, count - 1) * stride;  // B column g
    Tile ring[kAhead + 1];  // bf16_mma.cuh `k_loop`
    first_loads<kAhead>(rows, ring, tiles, c);
    if (z0 > 0) __syncthreads();  // every warp is done reading the previous group's columns
    build_pairs_multi(x, stride_x, pairs + z0, top_k, count, xp, stride, hidden);
    __syncthreads();

    float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    k_loop<kAhead, kPairWordsPerTile>(rows, ring, xp_lane, tiles, c, c, acc);
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // columns 2c (d0 gate, d2 up) and 2c + 1 (d1, d3)
      if (2 * c + h < count) {
        float gate_v = acc[0][h] + acc[1][h], up_v = acc[0][2 + h] + acc[1][2 + h];
        if (has_limit) {
          gate_v = fminf(gate_v, limit);
          up_v = fminf(fmaxf(up_v, -limit), limit);
        }
        act[pairs[z0 + 2 * c + h] * stride_act + n] = __float2bfloat16_rn(gate_v / (1.0f + __expf(-gate_v)) * up_v);
      }
    }
  }
}
