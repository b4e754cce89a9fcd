// W2 gate_up stage for decode (one routed pair per block row, the Triton path's BT = 1), on tensor cores.
//
//   act[pair, n] = SwiGLU(gate, up),  gate = W13_e[n] . x[token],  up = W13_e[n + I] . x[token]
//
// Inputs are the Triton gate_up's: the W2 pool's slot bytes (layout: kernels/layout.py), its table and the
// FP4 table (an FP4-resident expert is not this kernel's work: its pairs are skipped), and the BT = 1 route
// output (block b -> expert, pair). K (= hidden) must be a multiple of 512, so every bit slot of a word
// tile (WPS = 32 words) is exactly one 32-value scale block.
//
// Decode: slot pair i of a word (slots 2i, 2i+1) becomes one bf16x2 register in two instructions:
// LOP3 (mask the pair's four bits where they lie) and LEA.HI (rotate left by 8 - 2i and add the pair's
// scale bytes, placed in both exponent fields). The magnitude bit lands on exponent bit 1 and the sign on
// bit 15/31, so the register is +-{1, 4} * 2^(byte - 127) for each half, exact.
//
// MMA: one warp owns 8 output rows; mma.m16n8k16 rows 0..7 are their gate rows, rows 8..15 their up rows.
// Lane (g = lane / 4, c = lane % 4) loads words 4c..4c+3 and 16+4c..16+4c+3 of each K tile of gate row g
// and up row g (16-byte loads). The K order inside an mma is free as long as A and B agree, and every lane
// with the same c supplies the same K positions, so A register a0 (row g) / a1 (row g+8) carry word 4c+m,
// a2 / a3 word 16+4c+m, pair i, and B carries the matching activation pairs. B is the same in all eight
// columns, hence all columns of D are equal and lane (g, 0) finds gate in d0, up in d2. Accumulation is
// fp32 in the tensor core (products exact: bf16 weight and activation), two accumulators alternating.
//
// Activations: each block turns its token's x [H] bf16 into the pairs the lanes read (bit slots 2i | 2i+1
// << 16, in B register order: `build_pairs`) in shared memory once, after issuing its first weight loads.
// No atomics; fixed order: repeated launches give identical bytes.

#include <cstdint>
#include <cuda_bf16.h>

#ifndef W2_AHEAD
#define W2_AHEAD 1  // K tiles whose loads are in flight while one is computed (build with -DW2_AHEAD=2: 2)
#endif

