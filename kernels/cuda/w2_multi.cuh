// Device code of the multi-token W2 kernels (w2_gate_up_multi.cu, w2_down_multi.cu): one CUDA block decodes one
// expert's weight tile once for up to kCols = 8 routed pairs of that expert, one pair per mma column.
//
// Columns: the route (block_tokens BT, a multiple of 8) gives block b -> expert, its pairs block_pairs[b * BT ..]
// and their count block_fill[b]. CUDA block x = route block x; it runs its pairs in column groups of 8 (pairs
// z0 .. z0 + 7 for z0 = 0, 8, ..), one after another: fill <= 8, the common case, is one pass, and a second pass
// re-reads the expert's bytes the block itself has just read (L2). Route blocks past num_blocks exit at once.
//
// B: the mma.m16n8k16 B fragment of lane (g = lane / 4, c = lane % 4) is column g (PTX ISA), so lane (g, c) reads
// the activation pairs of column g's pair (columns past the group's count read the last pair's: their D columns
// are never stored). D: lane (g, c) holds columns 2c (d0: row g, d2: row g + 8) and 2c + 1 (d1, d3).
//
// Shared memory: column j's K / 2 pairs at xp + j * stride, stride = K / 2 + kPadWords. The pad makes
// stride / 4 odd (K a multiple of 512), so the two columns of a quarter warp's LDS.128 (lanes 8q..8q+7:
// g = 2q, 2q + 1) fall in different 16-byte bank groups: no bank conflict.

#pragma once

#include <cstdint>

#include "w2_fragments.cuh"

namespace {

constexpr int kCols = 8;       // mma N: pairs per column group
constexpr int kPadWords = 4;   // per-column shared-memory pad (16 bytes)

// The activation rows of the group's pairs -> xp: column j = row a + (pairs[j] / divisor) * stride_a [k_len] bf16,
// as pairs in B register order (w2_fragments.cuh `load_unit` / `store_unit`) at xp + j * stride.
// divisor: top_k when the rows are tokens (gate_up's x), 1 when they are pairs (down's act).
__device__ void build_pairs_multi(const uint16_t* __restrict__ a, long long stride_a, const int* __restrict__ pairs,
                                  int divisor, int count, uint32_t* xp, int stride, int k_len) {
  build_columns(a, stride_a, pairs, divisor, count, xp, stride, k_len,
                [](const uint16_t* row, int q) { return load_unit(row, q); },
                [](uint32_t* column, int q, const Unit& u) { store_unit(column, q, u); });
}

}  // namespace
