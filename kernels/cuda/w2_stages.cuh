// A warp's W2 K tiles staged through shared memory by cp.async (w2_gate_up.cu built with W2_STAGES >= 2), instead
// of the register ring of bf16_mma.cuh (`first_loads`, `k_loop`): the loads of kStages - 1 tiles are in flight while
// one is computed, and a load in flight holds no register, so the depth is bounded by shared memory, not by the
// 128 registers of 4 blocks per SM.
//
// Each lane copies its own four 16-byte word vectors of a tile (the vectors `load_tile` reads: words 4c..4c+3 and
// 16+4c..16+4c+3 of gate row g and of up row g) and reads them back itself; the two rows' scale vectors are shared by
// the quad (every lane of row g needs the same 16 bytes), so lane c = 0 copies the gate row's and lane c = 1 the up
// row's, and the quad reads both after a __syncwarp. Same words, same decode, same mmas in the same order as the
// register ring: the bytes of the output do not change.
//
// A warp's stage: uint4 [kStageVecs] = words [4][32 lanes] then scales [8 rows g][gate, up].

#pragma once

#include <cstdint>

#include "w2_fragments.cuh"  // Tile, Rows, tile_mma, kPairWordsPerTile, copy_async_16

namespace {

constexpr int kStageWordVecs = 4 * 32;                 // 4 word vectors per lane
constexpr int kStageVecs = kStageWordVecs + 8 * 2;     // + a gate and an up scale vector per row g
constexpr int kStageBytes = kStageVecs * 16;           // 2304 bytes per warp and stage

// Tile t of the warp's rows into `stage` (not committed). load_c: the loads' word vector index, as in `load_tile`.
__device__ __forceinline__ void stage_tile(const Rows& r, int t, int load_c, int lane, int g, int c, uint4* stage) {
  copy_async_16(stage + lane, r.ra + 8 * t + load_c);
  copy_async_16(stage + 32 + lane, r.ra + 8 * t + 4 + load_c);
  copy_async_16(stage + 64 + lane, r.rb + 8 * t + load_c);
  copy_async_16(stage + 96 + lane, r.rb + 8 * t + 4 + load_c);
  if (c < 2) copy_async_16(stage + kStageWordVecs + 2 * g + c, (c ? r.sb : r.sa) + t);
}

__device__ __forceinline__ Tile staged_tile(const uint4* stage, int lane, int g) {
  Tile w;
  w.a0 = stage[lane];
  w.a1 = stage[32 + lane];
  w.b0 = stage[64 + lane];
  w.b1 = stage[96 + lane];
  w.sa = stage[kStageWordVecs + 2 * g];
  w.sb = stage[kStageWordVecs + 2 * g + 1];
  return w;
}

// Tiles 0 .. kStages - 2 into stages 0 .. kStages - 2, one committed group each (before the activation pairs are
// built). warp_stages: the warp's uint4 [kStages][kStageVecs].
template <int kStages>
__device__ __forceinline__ void staged_first_loads(const Rows& r, uint4* warp_stages, int tiles, int load_c, int lane,
                                                   int g, int c) {
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < tiles) stage_tile(r, s, load_c, lane, g, c, warp_stages + s * kStageVecs);
    commit_copies();
  }
}

// The K loop: tile t waits for its group (kStages - 2 younger ones may stay in flight), the warp syncs (the quad's
// scale copies visible; every lane done reading the stage the next copy overwrites), tile t + kStages - 1 goes into
// the stage tile t - 1 used, then tile t is decoded from its stage. Every iteration commits a group (empty past the
// last tile) so the wait count stays exact. xp as in `k_loop` (after a barrier).
template <int kStages>
__device__ __forceinline__ void staged_k_loop(const Rows& r, uint4* warp_stages, const uint32_t* xp, int tiles,
                                              int load_c, int lane, int g, int c, float (&acc)[2][4]) {
  for (int t0 = 0; t0 < tiles; t0 += kStages) {
#pragma unroll
    for (int j = 0; j < kStages; ++j) {
      const int t = t0 + j;
      if (t < tiles) {
        wait_copies<kStages - 2>();
        __syncwarp();
        if (t + kStages - 1 < tiles) {
          stage_tile(r, t + kStages - 1, load_c, lane, g, c, warp_stages + ((j + kStages - 1) % kStages) * kStageVecs);
        }
        commit_copies();
        tile_mma(staged_tile(warp_stages + j * kStageVecs, lane, g), xp + t * kPairWordsPerTile, c, acc);
      }
    }
  }
}

}  // namespace
