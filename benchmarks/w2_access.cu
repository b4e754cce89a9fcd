// Access-pattern probe for the single-token W2 gate_up (benchmarks/w2_access.py; cuda-w2-notes.md "v4"): each warp
// reads the bytes a gate_up warp reads at T = 1, tile by tile in the same order, and only XORs them (no decode, no
// mma), so its time is what the reads alone cost at that depth and in that pattern.
//
//   PROBE_AHEAD n: K tiles of loads in flight per lane while one is consumed (a register ring, as W2_AHEAD).
//   PROBE_TILED 0: the pool's row layout: the gate_up's addresses (gate row g and up row g of the warp, 128 bytes of
//     each per K tile, 1792 bytes apart row to row at DeepSeek-V3's hidden, plus both rows' 16 scale bytes).
//   PROBE_TILED 1: the same number of bytes per warp and tile (2048 word bytes + 256 scale bytes) as one contiguous
//     chunk, warp after warp: what a layout with each warp's K tile contiguous would read.
//   PROBE_PAIRED 1 (row layout): each load instruction covers a whole 128-byte K tile of one row instead of the same
//     64 bytes of eight rows: rows 2j and 2j + 1 of the warp are read by both row groups (one instruction per row), and
//     one shuffle per uint4 hands each lane its own row's words, so every lane ends with the row pattern's registers.
//   PROBE_PREFETCH 1 (row layout): the block first asks its rows' words and scales into L2 with bulk prefetches
//     (1 KiB each, as the W2_STREAM_PREFETCH build of w2_gate_up.cu), then loads as without.
// Grid as the gate_up's: (route blocks, inter / 32), 128 threads, 4 blocks per SM.

#include <cstdint>

#ifndef PROBE_AHEAD
#define PROBE_AHEAD 2
#endif
#ifndef PROBE_TILED
#define PROBE_TILED 0
#endif
#ifndef PROBE_PAIRED
#define PROBE_PAIRED 0
#endif
#ifndef PROBE_PREFETCH
#define PROBE_PREFETCH 0
#endif

namespace {

struct Vecs {
  uint4 a0, a1, b0, b1, sa, sb;
};

__device__ __forceinline__ unsigned fold(const uint4& v) { return v.x ^ v.y ^ v.z ^ v.w; }

__device__ __forceinline__ uint4 shuffle_xor(const uint4& v, int mask) {
  return make_uint4(__shfl_xor_sync(~0u, v.x, mask), __shfl_xor_sync(~0u, v.y, mask), __shfl_xor_sync(~0u, v.z, mask),
                    __shfl_xor_sync(~0u, v.w, mask));
}

// Words 8t + c (lo) and 8t + 4 + c (hi) of this lane's row (`row` points at row 2j + h, h = g & 1) with each
// instruction reading all 128 bytes of one row's tile: the lanes of rows 2j and 2j + 1 first read row 2j (h = 0 gets
// its lo, h = 1 its hi), then row 2j + 1; each lane then trades the vector its partner (lane ^ 4) needs for its own.
__device__ __forceinline__ void load_paired(const uint4* row, long long row_vecs, int h, int t, int c, uint4& lo,
                                            uint4& hi) {
  const uint4* even = row - h * row_vecs;
  const uint4 first = __ldg(even + 8 * t + 4 * h + c), second = __ldg(even + row_vecs + 8 * t + 4 * h + c);
  const uint4 got = shuffle_xor(h ? first : second, 4);
  lo = h ? got : first;
  hi = h ? second : got;
}

#if PROBE_PREFETCH
__device__ __forceinline__ void prefetch_l2(const uint8_t* at, long long bytes) {
  for (long long off = threadIdx.x * 1024ll; off < bytes; off += blockDim.x * 1024ll) {
    const unsigned size = static_cast<unsigned>(bytes - off < 1024 ? bytes - off : 1024);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(at + off), "r"(size) : "memory");
  }
}
#endif

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
#if PROBE_PREFETCH
  const long long first_row = blockIdx.y * 32ll;
  prefetch_l2(base + words_off + 16 * first_row * row_vecs, 16 * 32 * row_vecs);
  prefetch_l2(base + words_off + 16 * (first_row + inter) * row_vecs, 16 * 32 * row_vecs);
  prefetch_l2(base + scales_off + 16 * first_row * scale_vecs, 16 * 32 * scale_vecs);
  prefetch_l2(base + scales_off + 16 * (first_row + inter) * scale_vecs, 16 * 32 * scale_vecs);
#endif
#if PROBE_PAIRED
  const int h = g & 1;
  auto load = [&](int t) {
    Vecs v;
    load_paired(gate, row_vecs, h, t, c, v.a0, v.a1);
    load_paired(up, row_vecs, h, t, c, v.b0, v.b1);
    v.sa = __ldg(gs + t);
    v.sb = __ldg(us + t);
    return v;
  };
#else
  auto load = [&](int t) {
    return Vecs{__ldg(gate + 8 * t + c), __ldg(gate + 8 * t + 4 + c), __ldg(up + 8 * t + c),
                __ldg(up + 8 * t + 4 + c), __ldg(gs + t), __ldg(us + t)};
  };
#endif
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
