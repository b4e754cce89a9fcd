"""The routing kernel as it was before 2026-11-30's seventh session (kernels/_triton/route.py at 561f686), kept as
route_cost.py's baseline: per chunk of pairs it looks each pair's expert numbers up by a [CHUNK, EP] comparison and
sum, and takes the miss log's atomics on every launch. Same arguments and outputs as the current `route_kernel`
without HISTOGRAM."""

import triton
import triton.language as tl


@triton.jit
def route_v1_kernel(
    topk_ids_ptr, num_pairs,
    w2_table_ptr, f4_table_ptr, layer, num_experts,
    block_expert_ptr, block_fill_ptr, block_pairs_ptr, num_blocks_ptr,
    miss_counts_ptr, miss_list_ptr, miss_capacity,
    EP: tl.constexpr, CHUNK: tl.constexpr, BT: tl.constexpr,
):
    experts = tl.arange(0, EP)
    lanes = tl.arange(0, CHUNK)
    real = experts < num_experts
    table_row = layer * num_experts

    counts = tl.zeros([EP], tl.int32)
    for c0 in range(0, num_pairs, CHUNK):
        ids = tl.load(topk_ids_ptr + c0 + lanes, mask=c0 + lanes < num_pairs, other=-1)  # [CHUNK]
        counts += tl.sum((ids[:, None] == experts[None, :]).to(tl.int32), axis=0)

    in_w2 = tl.load(w2_table_ptr + table_row + experts, mask=real, other=-1) >= 0
    in_f4 = tl.load(f4_table_ptr + table_row + experts, mask=real, other=-1) >= 0
    resident = (in_w2 | in_f4).to(tl.int32)  # [EP]
    blocks = resident * ((counts + BT - 1) // BT)
    block_start = tl.cumsum(blocks, axis=0) - blocks
    tl.store(num_blocks_ptr, tl.sum(blocks, axis=0))

    missing = ((counts > 0) & (resident == 0)).to(tl.int32)
    num_missing = tl.sum(missing, axis=0)
    tl.atomic_add(miss_counts_ptr, tl.sum(missing * counts, axis=0))
    first = tl.atomic_add(miss_counts_ptr + 1, num_missing)
    entry = first + tl.cumsum(missing, axis=0) - missing
    logged = (missing == 1) & (entry < miss_capacity)
    tl.store(miss_list_ptr + 2 * entry, layer + 0 * experts, mask=logged)
    tl.store(miss_list_ptr + 2 * entry + 1, experts, mask=logged)

    seen = tl.zeros([EP], tl.int32)  # pairs of each expert already placed
    for c0 in range(0, num_pairs, CHUNK):
        pairs = c0 + lanes
        valid = pairs < num_pairs
        ids = tl.load(topk_ids_ptr + pairs, mask=valid, other=-1)  # [CHUNK]
        onehot = (ids[:, None] == experts[None, :]).to(tl.int32)  # [CHUNK, EP]
        earlier = (ids[:, None] == ids[None, :]) & (lanes[None, :] < lanes[:, None])  # [CHUNK, CHUNK]
        rank = tl.sum(onehot * seen[None, :], axis=1) + tl.sum(earlier.to(tl.int32), axis=1)
        start = tl.sum(onehot * block_start[None, :], axis=1)
        total = tl.sum(onehot * counts[None, :], axis=1)
        placed = valid & (tl.sum(onehot * resident[None, :], axis=1) > 0)
        block = start + rank // BT
        tl.store(block_pairs_ptr + block * BT + rank % BT, pairs, mask=placed)
        leads = placed & (rank % BT == 0)
        tl.store(block_expert_ptr + block, ids, mask=leads)
        tl.store(block_fill_ptr + block, tl.minimum(total - rank, BT), mask=leads)
        seen += tl.sum(onehot, axis=0)
