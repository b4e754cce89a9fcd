// FP4 gate_up and down stages, multi-token: one CUDA block decodes one FP4 expert's weight tile once for up to
// kCols routed pairs of that expert, one pair per mma column (the FP4 counterparts of w2_gate_up_multi.cu and
// w2_down_multi.cu; single-token kernels: fp4_moe.cu).
//
//   fp4_gate_up_multi:  act[pair, n] = SwiGLU(W13_e[n] . x[token], W13_e[n + I] . x[token])   (bf16, K = H)
//   fp4_down_multi:     y[pair, n] = W2_e[n] . act[pair]                                        (float32, K = I)
//
// Route: block_tokens BT (a multiple of 8) gives block b -> expert, its pairs block_pairs[b * BT ..] and their count
// block_fill[b]. A block whose expert is not FP4-resident exits (the W2 kernels compute those pairs; the W2 down
// marks FP4 pairs' y rows NaN and this down overwrites them: kernels/cuda/tier_moe.py). A block runs its pairs in
// passes of kCols columns; a second pass re-reads the expert's bytes the block has just read (L2).
//
// Same decode, tile loads and tile mmas as fp4_moe.cu (fp4_fragments.cuh); B column g = the activation pairs of the
// pass's pair g (columns past the pass's count read the last pair's; their D columns are never stored). Lane (g, c)
// holds D columns 2c (d0 row g, d2 row g + 8) and 2c + 1 (d1, d3). Each column's arithmetic is the single-token
// kernel's (same A, same K order, same accumulators, the same 0.25), so a pair's bytes should not depend on which
// kernel ran it. No atomics, fixed order: repeated launches give identical bytes.
//
// Shared memory: column j's K / 2 pairs at xp + j * stride, stride = K / 2 + kPadWords, kPadWords = 2: K / 2 is a
// multiple of 128, so stride = 2 (mod 32) words and the 16 lanes of a half warp's LDS.64 (g = 0..3, c = 0..3, words
// 2g + 8c + const) cover the 32 banks once: no bank conflict. Columns are then 8-byte aligned only, so the units
// are stored as 8-byte words (`store_unit_8`).
//
// gate_up: FP4_WARPS warps of 8 rows (mma rows 0..7 the gate rows, 8..15 the up rows), FP4_STAGE_COLS columns per
// pass (4: 57.4 KB at H = 7168, two blocks of 8 warps per SM, as the W2 kernel's adopted s4e). down: 4 warps of 16
// rows, 8 columns per pass (32.8 KB at I = 2048), at least 3 blocks per SM (4 with FP4_AHEAD 1): at 4 (128
// registers) ptxas spilled 128 bytes with FP4_AHEAD 2, at 3 it uses 164 registers and spills none; FP4_AHEAD 1
// needs 124 (nvcc 13.0, sm_90a).

#include <cstdint>
#include <cuda_bf16.h>

#include "fp4_fragments.cuh"

#ifndef FP4_AHEAD
#define FP4_AHEAD 2  // K tiles whose loads are in flight while one is computed
#endif

#ifndef FP4_WARPS
#define FP4_WARPS 8  // gate_up warps per block
#endif

#ifndef FP4_STAGE_COLS
#define FP4_STAGE_COLS 4  // gate_up columns staged in shared memory per pass
#endif

#ifndef FP4_EARLY
#define FP4_EARLY 0  // 1: both kernels load the block's route and table words in two round trips (see `route`)
#endif

// FP4_PDL 1: programmatic dependent launch between the two stages (as w2_gate_up.cu / w2_down.cu's W2_PDL). The
// gate_up issues `griddepcontrol.launch_dependents` first thing in every block, so the down, launched as its
// programmatic dependent (Fp4DownMultiCuda(pdl=True)), may start its prologue and first weight loads (route words,
// tables, weights: none written by the gate_up) while the gate_up still runs; the down's `griddepcontrol.wait` (the
// gate_up complete, its writes visible) comes before its first read of act and so before any write of y, and act is
// then read with coherent loads (ld.global, not the non-coherent path const __restrict__ may give). Launched
// normally, the wait returns at once. The down also runs after the W2 down of `TierMoeCuda` (whose NaN rows it
// overwrites): the gate_up it depends on starts only after that one completed.
#ifndef FP4_PDL
#define FP4_PDL 0
#endif
#include "fp4_half_tiles.cuh"  // FP4_WPS (32 or 16) and, for 16, the down's pair tiles (the gate_up is the same in both)

