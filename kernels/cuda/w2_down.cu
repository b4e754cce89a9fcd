// W2 down stage for decode (one routed pair per block row, the Triton path's BT = 1), on tensor cores.
//
//   y[pair, n] = W2_e[n] . act[pair]      (float32, n < H, K = I)
//
// Inputs are the Triton down stage's: the W2 pool's slot bytes (layout: kernels/layout.py, the w2 section
// [H, I]), its table and the FP4 table, the BT = 1 route output (block b -> expert, pair) and the gate_up
// stage's act [P, I] bf16. Output: the per-pair rows y [P, H] float32 the combine reads. K (= inter) must
// be a multiple of 512 (whole 32-word tiles, each bit slot one scale block), H a multiple of 64 * GROUPS.
//
// An FP4-resident expert's pair is not this kernel's work, and no kernel of the CUDA path computes it: its
// y rows are written as NaN, so a layer with FP4 pairs run through the CUDA path shows up in the output
// instead of reading stale rows (kernels/cuda/w2_moe.py).
//
// Same decode and fragment mapping as w2_gate_up.cu, ungated: one warp owns 16 output rows = one
// mma.m16n8k16 A tile; lane (g = lane / 4, c = lane % 4) loads words 4c..4c+3 and 16+4c..16+4c+3 of each
// K tile of rows g and g + 8 (16-byte loads): a0 (row g) / a1 (row g+8) carry word 4c+m, a2 / a3 word
// 16+4c+m, slot pair i; B carries the matching activation pairs of act[pair], identical in all columns,
// so lane (g, 0) finds row g in d0 and lane (g, 1) row g + 8 in d2. fp32 accumulation, two accumulators
// alternating; no atomics, fixed order: repeated launches give identical bytes.
//
// Each warp runs GROUPS row groups of 16 one after another; the register ring of weight loads runs across
// group boundaries (W2_AHEAD tiles in flight while one is computed), so the next group's first loads are
// issued before the current group's last tile is computed.

#include <cstdint>
#include <cuda_bf16.h>

#ifndef W2_AHEAD
#define W2_AHEAD 2  // K tiles whose loads are in flight while one is computed
#endif
#ifndef W2_GROUPS
#define W2_GROUPS 1  // 16-row groups per warp
#endif

namespace {

constexpr int kAhead = W2_AHEAD;
constexpr int kGroups = W2_GROUPS;
constexpr int kWarps = 4;
constexpr int kRowsPerGroup = 16;
constexpr int kRowsPerBlock = kWarps * kGroups * kRowsPerGroup;
constexpr int kWps = 32;                     // words per bit slot
constexpr int kTileK = 16 * kWps;            // 512 K values per word tile
constexpr int kPairWordsPerTile = 8 * kWps;  // 256 activation pairs per tile in shared memory

struct Tile {    // one lane's share of one K tile
  uint4 a0, a1;  // row g words 4c..4c+3, 16+4c..16+4c+3
  uint4 b0, b1;  // row g + 8, same words
  uint4 sa, sb;  // the tile's 16 scale bytes of row g, of row g + 8
};

__device__ __forceinline__ uint32_t part(const uint4& v, int m) {
  return m == 0 ? v.x : m == 1 ? v.y : m == 2 ? v.z : v.w;
}

// Scale bytes 2i and 2i+1 of a tile -> (byte 2i << 7) | (byte 2i+1 << 23): both bf16 exponent fields.
__device__ __forceinline__ uint32_t scale_pair(const uint4& q, int i) {
  return __byte_perm(part(q, i >> 1), 0u, (i & 1) ? 0x4342u : 0x4140u) << 7;
}

// Slot pair i of word w as bf16x2 (slot 2i low), scaled: mask, rotate by 8 - 2i, add the exponents.
__device__ __forceinline__ uint32_t w2_pair(uint32_t w, int i, uint32_t scale) {
  const uint32_t rot = (8u - 2u * i) & 31u;
  const uint32_t mask = rot ? (0x81008100u >> rot) | (0x81008100u << (32u - rot)) : 0x81008100u;
  const uint32_t m = w & mask;
  return __funnelshift_l(m, m, rot) + scale;
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// lo / hi: rows g and g + 8 as uint4 [words_per_row / 4] at K tile t; sl / sh: their scales as uint4 [tiles].
__device__ __forceinline__ Tile load_tile(const uint4* lo, const uint4* hi, const uint4* sl, const uint4* sh,
                                          int t, int c) {
  Tile r;
  r.a0 = __ldg(lo + 8 * t + c);
  r.a1 = __ldg(lo + 8 * t + 4 + c);
  r.b0 = __ldg(hi + 8 * t + c);
  r.b1 = __ldg(hi + 8 * t + 4 + c);
  r.sa = __ldg(sl + t);
  r.sb = __ldg(sh + t);
  return r;
}

// a: bf16 bits [K] -> xp [K / 2], ordered as the lanes read B (as w2_gate_up.cu's build_pairs): for tile t,
// slot pair i, lane column c, mma m: xp[t*256 + i*32 + 8c + 2m + h] = pair of word u = 16h + 4c + m, where
// the pair of word u is a[t*512 + 64i + u] | a[t*512 + 64i + 32 + u] << 16.
__device__ void build_pairs(const uint16_t* __restrict__ a, uint32_t* xp, int k_len) {
  const int units = k_len / 16;  // unit q = (t * 8 + i) * 4 + c: 8 pairs
  for (int q = threadIdx.x; q < units; q += blockDim.x) {
    const int k = (q >> 5) * kTileK + ((q >> 2) & 7) * 64 + 4 * (q & 3);
    const uint2 la = *reinterpret_cast<const uint2*>(a + k);       // slot 2i, words 4c..4c+3
    const uint2 lb = *reinterpret_cast<const uint2*>(a + k + 16);  // slot 2i, words 16+4c..
    const uint2 ha = *reinterpret_cast<const uint2*>(a + k + 32);  // slot 2i+1, words 4c..
    const uint2 hb = *reinterpret_cast<const uint2*>(a + k + 48);  // slot 2i+1, words 16+4c..
    uint4 p, r;
    p.x = __byte_perm(la.x, ha.x, 0x5410); p.y = __byte_perm(lb.x, hb.x, 0x5410);  // m 0, h 0/1
    p.z = __byte_perm(la.x, ha.x, 0x7632); p.w = __byte_perm(lb.x, hb.x, 0x7632);  // m 1
    r.x = __byte_perm(la.y, ha.y, 0x5410); r.y = __byte_perm(lb.y, hb.y, 0x5410);  // m 2
    r.z = __byte_perm(la.y, ha.y, 0x7632); r.w = __byte_perm(lb.y, hb.y, 0x7632);  // m 3
    *reinterpret_cast<uint4*>(xp + q * 8) = p;
    *reinterpret_cast<uint4*>(xp + q * 8 + 4) = r;
  }
}

// One K tile: 8 slot pairs x 4 words = 32 mmas (16 rows x 16 K each).
__device__ __forceinline__ void tile_mma(const Tile& w, const uint32_t* xp_tile, int c, float (&acc)[2][4]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t sa = scale_pair(w.sa, i), sb = scale_pair(w.sb, i);
    const uint4 b01 = *reinterpret_cast<const uint4*>(xp_tile + i * 32 + 8 * c);      // B of m = 0, 1
    const uint4 b23 = *reinterpret_cast<const uint4*>(xp_tile + i * 32 + 8 * c + 4);  // B of m = 2, 3
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const uint4& bq = m < 2 ? b01 : b23;
      mma_bf16(acc[m & 1], w2_pair(part(w.a0, m), i, sa), w2_pair(part(w.b0, m), i, sb),
               w2_pair(part(w.a1, m), i, sa), w2_pair(part(w.b1, m), i, sb),
               part(bq, 2 * (m & 1)), part(bq, 2 * (m & 1) + 1));
    }
  }
}

}  // namespace

