"""Confidence signal of logits rows [R, V] in two launches, for one or few rows of a large vocabulary.

`chunk_stats_kernel`, grid (R, NC): program (r, c) reads columns [c * BLOCK, (c + 1) * BLOCK) of row r once and
writes its chunk's statistics: MARGIN False: (m_c = max, s_c = sum exp(x - m_c)); MARGIN True: (top1_c, top2_c),
top2_c = top1_c when top1_c occurs twice in the chunk, top1_c = NaN when the chunk holds a NaN.
`combine_kernel`, one program: per row, over the chunks in the fixed order c = 0 .. NC-1, max_prob =
1 / sum_c s_c * exp(m_c - M) (M = max_c m_c: the top-1 softmax probability) or margin = top1 - top2; writes the row
signals [R] and, with MIN, their min [1] (NaN when any row is NaN, as torch.min). No atomics: repeated launches
give identical bytes. Every value is float32 whatever the logits' dtype.
"""

import triton
import triton.language as tl


@triton.jit
def chunk_stats_kernel(x_ptr, stride_row, V, stats_ptr, NC, R, MARGIN: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    valid = cols < V
    x = tl.load(x_ptr + r.to(tl.int64) * stride_row + cols, mask=valid, other=float("-inf")).to(tl.float32)  # [BLOCK]
    top1 = tl.max(x, axis=0)
    if MARGIN:
        ties = tl.sum(((x == top1) & valid).to(tl.int32), axis=0)
        rest = tl.max(tl.where(x == top1, float("-inf"), x), axis=0)
        top2 = tl.where(ties >= 2, top1, rest)
        has_nan = tl.max((x != x).to(tl.int32), axis=0) > 0
        first = tl.where(has_nan, float("nan"), top1)
        second = top2
    else:
        # -inf entries contribute 0 even when the whole chunk is -inf (no -inf - -inf); NaN and +inf stay NaN
        shifted = tl.where(x == float("-inf"), float("-inf"), x - top1)
        first = top1
        second = tl.sum(tl.exp(shifted), axis=0)
    tl.store(stats_ptr + r * NC + c, first)
    tl.store(stats_ptr + (R + r) * NC + c, second)


@triton.jit
def combine_kernel(stats_ptr, NC, R, rows_ptr, min_ptr, MARGIN: tl.constexpr, MIN: tl.constexpr,
                   NCP: tl.constexpr, RB: tl.constexpr):
    chunks = tl.arange(0, NCP)
    lanes = tl.arange(0, RB)
    low = tl.zeros([RB], tl.float32) + float("inf")  # running min of the non-NaN rows, per lane
    nan_seen = tl.zeros([RB], tl.int32)
    for r0 in range(0, R, RB):
        rows = r0 + lanes
        row_ok = rows < R
        ok = row_ok[:, None] & (chunks[None, :] < NC)  # [RB, NCP]
        offs = rows[:, None] * NC + chunks[None, :]
        first = tl.load(stats_ptr + offs, mask=ok, other=float("-inf"))  # [RB, NCP]
        second = tl.load(stats_ptr + R * NC + offs, mask=ok, other=0.0)
        if MARGIN:
            top1 = tl.max(first, axis=1)  # [RB]
            ties = tl.sum(((first == top1[:, None]) & ok).to(tl.int32), axis=1)
            rest = tl.max(tl.where(ok, tl.where(first == top1[:, None], second, first), float("-inf")), axis=1)
            top2 = tl.where(ties >= 2, top1, rest)
            has_nan = tl.max((first != first).to(tl.int32), axis=1) > 0
            sig = tl.where(has_nan, float("nan"), top1 - top2)
        else:
            top = tl.max(first, axis=1)  # [RB]
            total = tl.sum(second * tl.exp(first - top[:, None]), axis=1)  # padding: 0 * exp(-inf - top)
            sig = 1.0 / total
        tl.store(rows_ptr + rows, sig, mask=row_ok)
        if MIN:
            low = tl.minimum(low, tl.where(row_ok & (sig == sig), sig, float("inf")))
            nan_seen = nan_seen | (row_ok & (sig != sig)).to(tl.int32)
    if MIN:
        tl.store(min_ptr, tl.where(tl.max(nan_seen, axis=0) > 0, float("nan"), tl.min(low, axis=0)))
