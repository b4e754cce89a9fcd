// W2 down stage, multi-token: one CUDA block = one route block's 64 * GROUPS output rows (block_tokens = 16, 32 or 64
// pairs of one expert), its pairs in column groups of 8 (w2_multi.cuh), so the expert's bytes are loaded and decoded
// once per row tile for up to 8 pairs.
//
//   y[pair, n] = W2_e[n] . act[pair]      (float32, n < H, K = I)
//
// Same inputs as w2_down.cu plus block_fill and block_tokens; the same loads, decode, tile_mma and (group, tile)
// ring, with B column g = act of the group's pair g: lane (g, c) stores rows g (d0, d1) and g + 8 (d2, d3) of its
// columns 2c and 2c + 1. Each column's arithmetic is the single-token kernel's. FP4-resident experts' pairs: their
// y rows of this block are written as NaN (w2_down.cu); missing experts have no route block. No atomics.
//
// 4 warps, 4 blocks per SM; shared memory 8 columns x (K / 2 + 4) words (32.9 KB at I = 2048; K = I, or built with
// W2_WPS 16 for an inter not a multiple of 512, the pair tiles' 512 each: w2_half_tiles.cuh).

#include <cstdint>
#include <cuda_bf16.h>

#include "w2_multi.cuh"

#ifndef W2_AHEAD
#define W2_AHEAD 2  // K tiles whose loads are in flight while one is computed
#endif
#ifndef W2_GROUPS
#define W2_GROUPS 1  // 16-row groups per warp
#endif
#include "w2_half_tiles.cuh"  // W2_WPS (32 or 16) and, for 16, the pair tiles

namespace {

constexpr int kAhead = W2_AHEAD;
constexpr int kGroups = W2_GROUPS;
constexpr int kWarps = 4;
constexpr int kRowsPerGroup = 16;
constexpr int kRowsPerBlock = kWarps * kGroups * kRowsPerGroup;

#if W2_WPS == 16
using ScaleVec = uint2;  // one 16-word tile's 8 scale bytes

// The group's act rows -> xp columns (build_pairs_multi with the pair tiles' order, w2_half_tiles.cuh): k_len the
// pair tiles' K, zero from k_real on.
__device__ void build_pairs_multi16(const uint16_t* __restrict__ a, long long stride_a, const int* __restrict__ pairs,
                                    int count, uint32_t* xp, int stride, int k_len, int k_real) {
  build_columns(a, stride_a, pairs, 1, count, xp, stride, k_len,
                [k_real](const uint16_t* row, int q) { return load_unit16(row, q, k_real, load_act4); },
                [](uint32_t* column, int q, const Unit& u) { store_unit(column, q, u); });
}
#else
using ScaleVec = uint4;  // one 32-word tile's 16 scale bytes
#endif
constexpr int kScaleVecBytes = sizeof(ScaleVec);

}  // namespace