// Grid (route block, H / kRowsPerBlock), 128 threads; dynamic shared memory 2 * inter bytes (act pairs).
extern "C" __global__ void __launch_bounds__(kWarps * 32, 4) w2_down_mma(
    const uint16_t* __restrict__ act, long long stride_act,                              // act bf16 [P, I]
    const uint8_t* __restrict__ slots, long long slot_bytes, long long words_off,
    long long scales_off, int words_per_row, int blocks_per_row,
    const int* __restrict__ w2_table, const int* __restrict__ f4_table, int table_row,  // [layers * E]
    const int* __restrict__ block_expert, const int* __restrict__ block_pairs,         // route, BT = 1
    const int* __restrict__ num_blocks,
    float* __restrict__ y, long long stride_y, int inter) {                             // y float32 [P, H]
  extern __shared__ uint4 smem[];
  uint32_t* xp = reinterpret_cast<uint32_t*>(smem);  // [I / 2] activation pairs
  const int b = blockIdx.x;
  if (b >= *num_blocks) return;
  const int expert = block_expert[b];
  const int pair = block_pairs[b];
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int n0 = blockIdx.y * kRowsPerBlock + (threadIdx.x >> 5) * (kGroups * kRowsPerGroup) + g;  // group 0, row g
  float* y_row = y + pair * stride_y;
  if (f4_table[table_row + expert] >= 0) {  // FP4 pair: not computed on this path, marked
    if (c < 2) {
#pragma unroll
      for (int r = 0; r < kGroups; ++r) y_row[n0 + r * kRowsPerGroup + 8 * c] = __int_as_float(0x7fc00000);
    }
    return;
  }

  const uint8_t* base = slots + static_cast<long long>(w2_table[table_row + expert]) * slot_bytes;
  const long long row_vecs = words_per_row / 4, scale_vecs = blocks_per_row / 16;
  const uint4* lo = reinterpret_cast<const uint4*>(base + words_off) + n0 * row_vecs;
  const uint4* sl = reinterpret_cast<const uint4*>(base + scales_off) + n0 * scale_vecs;
  const int tiles = words_per_row / kWps;
  const int steps = kGroups * tiles;  // (group, tile) in order; step s = group s / tiles, tile s % tiles

  // Load cursor: the tile and the row-group offset of the next step to be loaded.
  int load_t = 0;
  long long load_w = 0, load_s = 0;  // row offsets (uint4) of the loaded group's row g: words, scales
  auto load_next = [&]() {
    const Tile r = load_tile(lo + load_w, lo + load_w + 8 * row_vecs, sl + load_s, sl + load_s + 8 * scale_vecs,
                             load_t, c);
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
  build_pairs(act + pair * stride_act, xp, inter);
  __syncthreads();

  float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  int t = 0, n = n0;  // compute cursor: tile, row g of the current group
  for (int s0 = 0; s0 < steps; s0 += kAhead + 1) {
#pragma unroll
    for (int j = 0; j <= kAhead; ++j) {
      const int s = s0 + j;
      if (s < steps) {
        if (s + kAhead < steps) ring[(j + kAhead) % (kAhead + 1)] = load_next();
        tile_mma(ring[j], xp + t * kPairWordsPerTile, c, acc);
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
