// The pass's own fetch (config `gather_in_pass`): before a MoE layer's experts run, the pass itself maps the layer's
// missing experts that the arena holds into spare slots and copies their rows from pinned host memory over the bus
// (pinned memory is mapped under unified addressing: a row's host address is valid in a kernel). Two launches per
// layer on the compute stream, both capturable: `plan_pass_gather` (one block) decides, `gather_pass_rows` copies.
//
// Buffers (int32 unless said):
//   seen      [L * E]  the pass log's routed pairs per expert (this layer's recorded before the plan; later layers 0)
//   prev_seen [L * E]  the same of the pass before this one
//   w2_table  [L * E]  the base pool's slot table (rewritten here: victims unmapped, gathered experts mapped)
//   f4_table  [L * E]  the FP4 pool's (an expert resident there does not miss)
//   addresses [L * E]  int64: each expert's arena row as a host address, 0 when the arena does not hold it
//   state     [3]      (spares armed for this pass, cursor into them, rows the last plan gave the gather)
//   spares    [C, 2]   (slot, victim key id or -1 for a free slot), in the order the host would use them
//   gathered  [1 + 3C] count, then (key id, slot, victim) per gathered expert, in plan order
//   desc      [R, 2]   int64: (source host address, destination device address) of the layer's rows
//   rows      [1]      how many rows of desc the plan gave the gather: &state[2] when the copy follows the plan on
//                      one stream; a per-layer word (with a per-layer desc) when it runs on a side stream while
//                      later layers plan (config pass_pair), both in pinned host memory when the host issues the
//                      copies (pass_pair_copies "engine": written last, after a system-wide fence, so a host that
//                      sees it also sees desc)
//   done      [1]      engine copies: the layer's flag the replay waits for, set here when the plan took no row (the
//                      host sets it after the rows otherwise; an unarmed pair, e.g. a capture's warm-up, needs no
//                      host); null otherwise
//
// The host plans the spares while the pass before runs, so a victim's spare is used only while it still holds: the
// victim still maps to that slot, and neither that pass nor this one so far routed it (`prev_seen`, `seen`); others
// are skipped, never evicted. One of a later layer may be evicted and then routed there: that layer then misses it
// like any other expert. A free slot's spare is always taken (the host arms only slots no pass or install took since).
// The last MoE layer's plan disarms the spares (state[0] = 0), so a pass the host did not arm gathers nothing.
// Plain-torch reference: `plan_pass_gather_ref` (kernels/cuda/pass_gather.py).

#include <cstdint>

namespace {
constexpr int kPlanThreads = 1024;  // one thread per expert (E <= 1024) and per spare of the window
constexpr int kCopyThreads = 256;
#ifndef TS_COPY_UNROLL
#define TS_COPY_UNROLL 8  // loads in flight per thread; benchmarks/h2d_gather.py builds other values to compare
#endif
constexpr int kUnroll = TS_COPY_UNROLL;

// Exclusive rank of `flag` among the block's threads in thread order, and the block's count (in *total).
__device__ int block_rank(bool flag, int* warp_totals, int* total) {
  const unsigned ballot = __ballot_sync(0xffffffffu, flag);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) warp_totals[warp] = __popc(ballot);
  __syncthreads();
  int before = 0, sum = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) {
    const int count = warp_totals[w];
    before += w < warp ? count : 0;
    sum += count;
  }
  *total = sum;
  __syncthreads();  // the totals are read by every thread before the next call rewrites them
  return before + __popc(ballot & ((1u << lane) - 1u));
}
}  // namespace