namespace {

constexpr int kAhead = FP4_AHEAD;
constexpr int kGateWarps = FP4_WARPS;
constexpr int kGateCols = FP4_STAGE_COLS;
constexpr int kGateRowsPerBlock = kGateWarps * 8;
constexpr int kDownWarps = 4;
constexpr int kDownCols = 8;
constexpr int kDownRowsPerBlock = kDownWarps * 16;
constexpr int kDownBlocks = kAhead >= 2 ? 3 : 4;  // blocks per SM the down's registers allow without spills
constexpr int kPadWords = 2;
static_assert(kGateWarps == 4 || kGateWarps == 8, "FP4_WARPS must be 4 or 8");
static_assert(kGateCols >= 1 && kGateCols <= 8, "FP4_STAGE_COLS must be 1..8");

// The block's FP4 slot, fill and pairs, or false (the block exits) past the route or when its expert is not
// FP4-resident. FP4_EARLY 1: num_blocks, block_expert[b] and block_fill[b] (both have gridDim.x entries) in one
// round trip, the table entry in a second, one exit after both (nvcc sinks a load below any exit that does not
// need it): 2 dependent L2 latencies before the first weight load instead of 3 (w2_gate_up_multi.cu's W2_EARLY).
__device__ __forceinline__ bool route(const int* __restrict__ num_blocks, const int* __restrict__ f4_table,
                                      int table_row, const int* __restrict__ block_expert,
                                      const int* __restrict__ block_fill, const int* __restrict__ block_pairs,
                                      int block_tokens, int& slot, int& fill, const int*& pairs) {
  const int b = blockIdx.x;
#if FP4_EARLY
  const int route_blocks = *num_blocks, routed = block_expert[b];
  fill = block_fill[b];
  slot = f4_table[table_row + (b < route_blocks ? routed : 0)];  // past the route: any valid entry (not used)
  if (b >= route_blocks || slot < 0 || fill < 1) return false;
#else
  if (b >= *num_blocks) return false;
  slot = f4_table[table_row + block_expert[b]];
  if (slot < 0) return false;
  fill = block_fill[b];
#endif
  pairs = block_pairs + b * block_tokens;
  return true;
}

#if FP4_PDL
// f4_load_unit's unit q of row a, with coherent loads (bf16_mma.cuh; act written by the preceding grid).
__device__ __forceinline__ Unit f4_load_unit_coherent(const uint16_t* a, int q) {
  const int k0 = 64 * (q >> 2) + 4 * (q & 3);
  return {load_coherent(a + k0), load_coherent(a + k0 + 16), load_coherent(a + k0 + 32), load_coherent(a + k0 + 48)};
}
#endif

// One pass: the first loads, the pass's `count` columns of activation rows a into xp (after the previous pass's
// reads), a barrier, the K loop over column min(g, count - 1). kAfterGrid (the down with FP4_PDL): the first pass
// waits for the preceding grid before reading a, and reads it coherently.
template <bool kAfterGrid>
__device__ __forceinline__ void pass_sums(const Rows& r, const uint16_t* __restrict__ a, long long stride_a,
                                          const int* pairs, int divisor, int count, bool after_pass, uint32_t* xp,
                                          int k_len, int words_per_row, int g, int c, float (&acc)[2][4]) {
  const int tiles = words_per_row / kF4Wps, stride = k_len / 2 + kPadWords;
  F4Tile ring[kAhead + 1];
  first_loads<kAhead>(r, ring, tiles, c);
  if (after_pass) __syncthreads();  // every warp is done reading the previous pass's columns
  auto store = [](uint32_t* column, int q, const Unit& u) { store_unit_8(column, q, u); };
#if FP4_PDL
  if (kAfterGrid) {
    if (!after_pass) asm volatile("griddepcontrol.wait;" ::: "memory");  // act is the preceding gate_up's output
    build_columns(a, stride_a, pairs, divisor, count, xp, stride, k_len,
                  [](const uint16_t* row, int q) { return f4_load_unit_coherent(row, q); }, store);
  } else
#endif
  build_columns(a, stride_a, pairs, divisor, count, xp, stride, k_len,
                [](const uint16_t* row, int q) { return f4_load_unit(row, q); }, store);
  __syncthreads();
  k_loop<kAhead, kF4TilePairs>(r, ring, xp + min(g, count - 1) * stride, tiles, c, c, acc);
}

#if FP4_WPS == 16
// The down's pass_sums over pair tiles: columns staged for the pair tiles' K (k_len), zero past k_real.
__device__ __forceinline__ void pass_sums(const F4PairRows& r, const uint16_t* __restrict__ a, long long stride_a,
                                          const int* pairs, int count, bool after_pass, uint32_t* xp, int k_len,
                                          int k_real, int g, int c, float (&acc)[2][4]) {
  const int tiles = pair_tiles(r), stride = k_len / 2 + kPadWords;
  F4PairTile ring[kAhead + 1];
  first_loads<kAhead>(r, ring, tiles, c);
  if (after_pass) __syncthreads();  // every warp is done reading the previous pass's columns
  auto store = [](uint32_t* column, int q, const Unit& u) { store_unit_8(column, q, u); };
#if FP4_PDL
  if (!after_pass) asm volatile("griddepcontrol.wait;" ::: "memory");  // act is the preceding gate_up's output
  const auto load = [](const uint16_t* p) { return load_coherent(p); };
#else
  const auto load = f4_load_act4;
#endif
  build_columns(a, stride_a, pairs, 1, count, xp, stride, k_len,
                [k_real, load](const uint16_t* row, int q) { return f4_load_unit16(row, q, k_real, load); }, store);
  __syncthreads();
  k_loop<kAhead, kF4TilePairs>(r, ring, xp + min(g, count - 1) * stride, tiles, c, c, acc);
}
#endif

}  // namespace

