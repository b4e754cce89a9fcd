// FP4 gate_up and down stages for decode (one routed pair per block row, the Triton path's BT = 1), on tensor
// cores: the FP4 counterparts of w2_gate_up.cu and w2_down.cu.
//
//   fp4_gate_up_mma:  act[pair, n] = SwiGLU(W13_e[n] . x[token], W13_e[n + I] . x[token])   (bf16, K = H)
//   fp4_down_mma:     y[pair, n] = W2_e[n] . act[pair]                                        (float32, K = I)
//
// Inputs are the Triton stages': the FP4 pool's slot bytes (kernels/layout.py) and table, the BT = 1 route
// output (block b -> expert, pair), x [T, H] bf16 / act [P, I] bf16. Each kernel computes the pairs whose
// expert is FP4-resident (FP4 table >= 0) and leaves every other pair's row untouched, so that with the W2
// kernels (which skip FP4 pairs) every resident pair is computed once (kernels/cuda/tier_moe.py). K must be a
// multiple of 256 (whole 32-word tiles: each nibble slot one scale block), except the down's when built with
// FP4_WPS 16: any K the layout packs in 16-word tiles (fp4_half_tiles.cuh; the gate_up is the same in both builds).
//
// Decode, tile loads, a K tile's mmas and the activation pairs: fp4_fragments.cuh. gate_up: one warp owns 8
// output rows, mma rows 0..7 their gate rows and 8..15 their up rows; down: one warp owns 16 output rows. fp32
// accumulation in the tensor core, two accumulators alternating, the 2^2 decode bias removed by one exact
// multiply by 0.25 per row. No atomics, fixed order: repeated launches give identical bytes; FP4_AHEAD changes
// when loads are issued, not the arithmetic.

#include <cstdint>
#include <cuda_bf16.h>

#include "fp4_fragments.cuh"

#ifndef FP4_AHEAD
#define FP4_AHEAD 2  // K tiles whose loads are in flight while one is computed (1, 2, 3: no spills)
#endif
// FP4_PAIR_ORDER 1: block b is routed pair b, its expert read from the router's topk ids (`block_expert`; `num_blocks`
// the tables' expert count) instead of the route output, as W2_PAIR_ORDER does for the W2 kernels. 0: route order.
#ifndef FP4_PAIR_ORDER
#define FP4_PAIR_ORDER 0
#endif
#include "fp4_half_tiles.cuh"  // FP4_WPS (32 or 16) and, for 16, the down's pair tiles

namespace {

constexpr int kAhead = FP4_AHEAD;
constexpr int kWarps = 4;
constexpr int kGateRowsPerBlock = kWarps * 8;   // 32
constexpr int kDownRowsPerBlock = kWarps * 16;  // 64

// Both kernels' prologue: the block's FP4 slot and pair, or false (the block exits) past the route or when its
// expert is not FP4-resident (the W2 kernel's pair).
__device__ __forceinline__ bool route(const int* __restrict__ num_blocks, const int* __restrict__ f4_table, int table_row,
                                      const int* __restrict__ block_expert, const int* __restrict__ block_pairs,
                                      int& slot, int& pair) {
  const int b = blockIdx.x;
#if FP4_PAIR_ORDER
  const int experts = *num_blocks, expert = block_expert[b];
  if ((expert < 0) | (expert >= experts)) return false;
  slot = f4_table[table_row + expert];
  pair = b;
  return slot >= 0;
#else
  if (b >= *num_blocks) return false;
  slot = f4_table[table_row + block_expert[b]];
  if (slot < 0) return false;
  pair = block_pairs[b];
  return true;
#endif
}

// The warp's sums over all K tiles of its rows: the first loads, the block's activation pairs of row a [k_len]
// into xp, a barrier, the K loop (acc: the two alternating accumulators).
__device__ __forceinline__ void row_sums(const Rows& r, const uint16_t* __restrict__ a, uint32_t* xp, int k_len,
                                         int words_per_row, int c, float (&acc)[2][4]) {
  const int tiles = words_per_row / kF4Wps;
  F4Tile ring[kAhead + 1];
  first_loads<kAhead>(r, ring, tiles, c);
  f4_build_pairs(a, xp, k_len);
  __syncthreads();
  k_loop<kAhead, kF4TilePairs>(r, ring, xp, tiles, c, c, acc);
}

#if FP4_WPS == 16
// row_sums over pair tiles: the activation pairs of row a [k_real] staged for the pair tiles' K, zero past k_real.
__device__ __forceinline__ void row_sums(const F4PairRows& r, const uint16_t* __restrict__ a, uint32_t* xp, int k_real,
                                         int c, float (&acc)[2][4]) {
  const int tiles = pair_tiles(r);
  F4PairTile ring[kAhead + 1];
  first_loads<kAhead>(r, ring, tiles, c);
  f4_build_pairs16(a, xp, tiles * kF4TileK, k_real);
  __syncthreads();
  k_loop<kAhead, kF4TilePairs>(r, ring, xp, tiles, c, c, acc);
}
#endif

}  // namespace

