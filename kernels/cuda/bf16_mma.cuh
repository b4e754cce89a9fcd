// Device code shared by the W2 (w2_fragments.cuh) and FP4 (fp4_fragments.cuh) tensor-core stages: the bf16
// mma.m16n8k16, a uint4's word m, a lane's 16-byte tile loads and the K loop's register ring over them, and the
// activation pair unit (16 activations) stored in B register order. Only what is the same for both formats; each format's decode, tile mmas and unit
// loads stay in its own header.

#pragma once

#include <cstdint>

namespace {

__device__ __forceinline__ uint32_t part(const uint4& v, int m) {
  return m == 0 ? v.x : m == 1 ? v.y : m == 2 ? v.z : v.w;
}

__device__ __forceinline__ void mma_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One lane's share of one K tile: A rows 0..7 (row g) words 4c..4c+3 (a0) and 16+4c..16+4c+3 (a1), A rows 8..15
// (row g of the second half, b0 / b1) the same words, and the tile's scale bytes of each of the two rows (Scales:
// W2 16 bytes, uint4; FP4 8 bytes, uint2).
template <class Scales>
struct WordTile {
  uint4 a0, a1;
  uint4 b0, b1;
  Scales sa, sb;
};

// How a tile's vectors are read: GlobalLoads through the read-only path (weights in device memory or the pinned
// arena, unchanged while the kernel runs), SharedLoads plainly (a streamed block's rows staged in shared memory:
// w2_fragments.cuh `stage_region`; such a block builds its activation pairs before its first tile load).
struct GlobalLoads {
  static constexpr bool kShared = false;
  template <class T>
  __device__ __forceinline__ T operator()(const T* p) const { return __ldg(p); }
};
struct SharedLoads {
  static constexpr bool kShared = true;
  template <class T>
  __device__ __forceinline__ T operator()(const T* p) const { return *p; }
};

// ra / rb: the two rows' words as uint4 [words_per_row / 4]; sa / sb: their scales, one Scales per tile.
template <class Scales, class Loads = GlobalLoads>
__device__ __forceinline__ WordTile<Scales> load_tile(const uint4* ra, const uint4* rb, const Scales* sa,
                                                      const Scales* sb, int t, int c, Loads ld = {}) {
  WordTile<Scales> r;
  r.a0 = ld(ra + 8 * t + c);
  r.a1 = ld(ra + 8 * t + 4 + c);
  r.b0 = ld(rb + 8 * t + c);
  r.b1 = ld(rb + 8 * t + 4 + c);
  r.sa = ld(sa + t);
  r.sb = ld(sb + t);
  return r;
}

// One warp's two A rows for the K loop: words (ra / rb, uint4 [words_per_row / 4]) and scales (sa / sb, one Scales
// per tile), as `load_tile` takes them.
template <class Scales>
struct TileRows {
  const uint4 *ra, *rb;
  const Scales *sa, *sb;
};

// The same rows staged in shared memory (read with SharedLoads).
template <class Scales>
struct SharedTileRows : TileRows<Scales> {};

// One warp's two A rows' tile t for the K loop (`first_loads`, `k_loop`): rows of another kind (16-word FP4 tiles,
// fp4_half_tiles.cuh) bring their own `load_rows` and tile type.
template <class Scales>
__device__ __forceinline__ WordTile<Scales> load_rows(const TileRows<Scales>& r, int t, int load_c) {
  return load_tile(r.ra, r.rb, r.sa, r.sb, t, load_c);
}

template <class Scales>
__device__ __forceinline__ WordTile<Scales> load_rows(const SharedTileRows<Scales>& r, int t, int load_c) {
  return load_tile(r.ra, r.rb, r.sa, r.sb, t, load_c, SharedLoads{});
}

// The K loop of one warp over `tiles` K tiles of its two A rows: a register ring of kAhead + 1 tiles, tile t in
// ring[t % (kAhead + 1)]; loads past the last tile reload it. load_c: the loads' word vector index (c, or 0 where c
// is already in ra / rb); `xp` holds the activation pairs, kPairWords words per tile (after a barrier); each tile
// goes to the format's `tile_mma` (w2_fragments.cuh, fp4_fragments.cuh, fp4_half_tiles.cuh; chosen by the tile type).
// first_loads issues tiles 0 .. kAhead - 1 (before the pairs are built), k_loop the rest.
template <int kAhead, class Rows, class Tile>
__device__ __forceinline__ void first_loads(const Rows& r, Tile (&ring)[kAhead + 1], int tiles, int load_c) {
#pragma unroll
  for (int j = 0; j < kAhead; ++j) ring[j] = load_rows(r, min(j, tiles - 1), load_c);
}

template <int kAhead, int kPairWords, class Rows, class Tile>
__device__ __forceinline__ void k_loop(const Rows& r, Tile (&ring)[kAhead + 1], const uint32_t* xp, int tiles,
                                       int load_c, int c, float (&acc)[2][4]) {
  for (int t0 = 0; t0 < tiles; t0 += kAhead + 1) {
#pragma unroll
    for (int j = 0; j <= kAhead; ++j) {
      const int t = t0 + j;
      if (t < tiles) {
        ring[(j + kAhead) % (kAhead + 1)] = load_rows(r, min(t + kAhead, tiles - 1), load_c);
        tile_mma(ring[j], xp + t * kPairWords, c, acc);
      }
    }
  }
}

// Two 32-bit words at p with a plain (coherent) ld.global: for activations a preceding grid writes while this one may
// already run (programmatic dependent launch), which must not go through the non-coherent read-only path
// (LDG.CONSTANT, what nvcc makes of a load through a const __restrict__ pointer, requires the data to be unchanged
// for the kernel's lifetime). Read only after griddepcontrol.wait.
__device__ __forceinline__ uint2 load_coherent(const uint16_t* p) {
  uint2 v;
  asm volatile("ld.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

// One unit's 16 activations (a format's `load_unit` reads them): slot 2i (la, lb) and slot 2i+1 (ha, hb) of
// words 4c..4c+3 (la, ha) and 16+4c..16+4c+3 (lb, hb).
struct Unit {
  uint2 la, lb;
  uint2 ha, hb;
};

// Unit q's pairs into xp[8q .. 8q+7]: xp[8q + 2m + h] = pair of word 16h + 4c + m (low half slot 2i). One LDS.128
// then holds two mmas' B. unit_words gives the 8 words (p: m = 0, 1; r: m = 2, 3); store_unit stores them as two
// 16-byte words (xp 16-byte aligned), store_unit_8 as four 8-byte words (xp 8-byte aligned: fp4_moe_multi.cu's
// columns).
struct UnitWords {
  uint4 p, r;
};

__device__ __forceinline__ UnitWords unit_words(const Unit& u) {
  UnitWords w;
  w.p.x = __byte_perm(u.la.x, u.ha.x, 0x5410); w.p.y = __byte_perm(u.lb.x, u.hb.x, 0x5410);  // m 0, h 0/1
  w.p.z = __byte_perm(u.la.x, u.ha.x, 0x7632); w.p.w = __byte_perm(u.lb.x, u.hb.x, 0x7632);  // m 1
  w.r.x = __byte_perm(u.la.y, u.ha.y, 0x5410); w.r.y = __byte_perm(u.lb.y, u.hb.y, 0x5410);  // m 2
  w.r.z = __byte_perm(u.la.y, u.ha.y, 0x7632); w.r.w = __byte_perm(u.lb.y, u.hb.y, 0x7632);  // m 3
  return w;
}

__device__ __forceinline__ void store_unit(uint32_t* xp, int q, const Unit& u) {
  const UnitWords w = unit_words(u);
  *reinterpret_cast<uint4*>(xp + q * 8) = w.p;
  *reinterpret_cast<uint4*>(xp + q * 8 + 4) = w.r;
}

__device__ __forceinline__ void store_unit_8(uint32_t* xp, int q, const Unit& u) {
  const UnitWords w = unit_words(u);
  uint2* out = reinterpret_cast<uint2*>(xp + q * 8);
  out[0] = make_uint2(w.p.x, w.p.y);
  out[1] = make_uint2(w.p.z, w.p.w);
  out[2] = make_uint2(w.r.x, w.r.y);
  out[3] = make_uint2(w.r.z, w.r.w);
}

// The activation rows of `count` pairs as `count` columns in B register order: column j (at xp + j * stride) from
// row pairs[j] / divisor of a (rows stride_a apart), k_len / 16 units each. divisor: top_k when the rows are tokens
// (gate_up's x), 1 when they are pairs (down's act). load(row, q) -> Unit reads a format's unit q of a row;
// store(column, q, unit) writes it. All of a block's threads, kUnroll units per thread per round, every load of a
// round issued before its stores.
template <class Load, class Store>
__device__ __forceinline__ void build_columns(const uint16_t* __restrict__ a, long long stride_a,
                                              const int* __restrict__ pairs, int divisor, int count, uint32_t* xp,
                                              int stride, int k_len, Load load, Store store) {
  constexpr int kUnroll = 4;
  const int units = k_len / 16, total = count * units;
  const int step = static_cast<int>(blockDim.x);
  for (int q0 = threadIdx.x; q0 < total; q0 += kUnroll * step) {
    Unit u[kUnroll];
    int col[kUnroll], q[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int idx = min(q0 + j * step, total - 1);
      col[j] = idx / units;
      q[j] = idx - col[j] * units;
      u[j] = load(a + static_cast<long long>(pairs[col[j]] / divisor) * stride_a, q[j]);
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      if (q0 + j * step < total) store(xp + col[j] * stride, q[j], u[j]);
    }
  }
}

}  // namespace