// Grid (route blocks, I / kGateRowsPerBlock), kGateWarps * 32 threads; dynamic shared memory
// kGateCols * (2 * H + 8) bytes.
extern "C" __global__ void __launch_bounds__(kGateWarps * 32, 16 / kGateWarps) fp4_gate_up_multi(
    const uint16_t* __restrict__ x, long long stride_x,              // activations bf16 [T, H]
    const uint8_t* __restrict__ slots, long long slot_bytes,         // FP4 pool uint8 [S, slot_bytes]
    long long words_off, long long scales_off, int words_per_row, int blocks_per_row,
    const int* __restrict__ f4_table, int table_row,                                   // [layers * E]
    const int* __restrict__ block_expert, const int* __restrict__ block_fill,           // route, BT = block_tokens
    const int* __restrict__ block_pairs, const int* __restrict__ num_blocks, int block_tokens, int top_k,
    __nv_bfloat16* __restrict__ act, long long stride_act, int inter, int hidden,       // act bf16 [P, I]
    float limit, int has_limit) {
  extern __shared__ uint4 smem[];
  uint32_t* xp = reinterpret_cast<uint32_t*>(smem);  // [kGateCols][H / 2 + kPadWords] activation pairs
#if FP4_PDL
  asm volatile("griddepcontrol.launch_dependents;");  // the down may be scheduled now (it waits for this grid)
#endif
  int slot, fill;
  const int* pairs;
  if (!route(num_blocks, f4_table, table_row, block_expert, block_fill, block_pairs, block_tokens, slot, fill, pairs)) {
    return;
  }
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int n = blockIdx.y * kGateRowsPerBlock + (threadIdx.x >> 5) * 8 + g;  // gate row n, up row n + I
  const Rows r = rows_at(slots + static_cast<long long>(slot) * slot_bytes, words_off, scales_off, words_per_row,
                         blocks_per_row, n, inter);
  for (int z0 = 0; z0 < fill; z0 += kGateCols) {  // passes: pairs z0 .. z0 + count - 1
    const int count = min(fill - z0, kGateCols);
    float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    pass_sums<false>(r, x, stride_x, pairs + z0, top_k, count, z0 > 0, xp, hidden, words_per_row, g, c, acc);
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // columns 2c (d0 gate, d2 up) and 2c + 1 (d1, d3)
      if (2 * c + h < count) {
        float gate_v = (acc[0][h] + acc[1][h]) * 0.25f, up_v = (acc[0][2 + h] + acc[1][2 + h]) * 0.25f;
        if (has_limit) {
          gate_v = fminf(gate_v, limit);
          up_v = fminf(fmaxf(up_v, -limit), limit);
        }
        act[pairs[z0 + 2 * c + h] * stride_act + n] = __float2bfloat16_rn(gate_v / (1.0f + __expf(-gate_v)) * up_v);
      }
    }
  }
}

