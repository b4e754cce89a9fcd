// W2 gate_up stage for decode (one routed pair per block row, the Triton path's BT = 1), on tensor cores.
//
//   act[pair, n] = SwiGLU(gate, up),  gate = W13_e[n] . x[token],  up = W13_e[n + I] . x[token]
//
// Inputs are the Triton gate_up's: the W2 pool's slot bytes (layout: kernels/layout.py), its table and the
// FP4 table (an FP4-resident expert is not this kernel's work: its pairs are skipped), and the BT = 1 route
// output (block b -> expert, pair). K (= hidden) must be a multiple of 512, so every bit slot of a word
// tile (WPS = 32 words) is exactly one 32-value scale block.
//
// Decode (slot pair -> bf16x2 in LOP3 + LEA.HI), tile loads, the K tile's mmas and the activation pair units:
// w2_fragments.cuh, shared with w2_down.cu.
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

#include "w2_fragments.cuh"
#include "w2_stages.cuh"

#ifndef W2_AHEAD
#define W2_AHEAD 1  // K tiles whose loads are in flight while one is computed (build with -DW2_AHEAD=2: 2)
#endif

// v3 build defines (benchmarks/cuda-w2-notes.md "v3"; off: the kernel above, the same SASS):
//   W2_EARLY 1: the prologue's route words (num_blocks, block_expert[b], block_pairs[b]) in one round trip and the
//     expert's two table words (f4_table, w2_table) in the next, each round closed by one exit whose condition reads
//     every word of the round (nvcc sinks a load below an exit that does not need it: the default's chain is 4
//     dependent round trips, num_blocks -> block_expert -> f4_table -> w2_table). A block past num_blocks still
//     exits after one round trip. The lane's byte offsets in a slot are computed while the table words are in flight.
//   W2_ROUTE_MAJOR 1: the block's (route block, row tile) from its dispatch index, route block slowest, so the
//     blocks of live route blocks (b < num_blocks) are dispatched first and the grid's exiting blocks (at T = 1 half
//     of them: max_blocks = 2 x 8) last, instead of interleaved with them. Same work per block, no arithmetic change.
//   W2_PDL 1: `griddepcontrol.launch_dependents` first thing in every block, so a kernel launched after this one as a
//     programmatic dependent (w2_down.cu built with W2_PDL, launched with programmatic stream serialization) may be
//     scheduled onto the SMs this grid frees before it completes. No effect on a dependent launched normally.
#ifndef W2_EARLY
#define W2_EARLY 0
#endif
#ifndef W2_PDL
#define W2_PDL 0
#endif
#ifndef W2_ROUTE_MAJOR
#define W2_ROUTE_MAJOR 0
#endif

// W2_STAGES n >= 2 (benchmarks/cuda-w2-notes.md "v4"): the weight tiles go through n shared-memory stages filled by
// cp.async (w2_stages.cuh), n - 1 tiles in flight per warp while one is computed, instead of the register ring of
// W2_AHEAD (unused then). Dynamic shared memory: the activation pairs (2 * H bytes), then the stages
// ([4 warps][n][kStageVecs] uint4). 0 (default): the register ring, the SASS of before.
#ifndef W2_STAGES
#define W2_STAGES 0
#endif
#if W2_STAGES == 1
#error "W2_STAGES is 0 (the register ring) or at least 2"
#endif
#if W2_STAGES && W2_STREAM_STAGE
#error "W2_STREAM_STAGE runs the register ring from its stage: no W2_STAGES build"
#endif