// Grid (route block, I / 32), 128 threads; dynamic shared memory 2 * hidden bytes (x pairs).
extern "C" __global__ void __launch_bounds__(kWarps * 32, 4) fp4_gate_up_mma(
    const uint16_t* __restrict__ x, long long stride_x,              // activations bf16 [T, H]
    const uint8_t* __restrict__ slots, long long slot_bytes,         // FP4 pool uint8 [S, slot_bytes]
    long long words_off, long long scales_off, int words_per_row, int blocks_per_row,
    const int* __restrict__ f4_table, int table_row,                                   // [layers * E]
    const int* __restrict__ block_expert, const int* __restrict__ block_pairs,         // route, BT = 1
    const int* __restrict__ num_blocks, int top_k,
    __nv_bfloat16* __restrict__ act, long long stride_act, int inter, int hidden,       // act bf16 [P, I]
    float limit, int has_limit) {
  extern __shared__ uint4 smem[];
  uint32_t* xp = reinterpret_cast<uint32_t*>(smem);  // [H / 2] activation pairs
  int slot, pair;
  if (!route(num_blocks, f4_table, table_row, block_expert, block_pairs, slot, pair)) return;
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int n = blockIdx.y * kGateRowsPerBlock + (threadIdx.x >> 5) * 8 + g;  // output row

  const uint8_t* base = slots + static_cast<long long>(slot) * slot_bytes;
  const Rows r = rows_at(base, words_off, scales_off, words_per_row, blocks_per_row, n, inter);  // gate and up row n
  float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  row_sums(r, x + (pair / top_k) * stride_x, xp, hidden, words_per_row, c, acc);
  if (c == 0) {
    float gate_v = (acc[0][0] + acc[1][0]) * 0.25f, up_v = (acc[0][2] + acc[1][2]) * 0.25f;
    if (has_limit) {
      gate_v = fminf(gate_v, limit);
      up_v = fminf(fmaxf(up_v, -limit), limit);
    }
    act[pair * stride_act + n] = __float2bfloat16_rn(gate_v / (1.0f + __expf(-gate_v)) * up_v);
  }
}

// Grid (route block, H / 64), 128 threads; dynamic shared memory 2 * K bytes (act pairs; K = inter, or with FP4_WPS
// 16 the pair tiles' 256 each).
extern "C" __global__ void __launch_bounds__(kWarps * 32, 4) fp4_down_mma(
    const uint16_t* __restrict__ act, long long stride_act,                              // act bf16 [P, I]
    const uint8_t* __restrict__ slots, long long slot_bytes, long long words_off,
    long long scales_off, int words_per_row, int blocks_per_row,
    const int* __restrict__ f4_table, int table_row,                                   // [layers * E]
    const int* __restrict__ block_expert, const int* __restrict__ block_pairs,         // route, BT = 1
    const int* __restrict__ num_blocks,
    float* __restrict__ y, long long stride_y, int inter) {                             // y float32 [P, H]
  extern __shared__ uint4 smem[];
  uint32_t* xp = reinterpret_cast<uint32_t*>(smem);  // [I / 2] activation pairs
  int slot, pair;
  if (!route(num_blocks, f4_table, table_row, block_expert, block_pairs, slot, pair)) return;
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int n = blockIdx.y * kDownRowsPerBlock + (threadIdx.x >> 5) * 16 + g;  // rows n and n + 8

  const uint8_t* base = slots + static_cast<long long>(slot) * slot_bytes;
#if FP4_WPS == 16
  const F4PairRows r = pair_rows_at(base, words_off, scales_off, words_per_row, blocks_per_row, n);
  float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  row_sums(r, act + pair * stride_act, xp, inter, c, acc);
#else
  const Rows r = rows_at(base, words_off, scales_off, words_per_row, blocks_per_row, n, 8);
  float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  row_sums(r, act + pair * stride_act, xp, inter, words_per_row, c, acc);
#endif
  if (c < 2) {  // lane (g, 0): row n from d0; lane (g, 1): row n + 8 from d2 (all D columns are equal)
    y[pair * stride_y + n + 8 * c] = (c ? acc[0][2] + acc[1][2] : acc[0][0] + acc[1][0]) * 0.25f;
  }
}
