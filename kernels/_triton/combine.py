"""Weighted combine over the top-k in a fixed order: out[t] = sum_j w[t, j] * y[t * k + j].

A pair whose expert is in neither pool contributes exactly zero (its y row is never read), unless STREAM and its
expert's `stream_at` word is nonzero (computed from its arena row: the route's STREAM).
Grid (token, h-tile); fp32 accumulation in the order j = 0, 1, ..., k-1.
"""

import triton
import triton.language as tl


@triton.jit
def combine_kernel(
    y_ptr, stride_y, topk_ids_ptr, topk_weights_ptr, w2_table_ptr, f4_table_ptr, table_row,
    out_ptr, stride_out, H, stream_at_ptr,
    TOP_K: tl.constexpr, BH: tl.constexpr, STREAM: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    h_ok = h < H
    acc = tl.zeros([BH], tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * TOP_K + j
        expert = tl.load(topk_ids_ptr + pair)
        resident = (tl.load(w2_table_ptr + table_row + expert) >= 0) | (tl.load(f4_table_ptr + table_row + expert) >= 0)
        if STREAM:
            resident = resident | (tl.load(stream_at_ptr + table_row + expert) != 0)
        weight = tl.load(topk_weights_ptr + pair).to(tl.float32)
        read = h_ok & (tl.zeros([BH], tl.int32) + resident.to(tl.int32) > 0)
        y = tl.load(y_ptr + pair.to(tl.int64) * stride_y + h, mask=read, other=0.0)
        acc += tl.where(resident, weight * y, 0.0)
    tl.store(out_ptr + t.to(tl.int64) * stride_out + h, acc.to(out_ptr.dtype.element_ty), mask=h_ok)