extern "C" __global__ void __launch_bounds__(kPlanThreads) plan_pass_gather(
    const int* __restrict__ seen, const int* __restrict__ prev_seen, int* w2_table, const int* __restrict__ f4_table,
    const long long* __restrict__ addresses, int* state, const int* __restrict__ spares, int* gathered,
    unsigned long long* desc, int* rows, int* done, int layer, int num_experts, int num_layers,
    unsigned long long slot_base, long long slot_bytes) {
  __shared__ int warp_totals[32];
  __shared__ int take_slot[kPlanThreads];
  __shared__ int take_victim[kPlanThreads];
  __shared__ int next_cursor;
  const int t = threadIdx.x;
  const int armed = state[0], cursor = state[1], first_entry = gathered[0];
  // every read of the tables, the log and the state happens before the first barrier; every write after it
  const int key = layer * num_experts + t;
  long long source = 0;
  bool need = false;
  if (t < num_experts && cursor < armed) {
    source = addresses[key];
    need = seen[key] > 0 && w2_table[key] < 0 && f4_table[key] < 0 && source != 0;
  }
  const int spare = cursor + t;
  int slot = -1, victim = -1;
  if (spare < armed) {
    slot = spares[2 * spare];
    victim = spares[2 * spare + 1];
  }
  const bool eligible = spare < armed && (victim < 0 || (seen[victim] == 0 && prev_seen[victim] == 0 &&
                                                          w2_table[victim] == slot));
  if (t == 0) next_cursor = cursor;
  int needed, eligible_count;
  const int need_rank = block_rank(need, warp_totals, &needed);
  const int eligible_rank = block_rank(eligible, warp_totals, &eligible_count);
  const int take = min(needed, eligible_count);
  if (eligible && eligible_rank < take) {
    take_slot[eligible_rank] = slot;
    take_victim[eligible_rank] = victim;
    if (eligible_rank == take - 1) next_cursor = spare + 1;  // the spares before it are used or skipped
  }
  __syncthreads();
  if (need && need_rank < take) {
    const int to = take_slot[need_rank], from = take_victim[need_rank];
    if (from >= 0) w2_table[from] = -1;
    w2_table[key] = to;
    int* entry = gathered + 1 + 3 * (first_entry + need_rank);
    entry[0] = key;
    entry[1] = to;
    entry[2] = from;
    desc[2 * need_rank] = static_cast<unsigned long long>(source);
    desc[2 * need_rank + 1] = slot_base + static_cast<unsigned long long>(to) * slot_bytes;
    __threadfence_system();  // desc may be pinned host memory the host reads once it sees *rows (engine copies)
  }
  __syncthreads();
  if (t == 0) {
    gathered[0] = first_entry + take;
    state[1] = next_cursor;
    *rows = take;
    if (done != nullptr && take == 0) *done = 1;  // engine copies: nothing for the host to copy, the layer is done
    if (layer == num_layers - 1) state[0] = 0;  // one pass per arming
  }
}

// The copy loop of both row kernels: this thread's share of `words` 16-byte words from `src` to `dst`, every
// `step`-th word from `first` on, kUnroll loads in flight before their stores. No shared memory, no atomics.
__device__ __forceinline__ void copy_words(const uint4* src, uint4* dst, long long words, long long first,
                                           long long step) {
  for (long long base = first; base < words; base += step * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const long long i = base + u * step;
      if (i < words) v[u] = src[i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const long long i = base + u * step;
      if (i < words) dst[i] = v[u];
    }
  }
}

// Grid: a fixed number of blocks, whatever the plan gave: every working block copies its share of each row (runs of
// kCopyThreads words, every blocks-th), so one row or ten keep every block reading; a plan of no rows exits at once.
// `active` (null: the whole grid): how many of the grid's blocks work, 1 to gridDim.x, a device word the host sets
// between launches of a captured graph (the pass pair's copy grid, config pass_pair_wide_blocks); the rest exit.
extern "C" __global__ void __launch_bounds__(kCopyThreads) gather_pass_rows(
    const int* __restrict__ rows, const unsigned long long* __restrict__ desc, long long row_bytes,
    const int* __restrict__ active) {
  const int grid = static_cast<int>(gridDim.x);
  const int blocks = active == nullptr ? grid : max(1, min(*active, grid));
  if (static_cast<int>(blockIdx.x) >= blocks) return;
  const int count = *rows;
  for (int r = 0; r < count; ++r) {
    copy_words(reinterpret_cast<const uint4*>(desc[2 * r]), reinterpret_cast<uint4*>(desc[2 * r + 1]), row_bytes / 16,
               static_cast<long long>(blockIdx.x) * kCopyThreads + threadIdx.x,
               static_cast<long long>(blocks) * kCopyThreads);
  }
}

// `benchmarks/h2d_gather.py`'s kernel (not the runtime's): descriptors of three 64-bit words per row (source host
// address, destination device address, bytes a multiple of 16), themselves in mapped pinned memory; grid (blocks per
// row, rows), block (x, r) copying its share of row r.
extern "C" __global__ void __launch_bounds__(kCopyThreads) gather_rows(const unsigned long long* __restrict__ desc) {
  const unsigned long long* d = desc + 3 * blockIdx.y;
  copy_words(reinterpret_cast<const uint4*>(d[0]), reinterpret_cast<uint4*>(d[1]), static_cast<long long>(d[2] / 16),
             static_cast<long long>(blockIdx.x) * kCopyThreads + threadIdx.x,
             static_cast<long long>(gridDim.x) * kCopyThreads);
}