// Grid (route blocks, H / kRowsPerBlock), 128 threads; dynamic shared memory 8 * (2 * K + 16) bytes.
extern "C" __global__ void __launch_bounds__(kWarps * 32, 4) w2_down_multi(
    const uint16_t* __restrict__ act, long long stride_act,                              // act bf16 [P, I]
    const uint8_t* __restrict__ slots, long long slot_bytes, long long words_off,
    long long scales_off, int words_per_row, int blocks_per_row,
    const int* __restrict__ w2_table, const int* __restrict__ f4_table, int table_row,  // [layers * E]
    const int* __restrict__ block_expert, const int* __restrict__ block_fill,           // route, BT = block_tokens
    const int* __restrict__ block_pairs, const int* __restrict__ num_blocks, int block_tokens,
    float* __restrict__ y, long long stride_y, int inter) {                             // y float32 [P, H]
  extern __shared__ uint4 smem[];
  uint32_t* xp = reinterpret_cast<uint32_t*>(smem);  // [8][I / 2 + kPadWords] activation pairs
  const int b = blockIdx.x;
  if (b >= *num_blocks) return;
  const int expert = block_expert[b];
  const int fill = block_fill[b];
  const int* pairs = block_pairs + b * block_tokens;
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int n0 = blockIdx.y * kRowsPerBlock + (threadIdx.x >> 5) * (kGroups * kRowsPerGroup) + g;  // group 0, row g
  if (f4_table[table_row + expert] >= 0) {  // FP4 pairs: not computed on this path, marked
    for (int col = c; col < fill; col += 4) {  // lane (g, c): rows g, g + 8 of every row group, pairs c, c + 4, ..
      float* y_row = y + pairs[col] * stride_y;
#pragma unroll
      for (int r = 0; r < kGroups; ++r) {
        y_row[n0 + r * kRowsPerGroup] = __int_as_float(0x7fc00000);
        y_row[n0 + r * kRowsPerGroup + 8] = __int_as_float(0x7fc00000);
      }
    }
    return;
  }
#if W2_WPS == 16
  const int stride = pair_tiles(words_per_row) * kPairWordsPerTile + kPadWords;
#else
  const int stride = inter / 2 + kPadWords;
#endif
  const uint8_t* base = slots + static_cast<long long>(w2_table[table_row + expert]) * slot_bytes;
  const long long row_vecs = words_per_row / 4, scale_vecs = blocks_per_row / kScaleVecBytes;
  const uint4* lo = reinterpret_cast<const uint4*>(base + words_off) + n0 * row_vecs;
  const ScaleVec* sl = reinterpret_cast<const ScaleVec*>(base + scales_off) + n0 * scale_vecs;
#if W2_WPS == 16
  const int tiles = pair_tiles(words_per_row);
#else
  const int tiles = words_per_row / kWps;
#endif
  const int steps = kGroups * tiles;  // (group, tile) in order; step s = group s / tiles, tile s % tiles

  for (int z0 = 0; z0 < fill; z0 += kCols) {  // column groups: pairs z0 .. z0 + count - 1
    const int count = min(fill - z0, kCols);
    const uint32_t* xp_lane = xp + min(g, count - 1) * stride;  // B column g
    // This lane's two columns 2c, 2c + 1: their pairs' y rows (nullptr past the group's count).
    float* y_col[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) y_col[h] = 2 * c + h < count ? y + pairs[z0 + 2 * c + h] * stride_y : nullptr;

    // Load cursor: the tile and the row-group offset of the next step to be loaded.
    int load_t = 0;
    long long load_w = 0, load_s = 0;  // row offsets (uint4) of the loaded group's row g: words, scales
    auto load_next = [&]() {
#if W2_WPS == 16
      const Tile r = load_tile16(lo + load_w, lo + load_w + 8 * row_vecs, sl + load_s, sl + load_s + 8 * scale_vecs,
                                 load_t, c, words_per_row / 16);
#else
      const Tile r = load_tile(lo + load_w, lo + load_w + 8 * row_vecs, sl + load_s, sl + load_s + 8 * scale_vecs,
                               load_t, c);
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
    if (z0 > 0) __syncthreads();  // every warp is done reading the previous group's columns
#if W2_WPS == 16
    build_pairs_multi16(act, stride_act, pairs + z0, count, xp, stride, tiles * kTileK, inter);
#else
    build_pairs_multi(act, stride_act, pairs + z0, 1, count, xp, stride, inter);
#endif
    __syncthreads();

    float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
    int t = 0, n = n0;  // compute cursor: tile, row g of the current row group
    for (int s0 = 0; s0 < steps; s0 += kAhead + 1) {
#pragma unroll
      for (int j = 0; j <= kAhead; ++j) {
        const int s = s0 + j;
        if (s < steps) {
          if (s + kAhead < steps) ring[(j + kAhead) % (kAhead + 1)] = load_next();
#if W2_WPS == 16
          tile_mma16(ring[j], xp_lane + t * kPairWordsPerTile, c, acc);
#else
          tile_mma(ring[j], xp_lane + t * kPairWordsPerTile, c, acc);
#endif
          if (++t == tiles) {  // the row group is complete: column 2c + h is d[h] (row g), d[2 + h] (row g + 8)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              if (y_col[h]) {
                y_col[h][n] = acc[0][h] + acc[1][h];
                y_col[h][n + 8] = acc[0][2 + h] + acc[1][2 + h];
              }
            }
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[0][q] = acc[1][q] = 0.f;
            t = 0;
            n += kRowsPerGroup;
          }
        }
      }
    }
  }
}
