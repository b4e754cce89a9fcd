// Access-pattern probe for the single-token W2 gate_up (benchmarks/w2_access.py; cuda-w2-notes.md "v4"): each warp
// reads the bytes a gate_up warp reads at T = 1, tile by tile in the same order, and only XORs them (no decode, no
// mma), so its time is what the reads alone cost at that depth and in that pattern.
//
//   PROBE_AHEAD n: K tiles of loads in flight per lane while one is consumed (a register ring, as W2_AHEAD).
//   PROBE_TILED 0: the pool's row layout: the gate_up's addresses (gate row g and up row g of the warp, 128 bytes of
//     each per K tile, 1792 bytes apart row to row at DeepSeek-V3's hidden, plus both rows' 16 scale bytes).
//   PROBE_TILED 1: the same number of bytes per warp and tile (2048 word bytes + 256 scale bytes) as one contiguous
//     chunk, warp after warp: what a layout with each warp's K tile contiguous would read.
// Grid as the gate_up's: (route blocks, inter / 32), 128 threads, 4 blocks per SM.

#include <cstdint>

#ifndef PROBE_AHEAD
#define PROBE_AHEAD 2
#endif
#ifndef PROBE_TILED
#define PROBE_TILED 0
#endif

namespace {

struct Vecs {
  uint4 a0, a1, b0, b1, sa, sb;
};

__device__ __forceinline__ unsigned fold(const uint4& v) { return v.x ^ v.y ^ v.z ^ v.w; }

}  // namespace

extern "C" __global__ void __launch_bounds__(128, 4) w2_access_probe(
    const uint8_t* __restrict__ slots, long long slot_bytes, long long words_off, long long scales_off,
    int words_per_row, int blocks_per_row, int inter, const int* __restrict__ slot_of_block, unsigned* out) {
  constexpr int kAhead = PROBE_AHEAD;
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3, warp = threadIdx.x >> 5;
  const uint8_t* base = slots + static_cast<long long>(slot_of_block[blockIdx.x]) * slot_bytes;
  const int tiles = words_per_row / 32;
#if PROBE_TILED
  constexpr int kChunkVecs = 144;  // 2304 bytes per warp and tile
  const uint4* chunk = reinterpret_cast<const uint4*>(base + words_off) +
                       static_cast<long long>(blockIdx.y * 4 + warp) * tiles * kChunkVecs;
  auto load = [&](int t) {
    const uint4* p = chunk + t * kChunkVecs;
    return Vecs{__ldg(p + lane), __ldg(p + 32 + lane), __ldg(p + 64 + lane), __ldg(p + 96 + lane),
                __ldg(p + 128 + 2 * g), __ldg(p + 129 + 2 * g)};
  };
#else
  const int n = blockIdx.y * 32 + warp * 8 + g;
  const long long row_vecs = words_per_row / 4, scale_vecs = blocks_per_row / 16;
  const uint4* gate = reinterpret_cast<const uint4*>(base + words_off) + n * row_vecs;
  const uint4* up = gate + inter * row_vecs;
  const uint4* gs = reinterpret_cast<const uint4*>(base + scales_off) + n * scale_vecs;
  const uint4* us = gs + inter * scale_vecs;
  auto load = [&](int t) {
    return Vecs{__ldg(gate + 8 * t + c), __ldg(gate + 8 * t + 4 + c), __ldg(up + 8 * t + c),
                __ldg(up + 8 * t + 4 + c), __ldg(gs + t), __ldg(us + t)};
  };
#endif
  Vecs ring[kAhead + 1];
#pragma unroll
  for (int j = 0; j < kAhead; ++j) ring[j] = load(min(j, tiles - 1));
  unsigned acc = 0;
  for (int t0 = 0; t0 < tiles; t0 += kAhead + 1) {
#pragma unroll
    for (int j = 0; j <= kAhead; ++j) {
      const int t = t0 + j;
      if (t < tiles) {
        ring[(j + kAhead) % (kAhead + 1)] = load(min(t + kAhead, tiles - 1));
        const Vecs& v = ring[j];
        acc ^= fold(v.a0) ^ fold(v.a1) ^ fold(v.b0) ^ fold(v.b1) ^ fold(v.sa) ^ fold(v.sb);
      }
    }
  }
  out[(static_cast<long long>(blockIdx.y) * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x] = acc;
}