// Grid (route blocks, H / kDownRowsPerBlock), 128 threads; dynamic shared memory kDownCols * (2 * K + 8) bytes (K = I,
// or with FP4_WPS 16 the pair tiles' 256 each).
extern "C" __global__ void __launch_bounds__(kDownWarps * 32, kDownBlocks) fp4_down_multi(
    const uint16_t* __restrict__ act, long long stride_act,                              // act bf16 [P, I]
    const uint8_t* __restrict__ slots, long long slot_bytes, long long words_off,
    long long scales_off, int words_per_row, int blocks_per_row,
    const int* __restrict__ f4_table, int table_row,                                   // [layers * E]
    const int* __restrict__ block_expert, const int* __restrict__ block_fill,           // route, BT = block_tokens
    const int* __restrict__ block_pairs, const int* __restrict__ num_blocks, int block_tokens,
    float* __restrict__ y, long long stride_y, int inter) {                             // y float32 [P, H]
  extern __shared__ uint4 smem[];
  uint32_t* xp = reinterpret_cast<uint32_t*>(smem);  // [kDownCols][I / 2 + kPadWords] activation pairs
  int slot, fill;
  const int* pairs;
  if (!route(num_blocks, f4_table, table_row, block_expert, block_fill, block_pairs, block_tokens, slot, fill, pairs)) {
    return;
  }
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int n = blockIdx.y * kDownRowsPerBlock + (threadIdx.x >> 5) * 16 + g;  // rows n and n + 8
#if FP4_WPS == 16
  const F4PairRows r = pair_rows_at(slots + static_cast<long long>(slot) * slot_bytes, words_off, scales_off,
                                    words_per_row, blocks_per_row, n);
  const int k_len = pair_tiles(r) * kF4TileK;
#else
  const Rows r = rows_at(slots + static_cast<long long>(slot) * slot_bytes, words_off, scales_off, words_per_row,
                         blocks_per_row, n, 8);
#endif
  for (int z0 = 0; z0 < fill; z0 += kDownCols) {
    const int count = min(fill - z0, kDownCols);
    float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#if FP4_WPS == 16
    pass_sums(r, act, stride_act, pairs + z0, count, z0 > 0, xp, k_len, inter, g, c, acc);
#else
    pass_sums<true>(r, act, stride_act, pairs + z0, 1, count, z0 > 0, xp, inter, words_per_row, g, c, acc);
#endif
#pragma unroll
    for (int h = 0; h < 2; ++h) {  // column 2c + h: row n from d[h], row n + 8 from d[2 + h]
      if (2 * c + h < count) {
        float* y_row = y + pairs[z0 + 2 * c + h] * stride_y;
        y_row[n] = (acc[0][h] + acc[1][h]) * 0.25f;
        y_row[n + 8] = (acc[0][2 + h] + acc[1][2 + h]) * 0.25f;
      }
    }
  }
}
