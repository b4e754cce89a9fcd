"""The confidence gate's signal of logits rows on the device: `confidence` (two Triton launches, each row split over
up to MAX_CHUNKS programs) and its plain-torch reference `confidence_ref`.

max_prob = 1 / sum_i exp(x_i - max) (the top-1 softmax probability), margin = top1 - top2 (topk semantics: a tied
top-1 gives 0). fp32 / bf16 / fp16 logits, float32 arithmetic. NaN: a row holding a NaN gives NaN (as
softmax().amax() and topk do), and the min over rows is NaN when any row is. Capture-safe: no host sync; its
outputs and scratch come from torch's allocator (a captured graph's pool when captured).
"""

from __future__ import annotations

import torch
import triton

from ._triton.confidence import chunk_stats_kernel, combine_kernel

MAX_CHUNKS = 64  # programs per row (the vocab splits into at most this many chunks)
MIN_BLOCK = 256
MAX_BLOCK = 16384  # columns per program; longer rows: `supported` is False
_COMBINE_TILE = 2048  # rows x chunks per step of the combine program
SIGNALS = ("max_prob", "margin")


def supported(logits: torch.Tensor) -> bool:
    """Whether `confidence` takes these logits [R, V] (or [V]): fp32/bf16/fp16, rows of at most
    MAX_CHUNKS * MAX_BLOCK, unit column stride."""
    return (logits.dtype in (torch.float32, torch.bfloat16, torch.float16) and logits.dim() >= 1
            and logits.numel() > 0 and logits.shape[-1] <= MAX_CHUNKS * MAX_BLOCK and logits.stride(-1) == 1)


def _rows(logits: torch.Tensor) -> torch.Tensor:
    return logits.reshape(-1, logits.shape[-1]) if logits.dim() != 2 else logits  # [R, V] (a view where possible)


def confidence(logits: torch.Tensor, signal: str, reduce_min: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [1]: the min over rows of each row's signal (reduce_min), else float32 [R]: the row signals.
    out: float32 [R + 1] to write (row signals, then their min; the min only with reduce_min), else a new one."""
    if signal not in SIGNALS:
        raise ValueError(f"signal must be one of {SIGNALS}, got {signal!r}")
    if not supported(logits):
        raise ValueError(f"unsupported logits {logits.dtype} {tuple(logits.shape)} strides {logits.stride()}")
    rows = _rows(logits)  # [R, V]
    num_rows, vocab = rows.shape
    block = min(MAX_BLOCK, max(MIN_BLOCK, triton.next_power_of_2(triton.cdiv(vocab, MAX_CHUNKS))))
    chunks = triton.cdiv(vocab, block)
    stats = torch.empty(2, num_rows, chunks, dtype=torch.float32, device=rows.device)  # (m | top1, s | top2) [R, NC]
    if out is None:
        out = torch.empty(num_rows + 1, dtype=torch.float32, device=rows.device)  # row signals [R], then their min
    elif out.shape != (num_rows + 1,) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be contiguous float32 [{num_rows + 1}], got {out.dtype} {tuple(out.shape)}")
    margin = signal == "margin"
    chunk_stats_kernel[(num_rows, chunks)](rows, rows.stride(0), vocab, stats, chunks, num_rows, MARGIN=margin,
                                           BLOCK=block, num_warps=4 if block <= 2048 else 8)
    ncp = triton.next_power_of_2(chunks)
    rb = min(triton.next_power_of_2(num_rows), max(1, _COMBINE_TILE // ncp))
    combine_kernel[(1,)](stats, chunks, num_rows, out, out[num_rows:], MARGIN=margin, MIN=reduce_min, NCP=ncp, RB=rb,
                         num_warps=4)
    return out[num_rows:] if reduce_min else out[:num_rows]


def confidence_ref(logits: torch.Tensor, signal: str, reduce_min: bool) -> torch.Tensor:
    """Plain torch, the same definition (max_prob summed in torch's order, so within rounding of `confidence`)."""
    rows = _rows(logits).float()  # [R, V]
    if signal == "max_prob":
        signals = 1.0 / torch.exp(rows - rows.amax(dim=-1, keepdim=True)).sum(dim=-1)
    else:
        top2 = rows.topk(2, dim=-1).values  # [R, 2]
        signals = top2[:, 0] - top2[:, 1]
    return signals.min().reshape(1) if reduce_min else signals
