"""Routing kernel: resolves each routed pair's tier, groups pairs by expert into blocks, logs misses.

One program. Pairs (p = token * top_k + j) of a resident expert are placed, in increasing p,
into blocks of BT pairs that all use that expert; experts appear in increasing id. A pair
whose expert is in neither pool gets no block; it adds one to `miss_counts[0]`, and each such
expert adds one to `miss_counts[1]` and appends (layer, expert) to `miss_list` while it has room
(entries past `miss_capacity` are counted, not written). STREAM (the CUDA stream builds' route, W2_STREAM): an
expert in neither pool whose `stream_at` word is nonzero is streamed, computed from its arena row: its pairs get
blocks and add nothing to `miss_counts[0]`, while the expert is still counted and logged like a missing one (the
host installs it after the pass). The pairs per expert are integer counts (a comparison
sum or `tl.histogram`), exact in any order, and everything else is plain loads/stores, so the block lists are
deterministic. Plain-Python reference: `moe_route_ref` (kernels/moe_mm.py).
"""

import triton
import triton.language as tl


@triton.jit
def route_kernel(
    topk_ids_ptr, num_pairs,
    w2_table_ptr, f4_table_ptr, layer, num_experts,
    block_expert_ptr, block_fill_ptr, block_pairs_ptr, num_blocks_ptr,
    miss_counts_ptr, miss_list_ptr, miss_capacity, stream_at_ptr,
    EP: tl.constexpr, CHUNK: tl.constexpr, BT: tl.constexpr, HISTOGRAM: tl.constexpr, STREAM: tl.constexpr,
):
    """Per expert (EP lanes): pairs routed to it, residency, first block, missing; per pair (CHUNK lanes at a
    time): its expert's numbers looked up with `tl.gather` and its rank among the earlier pairs of that expert.
    HISTOGRAM: count the pairs per expert with `tl.histogram` instead of a [CHUNK, EP] comparison."""
    experts = tl.arange(0, EP)
    lanes = tl.arange(0, CHUNK)
    real = experts < num_experts
    table_row = layer * num_experts
    # the tables do not depend on the ids: their loads go out first, beside the first chunk's
    in_w2 = tl.load(w2_table_ptr + table_row + experts, mask=real, other=-1) >= 0
    in_f4 = tl.load(f4_table_ptr + table_row + experts, mask=real, other=-1) >= 0
    if STREAM:
        streamed = tl.load(stream_at_ptr + table_row + experts, mask=real, other=0) != 0
    else:
        streamed = experts < 0  # [EP] all false

    counts = tl.zeros([EP], tl.int32)  # [EP] pairs routed to each expert id below EP
    for c0 in range(0, num_pairs, CHUNK):
        ids = tl.load(topk_ids_ptr + c0 + lanes, mask=c0 + lanes < num_pairs, other=-1)  # [CHUNK]
        counts += _count(ids, experts, EP, HISTOGRAM)

    pooled = in_w2 | in_f4  # [EP]
    resident = (pooled | streamed).to(tl.int32)  # [EP] computed in this pass
    blocks = resident * ((counts + BT - 1) // BT)
    block_start = tl.cumsum(blocks, axis=0) - blocks
    tl.store(num_blocks_ptr, tl.sum(blocks, axis=0))

    missing = ((counts > 0) & (pooled == 0)).to(tl.int32)  # [EP] logged: missing or streamed
    num_missing = tl.sum(missing, axis=0)
    if num_missing > 0:  # the usual decode step has none: no atomics, no round trip for `first`
        tl.atomic_add(miss_counts_ptr, tl.sum(missing * (1 - resident) * counts, axis=0))
        first = tl.atomic_add(miss_counts_ptr + 1, num_missing)
        entry = first + tl.cumsum(missing, axis=0) - missing
        logged = (missing == 1) & (entry < miss_capacity)
        tl.store(miss_list_ptr + 2 * entry, layer + 0 * experts, mask=logged)
        tl.store(miss_list_ptr + 2 * entry + 1, experts, mask=logged)

    seen = tl.zeros([EP], tl.int32)  # pairs of each expert in earlier chunks
    for c0 in range(0, num_pairs, CHUNK):
        pairs = c0 + lanes
        valid = pairs < num_pairs
        ids = tl.load(topk_ids_ptr + pairs, mask=valid, other=-1)  # [CHUNK]
        in_range = valid & (ids >= 0) & (ids < EP)
        index = tl.where(in_range, ids, 0)
        earlier = (ids[:, None] == ids[None, :]) & (lanes[None, :] < lanes[:, None])  # [CHUNK, CHUNK]
        rank = tl.gather(seen, index, 0) + tl.sum(earlier.to(tl.int32), axis=1)
        placed = in_range & (tl.gather(resident, index, 0) > 0)
        block = tl.gather(block_start, index, 0) + rank // BT
        tl.store(block_pairs_ptr + block * BT + rank % BT, pairs, mask=placed)
        leads = placed & (rank % BT == 0)
        tl.store(block_expert_ptr + block, ids, mask=leads)
        tl.store(block_fill_ptr + block, tl.minimum(tl.gather(counts, index, 0) - rank, BT), mask=leads)
        if c0 + CHUNK < num_pairs:
            seen += _count(ids, experts, EP, HISTOGRAM)


@triton.jit
def _count(ids, experts, EP: tl.constexpr, HISTOGRAM: tl.constexpr):
    """[EP] how many of `ids` (-1: no pair) equal each expert id below EP."""
    if HISTOGRAM:
        in_range = (ids >= 0) & (ids < EP)
        return tl.histogram(tl.where(in_range, ids, 0), EP, mask=in_range)
    else:
        return tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)