namespace {

constexpr int kAhead = W2_AHEAD;
constexpr int kWarps = 4;
constexpr int kRowsPerWarp = 8;                      // output rows per warp (the gate half of one m16 tile)
constexpr int kRowsPerBlock = kWarps * kRowsPerWarp;  // 32
constexpr int kWps = 32;                             // words per bit slot
constexpr int kTileK = 16 * kWps;                    // 512 K values per word tile
constexpr int kPairWordsPerTile = 8 * kWps;          // 256 activation pairs per tile in shared memory

struct Tile {   // one lane's share of one K tile
  uint4 g0, g1;  // gate row words 4c..4c+3, 16+4c..16+4c+3
  uint4 u0, u1;  // up row, same words
  uint4 sg, su;  // the tile's 16 scale bytes of the gate row, of the up row
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

// gate/up: the rows' words as uint4 [words_per_row / 4]; gs/us: their scales as uint4 [blocks_per_row / 16].
__device__ __forceinline__ Tile load_tile(const uint4* gate, const uint4* up, const uint4* gs, const uint4* us,
                                          int t, int c) {
  Tile r;
  r.g0 = __ldg(gate + 8 * t + c);
  r.g1 = __ldg(gate + 8 * t + 4 + c);
  r.u0 = __ldg(up + 8 * t + c);
  r.u1 = __ldg(up + 8 * t + 4 + c);
  r.sg = __ldg(gs + t);
  r.su = __ldg(us + t);
  return r;
}

// x: bf16 bits [H] -> xp [H / 2], ordered as the lanes read B: for tile t, slot pair i, lane column c,
// mma m: xp[t*256 + i*32 + 8c + 2m + h] = pair of word u = 16h + 4c + m, where the pair of word u is
// x[t*512 + 64i + u] | x[t*512 + 64i + 32 + u] << 16 (slots 2i, 2i+1). One LDS.128 then holds two mmas' B.
__device__ void build_pairs(const uint16_t* __restrict__ x, uint32_t* xp, int hidden) {
  constexpr int kUnroll = 4;  // units per thread per round: all their loads are issued before any store
  const int units = hidden / 16;  // unit q = (t * 8 + i) * 4 + c: 8 pairs
  for (int q0 = threadIdx.x; q0 < units; q0 += kUnroll * blockDim.x) {
    uint2 la[kUnroll], lb[kUnroll], ha[kUnroll], hb[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int q = min(q0 + j * static_cast<int>(blockDim.x), units - 1);
      const int k = (q >> 5) * kTileK + ((q >> 2) & 7) * 64 + 4 * (q & 3);
      la[j] = *reinterpret_cast<const uint2*>(x + k);       // slot 2i, words 4c..4c+3
      lb[j] = *reinterpret_cast<const uint2*>(x + k + 16);  // slot 2i, words 16+4c..
      ha[j] = *reinterpret_cast<const uint2*>(x + k + 32);  // slot 2i+1, words 4c..
      hb[j] = *reinterpret_cast<const uint2*>(x + k + 48);  // slot 2i+1, words 16+4c..
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int q = q0 + j * static_cast<int>(blockDim.x);
      if (q < units) {
        uint4 p, r;
        p.x = __byte_perm(la[j].x, ha[j].x, 0x5410); p.y = __byte_perm(lb[j].x, hb[j].x, 0x5410);  // m 0, h 0/1
        p.z = __byte_perm(la[j].x, ha[j].x, 0x7632); p.w = __byte_perm(lb[j].x, hb[j].x, 0x7632);  // m 1
        r.x = __byte_perm(la[j].y, ha[j].y, 0x5410); r.y = __byte_perm(lb[j].y, hb[j].y, 0x5410);  // m 2
        r.z = __byte_perm(la[j].y, ha[j].y, 0x7632); r.w = __byte_perm(lb[j].y, hb[j].y, 0x7632);  // m 3
        *reinterpret_cast<uint4*>(xp + q * 8) = p;
        *reinterpret_cast<uint4*>(xp + q * 8 + 4) = r;
      }
    }
  }
}

// One K tile: 8 slot pairs x 4 words = 32 mmas (16 rows x 16 K each).
__device__ __forceinline__ void tile_mma(const Tile& w, const uint32_t* xp_tile, int c, float (&acc)[2][4]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint32_t sg = scale_pair(w.sg, i), su = scale_pair(w.su, i);
    const uint4 b01 = *reinterpret_cast<const uint4*>(xp_tile + i * 32 + 8 * c);      // B of m = 0, 1
    const uint4 b23 = *reinterpret_cast<const uint4*>(xp_tile + i * 32 + 8 * c + 4);  // B of m = 2, 3
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const uint4& bq = m < 2 ? b01 : b23;
      mma_bf16(acc[m & 1], w2_pair(part(w.g0, m), i, sg), w2_pair(part(w.u0, m), i, su),
               w2_pair(part(w.g1, m), i, sg), w2_pair(part(w.u1, m), i, su),
               part(bq, 2 * (m & 1)), part(bq, 2 * (m & 1) + 1));
    }
  }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(kWarps * 32, 4) w2_gate_up_mma(
    const uint16_t* __restrict__ x, long long stride_x,              // activations bf16 [T, H]
    const uint8_t* __restrict__ slots, long long slot_bytes,         // W2 pool uint8 [S, slot_bytes]
    long long words_off, long long scales_off, int words_per_row, int blocks_per_row,
    const int* __restrict__ w2_table, const int* __restrict__ f4_table, int table_row,  // [layers * E]
    const int* __restrict__ block_expert, const int* __restrict__ block_pairs,         // route, BT = 1
    const int* __restrict__ num_blocks, int top_k,
    __nv_bfloat16* __restrict__ act, long long stride_act, int inter, int hidden,       // act bf16 [P, I]
    float limit, int has_limit) {
  extern __shared__ uint4 smem[];
  uint32_t* xp = reinterpret_cast<uint32_t*>(smem);  // [H / 2] activation pairs
  const int b = blockIdx.x;
  if (b >= *num_blocks) return;
  const int expert = block_expert[b];
  if (f4_table[table_row + expert] >= 0) return;
  const int pair = block_pairs[b];
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int n = blockIdx.y * kRowsPerBlock + (threadIdx.x >> 5) * kRowsPerWarp + g;  // output row

  const uint8_t* base = slots + static_cast<long long>(w2_table[table_row + expert]) * slot_bytes;
  const long long row_vecs = words_per_row / 4, scale_vecs = blocks_per_row / 16;
  const uint4* gate = reinterpret_cast<const uint4*>(base + words_off) + n * row_vecs;
  const uint4* up = gate + inter * row_vecs;
  const uint4* gs = reinterpret_cast<const uint4*>(base + scales_off) + n * scale_vecs;
  const uint4* us = gs + inter * scale_vecs;
  const int tiles = words_per_row / kWps;

  Tile ring[kAhead + 1];  // tile t lives in ring[t % (kAhead + 1)]; loads past the last tile reload it
#pragma unroll
  for (int j = 0; j < kAhead; ++j) ring[j] = load_tile(gate, up, gs, us, min(j, tiles - 1), c);
  build_pairs(x + (pair / top_k) * stride_x, xp, hidden);
  __syncthreads();

  float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
  for (int t0 = 0; t0 < tiles; t0 += kAhead + 1) {
#pragma unroll
    for (int j = 0; j <= kAhead; ++j) {
      const int t = t0 + j;
      if (t < tiles) {
        ring[(j + kAhead) % (kAhead + 1)] = load_tile(gate, up, gs, us, min(t + kAhead, tiles - 1), c);
        tile_mma(ring[j], xp + t * kPairWordsPerTile, c, acc);
      }
    }
  }
  if (c == 0) {
    float gate_v = acc[0][0] + acc[1][0], up_v = acc[0][2] + acc[1][2];
    if (has_limit) {
      gate_v = fminf(gate_v, limit);
      up_v = fminf(fmaxf(up_v, -limit), limit);
    }
    act[pair * stride_act + n] = __float2bfloat16_rn(gate_v / (1.0f + __expf(-gate_v)) * up_v);
  }
}