namespace {

#if !W2_STAGES
constexpr int kAhead = W2_AHEAD;
#endif
constexpr int kWarps = 4;
constexpr int kRowsPerWarp = 8;                      // output rows per warp (the gate half of one m16 tile)
constexpr int kRowsPerBlock = kWarps * kRowsPerWarp;  // 32

// x: bf16 bits [H] -> xp [H / 2], ordered as the lanes read B (w2_fragments.cuh: `load_unit`, `store_unit`).
__device__ void build_pairs(const uint16_t* __restrict__ x, uint32_t* xp, int hidden) {
  constexpr int kUnroll = 4;  // units per thread per round: all their loads are issued before any store
  const int units = hidden / 16;  // unit q = (t * 8 + i) * 4 + c: 8 pairs
  for (int q0 = threadIdx.x; q0 < units; q0 += kUnroll * blockDim.x) {
    Unit u[kUnroll];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) u[j] = load_unit(x, min(q0 + j * static_cast<int>(blockDim.x), units - 1));
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int q = q0 + j * static_cast<int>(blockDim.x);
      if (q < units) store_unit(xp, q, u[j]);
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
    float limit, int has_limit
#if W2_STREAM
    , const long long* __restrict__ stream_at  // [layers * E] arena row - slots (bytes), 0: not in the arena
#endif
    ) {
  extern __shared__ uint4 smem[];
  uint32_t* xp = reinterpret_cast<uint32_t*>(smem);  // [H / 2] activation pairs
#if W2_PDL
  asm volatile("griddepcontrol.launch_dependents;");
#endif
  const auto [b, row_tile] = block_tile<W2_ROUTE_MAJOR != 0>();  // w2_fragments.cuh
#if W2_EARLY
  // Round 1: the route words; `|` (not `||`) so that the exit reads all three and none is sunk below it.
#if W2_PAIR_ORDER
  // Pair order: block b is routed pair b, block_expert the router's topk ids [P], num_blocks the table's expert count
  // (an id outside it is no block; block_pairs unread).
  const int experts = *num_blocks, expert = block_expert[b], pair = b;
  if ((expert < 0) | (expert >= experts)) return;
#else
  const int route_blocks = *num_blocks, expert = block_expert[b], pair = block_pairs[b];
  if ((b >= route_blocks) | (expert < 0) | (pair < 0)) return;
#endif
  // Round 2: the expert's table words (a W2 route block's expert has a W2 slot: w2_slot < 0 does not occur).
  const int f4_slot = f4_table[table_row + expert], w2_slot = w2_table[table_row + expert];
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int n = row_tile * kRowsPerBlock + (threadIdx.x >> 5) * kRowsPerWarp + g;  // output row
  // While the table words are in flight: the lane's load addresses in slot 0 (its word vector c included, so the
  // loads below take lane index 0), for the slot's offset to be added once. The empty asm makes nvcc compute them
  // above the exit (it would sink them below it, after the table words arrive); it emits no instruction.
  const long long row_vecs = words_per_row / 4, scale_vecs = blocks_per_row / 16;
  const uint8_t* gate_at = slots + (words_off + 16 * (n * row_vecs + c));
  const uint8_t* up_at = gate_at + 16 * (inter * row_vecs);
  const uint8_t* gs_at = slots + (scales_off + 16 * (n * scale_vecs));
  const uint8_t* us_at = gs_at + 16 * (inter * scale_vecs);
  asm volatile("" ::"l"(gate_at), "l"(up_at), "l"(gs_at), "l"(us_at));
#if W2_STREAM
  // Streamed pair (W2_STREAM): an expert without a W2 slot is read where its row lies in the pinned arena, over the
  // bus (one more dependent load, for such pairs only); the same bytes as a slot, hence the same result.
  const long long streamed = w2_slot >= 0 ? 0 : stream_at[table_row + expert];
  if ((f4_slot >= 0) | ((w2_slot < 0) & (streamed == 0))) return;
  const long long slot_at = w2_slot >= 0 ? static_cast<long long>(w2_slot) * slot_bytes : streamed;
#if W2_STREAM_STAGE
  // the block's gate rows, its up rows, then both rows' scales: [2][32][row_vecs] then [2][32][scale_vecs] uint4
  const long long stage_words = kRowsPerBlock * row_vecs, stage_scales = kRowsPerBlock * scale_vecs;
  const bool staged = (w2_slot < 0) & (dynamic_shared_bytes() >= 2ull * hidden + 32ull * (stage_words + stage_scales));
#else
  constexpr bool staged = false;
#endif
#if W2_STREAM_PREFETCH
  if ((w2_slot < 0) & !staged) {  // the block's gate and up rows and their scales, all asked into L2 before the first tile load
    const long long first = static_cast<long long>(row_tile) * kRowsPerBlock;
    const uint8_t* words = slots + slot_at + words_off + 16 * (first * row_vecs);
    const uint8_t* scales = slots + slot_at + scales_off + 16 * (first * scale_vecs);
    prefetch_region_l2(words, 16 * kRowsPerBlock * row_vecs);
    prefetch_region_l2(words + 16 * (inter * row_vecs), 16 * kRowsPerBlock * row_vecs);
    prefetch_region_l2(scales, 16 * kRowsPerBlock * scale_vecs);
    prefetch_region_l2(scales + 16 * (inter * scale_vecs), 16 * kRowsPerBlock * scale_vecs);
  }
#endif
#else
  if ((f4_slot >= 0) | (w2_slot < 0)) return;
  const long long slot_at = static_cast<long long>(w2_slot) * slot_bytes;
#endif
  const uint4* gate = reinterpret_cast<const uint4*>(gate_at + slot_at);
  const uint4* up = reinterpret_cast<const uint4*>(up_at + slot_at);
  const uint4* gs = reinterpret_cast<const uint4*>(gs_at + slot_at);
  const uint4* us = reinterpret_cast<const uint4*>(us_at + slot_at);
  constexpr int load_c = 0;  // the loads' word vector index: c is in gate / up already
#else
  if (b >= *num_blocks) return;
  const int expert = block_expert[b];
  if (f4_table[table_row + expert] >= 0) return;
  const int pair = block_pairs[b];
  const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
  const int n = row_tile * kRowsPerBlock + (threadIdx.x >> 5) * kRowsPerWarp + g;  // output row

  const uint8_t* base = slots + static_cast<long long>(w2_table[table_row + expert]) * slot_bytes;
  const long long row_vecs = words_per_row / 4, scale_vecs = blocks_per_row / 16;
  const uint4* gate = reinterpret_cast<const uint4*>(base + words_off) + n * row_vecs;
  const uint4* up = gate + inter * row_vecs;
  const uint4* gs = reinterpret_cast<const uint4*>(base + scales_off) + n * scale_vecs;
  const uint4* us = gs + inter * scale_vecs;
  const int load_c = c;
#endif
  const int tiles = words_per_row / kWps;

  float acc[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#if W2_STREAM_STAGE
  if (staged) {  // a streamed block: its rows into shared memory in contiguous runs, the K loop from there
    uint4* stage = smem + hidden / 8;  // after xp [H / 2] words
    const uint8_t* row = slots + slot_at;
    const long long first = static_cast<long long>(row_tile) * kRowsPerBlock;
    stage_region(stage, row + words_off + 16 * (first * row_vecs), stage_words);
    stage_region(stage + stage_words, row + words_off + 16 * ((first + inter) * row_vecs), stage_words);
    stage_region(stage + 2 * stage_words, row + scales_off + 16 * (first * scale_vecs), stage_scales);
    stage_region(stage + 2 * stage_words + stage_scales, row + scales_off + 16 * ((first + inter) * scale_vecs),
                 stage_scales);
    commit_copies();
    build_pairs(x + (pair / top_k) * stride_x, xp, hidden);
    wait_copies<0>();
    __syncthreads();
    const long long local = n - first;  // the lane's row in the block
    const SharedTileRows<uint4> rows{{stage + local * row_vecs + c, stage + stage_words + local * row_vecs + c,
                                      stage + 2 * stage_words + local * scale_vecs,
                                      stage + 2 * stage_words + stage_scales + local * scale_vecs}};
    Tile ring[kAhead + 1];
    first_loads<kAhead>(rows, ring, tiles, 0);
    k_loop<kAhead, kPairWordsPerTile>(rows, ring, xp, tiles, 0, c, acc);
  } else
#endif
  {
    const Rows rows{gate, up, gs, us};
#if W2_STAGES
    uint4* warp_stages = smem + hidden / 8 + (threadIdx.x >> 5) * (W2_STAGES * kStageVecs);  // after xp [H / 2] words
    staged_first_loads<W2_STAGES>(rows, warp_stages, tiles, load_c, lane, g, c);
#else
    Tile ring[kAhead + 1];  // bf16_mma.cuh `k_loop`
    first_loads<kAhead>(rows, ring, tiles, load_c);
#endif
    build_pairs(x + (pair / top_k) * stride_x, xp, hidden);
    __syncthreads();
#if W2_STAGES
    staged_k_loop<W2_STAGES>(rows, warp_stages, xp, tiles, load_c, lane, g, c, acc);
#else
    k_loop<kAhead, kPairWordsPerTile>(rows, ring, xp, tiles, load_c, c, acc);
#endif
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
