"""Fused tiered MoE: routed experts read from an FP4 pool, else a W2 pool, else logged as misses.

    out[t] = sum_j w[t, j] * W2_e(SwiGLU(W13_e x[t]))   for e = topk_ids[t, j] resident

Launch sequence (all shapes static, all buffers preallocated: capture-safe, no host sync):
route (tiers, expert blocks, miss log) -> gate_up GEMM + SwiGLU -> down GEMM -> fixed-order
combine. No atomics touch numbers, so repeated launches give identical bytes, and a pair's result
does not depend on which other pairs share its batch. `moe_mm_ref` is the plain-torch reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from ._triton.combine import combine_kernel
from ._triton.gemm import moe_gemm_kernel
from ._triton.route import route_kernel
from .layout import SlotLayout, fp4_slot_layout, unpack_matrix_ref, w2_slot_layout

_ROUTE_CHUNK = 32
_ROUTE_HISTOGRAM = True  # count pairs per expert by tl.histogram instead of a comparison (kernel-notes.md, "The routing kernel")
_COMBINE_BH = 256


@dataclass(frozen=True)
class TierPool:
    """One tier on the device: slot bytes uint8 [S, slot_bytes] and its table int32 [layers, E] (-1 = absent).

    stream_at (W2 tier, optional): int64 [layers * E], each expert's row in pinned host memory as an offset from
    `slots`' address (0: none), read by passes that stream (`moe_mm`: its Triton stages with `stream`, or a
    `cuda_w2` whose `streams(workspace)` is true, the W2_STREAM builds) for pairs without a slot;
    `tierstore.runtime.stream_rows` keeps it."""

    slots: torch.Tensor
    table: torch.Tensor
    layout: SlotLayout
    stream_at: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.slots.dtype != torch.uint8 or self.slots.dim() != 2 or self.slots.shape[1] != self.layout.slot_bytes:
            raise ValueError(f"slots must be uint8 [S, {self.layout.slot_bytes}], got {self.slots.dtype} {tuple(self.slots.shape)}")
        if self.table.dtype != torch.int32 or self.table.dim() != 2:
            raise ValueError(f"table must be int32 [layers, E], got {self.table.dtype} {tuple(self.table.shape)}")
        at = self.stream_at
        if at is not None and (at.dtype != torch.int64 or at.shape != (self.table.numel(),)
                               or at.device != self.table.device):
            raise ValueError(f"stream_at must be int64 [{self.table.numel()}] on {self.table.device}, got "
                             f"{at.dtype} {tuple(at.shape)} on {at.device}")

    @classmethod
    def empty(cls, layout: SlotLayout, num_slots: int, layers: int, experts: int, device) -> TierPool:
        slots = torch.zeros(max(num_slots, 1), layout.slot_bytes, dtype=torch.uint8, device=device)
        table = torch.full((layers, experts), -1, dtype=torch.int32, device=device)
        return cls(slots, table, layout)


@dataclass(frozen=True)
class MissLog:
    """counts int32 [2] = (missing pairs, missing experts incl. overflow); entries int32 [capacity, 2] = (layer, expert)."""

    counts: torch.Tensor
    entries: torch.Tensor

    @classmethod
    def allocate(cls, capacity: int, device) -> MissLog:
        return cls(torch.zeros(2, dtype=torch.int32, device=device), torch.full((capacity, 2), -1, dtype=torch.int32, device=device))

    def reset(self) -> None:
        self.counts.zero_()


BT1_MAX_PAIRS_PER_EXPERT = 4  # default_block_tokens: one pair per program up to this many pairs per expert


def default_block_tokens(pairs: int, num_experts: int) -> int:
    """The route block size `MoeWorkspace.allocate` picks for `pairs` routed pairs: 1 (one pair per program) up to
    BT1_MAX_PAIRS_PER_EXPERT pairs per expert on average, then 16 up to 16 per expert, then 64.

    Whole op on the H200, one pair per program against the tensor-core blocks, us (the one-pair times from
    benchmarks/cuda_w2.py's and cuda_fp4.py's Triton rows, the block times from moe_kernels.py's default rows of
    54fb697: separate runs, bf16 within 10 %): 1.33 - 2 pairs per expert: deepseek-v3 T = 64 W2 3120.1 vs 7836.8,
    FP4 4903.8 vs 9644.5, kimi-k2 T = 64 3148.6 vs 9985.9, ds4-flash T = 64 1386.0 vs 4308.0, mixtral-8x7b T = 8
    408.9 vs 1108.8; 4: olmoe-1b-7b T = 32 268.4 vs 408.5; 8 and more: olmoe-1b-7b T = 64 517.1 vs 430.2,
    mixtral-8x7b T = 32 1497.0 vs 1236.2, deepseek-v3 T = 512 24259.2 vs 13261.8. Until 2026-11-30 the switch sat at
    1 pair per expert (kernel-notes.md, measured at T = 32 / 64 on DeepSeek-V3 with the kernels of then)."""
    if pairs <= BT1_MAX_PAIRS_PER_EXPERT * num_experts:
        return 1
    return 16 if pairs <= 16 * num_experts else 64


@dataclass(frozen=True)
class MoeWorkspace:
    """Scratch for one static batch size: expert blocks, activations [P, I], per-pair outputs [P, H] fp32."""

    block_tokens: int
    block_n: int  # weight rows per program
    num_warps: int
    block_expert: torch.Tensor  # [max_blocks] int32
    block_fill: torch.Tensor  # [max_blocks] int32
    block_pairs: torch.Tensor  # [max_blocks * BT] int32
    num_blocks: torch.Tensor  # [1] int32
    act: torch.Tensor  # [P, I] activation dtype
    y: torch.Tensor  # [P, H] float32
    ptx_w2: bool = True  # BT = 1 W2 with bf16 on CUDA: inline-PTX bf16x2 decode + FMA (else the plain-Triton path)
    # BT = 1 FP4 decode: "ptx" (default, v8) = e2m1 -> bf16x2 by integer bit construction, inline PTX with
    # bf16 on CUDA, else its plain-Triton twin; "triton" = the twin everywhere; "off" = the nibble ->
    # float16 decode. All three decode every scale byte the layout admits exactly (kernel-notes v8).
    # BT = 16 / 64 programs keep their own FP4 decode.
    fp4_bf16x2: str = "ptx"
    # The down GEMM's launch: rows per program and warps (chosen in `allocate`; gate_up uses block_n / num_warps).
    down_block_n: int = 64
    down_num_warps: int = 8
    # [1] int32, the tables' expert count (the pair-order CUDA kernels' bound on an id), and on CUDA a stream of the
    # workspace's own on which `moe_mm` routes beside a route-free `cuda_w2` (created here, never during a capture),
    # with the two events that fork the route onto it and join it back (reused by every call: no event per call)
    experts: torch.Tensor | None = None
    side_stream: object = None
    route_events: tuple | None = None

    @classmethod
    def allocate(cls, num_tokens: int, top_k: int, num_experts: int, hidden: int, inter: int, dtype, device,
                 block_tokens: int | None = None, block_n: int = 64, num_warps: int | None = None,
                 ptx_w2: bool = True, fp4_bf16x2: str = "ptx", down_block_n: int | None = None,
                 down_num_warps: int | None = None) -> MoeWorkspace:
        """block_tokens: 1 = one pair per program on CUDA-core FMAs (decode); 16 or 64 = tensor-core blocks.
        Default: `default_block_tokens`. down_block_n / down_num_warps: the down launch (None: the rule below).
        """
        pairs = num_tokens * top_k
        if block_tokens is None:
            block_tokens = default_block_tokens(pairs, num_experts)
        if num_warps is None:
            num_warps = 8 if block_tokens == 1 else 4  # best measured per path (benchmarks/kernel-notes.md)
        if block_tokens not in (1, 16, 32, 64):
            raise ValueError(f"block_tokens must be 1, 16, 32 or 64, got {block_tokens}")
        if fp4_bf16x2 not in ("off", "ptx", "triton"):
            raise ValueError(f"fp4_bf16x2 must be 'off', 'ptx' or 'triton', got {fp4_bf16x2!r}")
        # Down launch (kernel-notes v9; kernels-deepseek-v3-v9-down.json, H200): at BT = 1 from 64 pairs up
        # (DeepSeek-V3 T >= 8) 32 rows / 4 warps per program: 80 registers, 6 CTAs = 24 warps per SM against 2 CTAs /
        # 16 warps at 64 rows / 8 warps, so more weight bytes in flight; the whole op measured 3.2 % / 4.5 % faster
        # at T = 8 / 32 (FP4 2.7 % / 3.2 %), but not at T = 1 (8 pairs: 74.0 vs 73.2 us, the down launch alone
        # 25.9 vs 25.8), so below 64 pairs, and at BT = 16 / 64 (not measured), down runs the gate_up's launch.
        # Same operations in the same order and the same per-row reduction (2 rows per thread in both launches),
        # so the output bytes do not depend on this choice (H200 check and tests/test_kernels_moe.py).
        # Not measured: 9..63 pairs, and other presets (Qwen3-30B-A3B reaches 64 pairs at T = 8 too).
        wide = block_tokens == 1 and pairs >= 64
        if down_block_n is None:
            down_block_n = 32 if wide else block_n
        if down_num_warps is None:
            down_num_warps = 4 if wide else num_warps
        max_blocks = min(num_experts, pairs) + triton.cdiv(pairs, block_tokens)
        i32 = dict(dtype=torch.int32, device=device)
        return cls(
            block_tokens=block_tokens,
            block_n=block_n,
            num_warps=num_warps,
            block_expert=torch.zeros(max_blocks, **i32),
            block_fill=torch.zeros(max_blocks, **i32),
            block_pairs=torch.zeros(max_blocks * block_tokens, **i32),
            num_blocks=torch.zeros(1, **i32),
            act=torch.empty(pairs, inter, dtype=dtype, device=device),
            y=torch.empty(pairs, hidden, dtype=torch.float32, device=device),
            ptx_w2=ptx_w2,
            fp4_bf16x2=fp4_bf16x2,
            down_block_n=down_block_n,
            down_num_warps=down_num_warps,
            experts=torch.full((1,), num_experts, **i32),
            side_stream=torch.cuda.Stream(device) if torch.device(device).type == "cuda" else None,
            route_events=(torch.cuda.Event(), torch.cuda.Event()) if torch.device(device).type == "cuda" else None,
        )


def _fp4_mode(ws: MoeWorkspace, a: torch.Tensor) -> int:
    """moe_gemm_kernel's FP4_MODE: 0 = default decode, 1 = bf16x2 construction (plain twin), 2 = inline PTX."""
    if ws.fp4_bf16x2 == "off":
        return 0
    return 2 if ws.fp4_bf16x2 == "ptx" and a.is_cuda and a.dtype == torch.bfloat16 else 1


def _gemm(a, out, w2: TierPool, fp4: TierPool, which: str, table_row: int, ws: MoeWorkspace, n_out: int, k: int,
          top_k: int, gated: bool, limit: float | None, rows_are_tokens: bool, stream: bool = False) -> None:
    """One GEMM launch: which = "w13" (gate_up, gated) or "w2" (down, with the workspace's down launch); `stream`:
    blocks of experts without a W2 slot read their `w2.stream_at` rows."""
    down = which == "w2"
    block_n = ws.down_block_n if down else ws.block_n
    num_warps = ws.down_num_warps if down else ws.num_warps
    m2 = w2.layout.w13 if which == "w13" else w2.layout.w2
    m4 = fp4.layout.w13 if which == "w13" else fp4.layout.w2
    def offsets(layout: SlotLayout):
        if which == "w13":
            return layout.w13_words_offset, layout.w13_scales_offset
        return layout.w2_words_offset, layout.w2_scales_offset
    w2_words_off, w2_scales_off = offsets(w2.layout)
    f4_words_off, f4_scales_off = offsets(fp4.layout)
    grid = (ws.block_expert.numel(), triton.cdiv(n_out, block_n))
    moe_gemm_kernel[grid](
        a, a.stride(0), out, out.stride(0),
        w2.slots.view(torch.int32), w2.slots, w2.layout.slot_bytes, w2_words_off, w2_scales_off,
        m2.words_per_row, m2.blocks_per_row,
        fp4.slots.view(torch.int32), fp4.slots, fp4.layout.slot_bytes, f4_words_off, f4_scales_off,
        m4.words_per_row, m4.blocks_per_row,
        w2.table, fp4.table, table_row, _stream_words(w2, stream),
        ws.block_expert, ws.block_fill, ws.block_pairs, ws.num_blocks,
        n_out, k, top_k, 0.0 if limit is None else float(limit),
        GATED=gated, HAS_LIMIT=limit is not None, ROWS_ARE_TOKENS=rows_are_tokens,
        W2_WPS=m2.wps, F4_WPS=m4.wps, BN=block_n, BT=ws.block_tokens,
        PRECISION="ieee" if a.dtype == torch.float32 else None,
        PTX_W2=ws.ptx_w2 and a.is_cuda and a.dtype == torch.bfloat16,
        FP4_MODE=_fp4_mode(ws, a), STREAM=stream,
        num_warps=num_warps,
    )


def _check(hidden, topk_ids, w2: TierPool, fp4: TierPool, workspace: MoeWorkspace) -> None:
    h = hidden.shape[1]
    inter = w2.layout.inter
    if w2.layout.hidden != h or fp4.layout.hidden != h or fp4.layout.inter != inter:
        raise ValueError(f"pool geometry (H={w2.layout.hidden}/{fp4.layout.hidden}, I={inter}/{fp4.layout.inter}) "
                         f"does not match hidden [T, {h}]")
    pairs = topk_ids.numel()
    if workspace.act.shape != (pairs, inter) or workspace.act.dtype != hidden.dtype:
        raise ValueError(f"workspace was sized for {tuple(workspace.act.shape)} {workspace.act.dtype}, "
                         f"need ({pairs}, {inter}) {hidden.dtype}")
    if not (hidden.is_contiguous() and topk_ids.is_contiguous()):
        raise ValueError("hidden and topk_ids must be contiguous")


def moe_route(topk_ids: torch.Tensor, w2: TierPool, fp4: TierPool, layer: int, misses: MissLog, workspace: MoeWorkspace,
              stream: bool = False) -> None:
    """Stage 1: tiers, expert blocks and the miss log for this layer's routed pairs. `stream`: experts with a
    `w2.stream_at` row are computed (blocks, no missing pair) and still logged (the route's STREAM)."""
    num_experts = w2.table.shape[1]
    route_kernel[(1,)](
        topk_ids, topk_ids.numel(), w2.table, fp4.table, layer, num_experts,
        workspace.block_expert, workspace.block_fill, workspace.block_pairs, workspace.num_blocks,
        misses.counts, misses.entries, misses.entries.shape[0], _stream_words(w2, stream),
        EP=triton.next_power_of_2(num_experts), CHUNK=_ROUTE_CHUNK, BT=workspace.block_tokens,
        HISTOGRAM=_ROUTE_HISTOGRAM, STREAM=stream, num_warps=4,
    )


def _stream_words(w2: TierPool, stream: bool) -> torch.Tensor:
    """The route's and the combine's stream_at argument: the tier's table when streaming, else any int64 tensor
    (unread)."""
    if stream and w2.stream_at is None:
        raise ValueError("streaming reads the W2 tier's stream_at table: the tier has none")
    return w2.stream_at if stream else w2.slots


def moe_route_ref(topk_ids: torch.Tensor, w2: TierPool, fp4: TierPool, layer: int, block_tokens: int,
                  stream: bool = False) -> dict:
    """What `moe_route` writes, in plain Python: blocks [(expert, [pairs])] of up to block_tokens pairs of one resident
    expert (experts ascending, pairs ascending), the missing pairs' count and the missing experts (ascending).
    `stream`: an expert in neither pool with a `w2.stream_at` row gets blocks, adds no missing pair and is listed
    among the missing experts (those logged)."""
    ids = topk_ids.reshape(-1).tolist()
    pooled = ((w2.table[layer] >= 0) | (fp4.table[layer] >= 0)).tolist()
    experts = w2.table.shape[1]
    streamed = ((w2.stream_at[layer * experts:(layer + 1) * experts] != 0).tolist() if stream
                else [False] * experts)
    resident = [p or s for p, s in zip(pooled, streamed)]
    by_expert: dict[int, list[int]] = {}
    for pair, expert in enumerate(ids):
        if 0 <= expert < len(resident):
            by_expert.setdefault(expert, []).append(pair)
    blocks, missing_pairs, missing_experts = [], 0, []
    for expert in sorted(by_expert):
        pairs = by_expert[expert]
        if resident[expert]:
            blocks += [(expert, pairs[i: i + block_tokens]) for i in range(0, len(pairs), block_tokens)]
        if not pooled[expert]:
            missing_pairs += 0 if streamed[expert] else len(pairs)
            missing_experts.append(expert)
    return dict(blocks=blocks, missing_pairs=missing_pairs, missing_experts=missing_experts)


def route_blocks(workspace: MoeWorkspace) -> list[tuple[int, list[int]]]:
    """The route output in `workspace`, read back in `moe_route_ref`'s form: (expert, pairs) of each block, in order."""
    bt, n = workspace.block_tokens, int(workspace.num_blocks[0])
    experts, fills, pairs = (t.tolist() for t in (workspace.block_expert, workspace.block_fill, workspace.block_pairs))
    return [(experts[b], pairs[b * bt: b * bt + fills[b]]) for b in range(n)]


def moe_gate_up(hidden: torch.Tensor, top_k: int, w2: TierPool, fp4: TierPool, layer: int, workspace: MoeWorkspace,
                swiglu_limit: float | None = None, stream: bool = False) -> None:
    """Stage 2: workspace.act[pair] = SwiGLU(W13_e hidden[token]) for every placed pair (`stream`: a streamed
    expert's pairs from its `w2.stream_at` row)."""
    table_row = layer * w2.table.shape[1]
    _gemm(hidden, workspace.act, w2, fp4, "w13", table_row, workspace, w2.layout.inter, hidden.shape[1], top_k,
          True, swiglu_limit, True, stream)


def moe_down(top_k: int, w2: TierPool, fp4: TierPool, layer: int, workspace: MoeWorkspace,
             stream: bool = False) -> None:
    """Stage 3: workspace.y[pair] = W2_e act[pair] (float32) for every placed pair (`stream`: as in moe_gate_up)."""
    table_row = layer * w2.table.shape[1]
    _gemm(workspace.act, workspace.y, w2, fp4, "w2", table_row, workspace, w2.layout.hidden, w2.layout.inter, top_k,
          False, None, False, stream)


def moe_combine(topk_ids, topk_weights, w2: TierPool, fp4: TierPool, layer: int, workspace: MoeWorkspace, out,
                stream: bool = False) -> None:
    """Stage 4: out[t] = sum_j w[t, j] * y[t * k + j] over resident pairs (`stream`: and streamed ones), j in order."""
    num_tokens, top_k = topk_ids.shape
    h = out.shape[1]
    combine_kernel[(num_tokens, triton.cdiv(h, _COMBINE_BH))](
        workspace.y, workspace.y.stride(0), topk_ids, topk_weights, w2.table, fp4.table, layer * w2.table.shape[1],
        out, out.stride(0), h, _stream_words(w2, stream), TOP_K=top_k, BH=_COMBINE_BH, STREAM=stream, num_warps=4,
    )


def moe_mm(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w2: TierPool, fp4: TierPool,
           layer: int, misses: MissLog, workspace: MoeWorkspace, out: torch.Tensor | None = None,
           swiglu_limit: float | None = None, cuda_w2=None, stream: bool = False) -> torch.Tensor:
    """hidden [T, H] (bf16 on GPU; fp32/fp16 in the interpreter), topk_ids/topk_weights [T, k] -> out [T, H].

    Capture-safe when `out` is given: four launches, no allocation, no host sync. cuda_w2: None (default) or a
    `tierstore.kernels.cuda.w2_moe.W2MoeCuda`, which then runs gate_up and down (CUDA C++, W2 pairs only: for
    layers without FP4-resident experts, see its docstring) between the same route and combine; ops with a
    `route_free` method (W2MoeCuda, TierMoeCuda) are also given topk_ids=. When `cuda_w2.route_free(workspace)` says
    its kernels read the router's ids rather than the route output (pair-order builds), the route runs beside them on
    the workspace's side stream (CUDA only). Streaming: pairs whose expert has no slot but a `w2.stream_at` row are
    computed from that row and combined, logged by the route but not counted as missing pairs. Without `cuda_w2` the
    Triton stages stream when `stream` is true; with one, where `cuda_w2.streams(workspace)` (W2MoeCuda(stream=True)
    on a block_tokens 1 workspace), whatever `stream` says (its kernels read the rows).
    """
    _check(hidden, topk_ids, w2, fp4, workspace)
    if out is None:
        out = torch.empty_like(hidden)
    top_k = topk_ids.shape[1]
    ids = {"topk_ids": topk_ids} if hasattr(cuda_w2, "route_free") else {}  # the library's ops take them
    if cuda_w2 is not None:
        stream = getattr(cuda_w2, "streams", None) is not None and cuda_w2.streams(workspace)
    if ids and workspace.side_stream is not None and cuda_w2.route_free(workspace):
        _route_beside(lambda: cuda_w2(hidden, top_k, w2, fp4, layer, workspace, swiglu_limit, **ids), topk_ids, w2,
                      fp4, layer, misses, workspace, stream)
    else:
        moe_route(topk_ids, w2, fp4, layer, misses, workspace, stream)
        if cuda_w2 is None:
            moe_gate_up(hidden, top_k, w2, fp4, layer, workspace, swiglu_limit, stream)
            moe_down(top_k, w2, fp4, layer, workspace, stream)
        else:
            cuda_w2(hidden, top_k, w2, fp4, layer, workspace, swiglu_limit, **ids)
    moe_combine(topk_ids, topk_weights, w2, fp4, layer, workspace, out, stream)
    return out


def _route_beside(stages, topk_ids, w2, fp4, layer: int, misses: MissLog, workspace: MoeWorkspace,
                  stream: bool = False) -> None:
    """`stages()` (kernels that read the router's ids, not the route output) on the current stream while the route
    runs on the workspace's side stream, forked from the current stream before and joined into it after: two
    branches of a captured graph, the miss log and the route output complete before anything after this call."""
    main, side = torch.cuda.current_stream(), workspace.side_stream
    fork, join = workspace.route_events
    fork.record(main)
    side.wait_event(fork)
    with torch.cuda.stream(side):
        moe_route(topk_ids, w2, fp4, layer, misses, workspace, stream)
    stages()
    join.record(side)
    main.wait_event(join)


def moe_mm_ref(hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w2: TierPool, fp4: TierPool,
               layer: int, swiglu_limit: float | None = None, act_dtype: torch.dtype | None = None):
    """Plain-torch reference: (out float32 [T, H], missing pairs, sorted list of missing (layer, expert)).

    Weights are decoded from the packed slots with `unpack_matrix_ref`; arithmetic is float32 with the
    SwiGLU output rounded to `act_dtype` (the kernel's activation dtype) when given.
    """
    x = hidden.float()
    out = torch.zeros_like(x)
    missing_pairs = 0
    missing = set()
    decoded = {}
    for t in range(topk_ids.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            s4, s2 = int(fp4.table[layer, e]), int(w2.table[layer, e])
            if s4 >= 0:
                pool, slot = fp4, s4
            elif s2 >= 0:
                pool, slot = w2, s2
            else:
                missing_pairs += 1
                missing.add((layer, e))
                continue
            key = (id(pool), slot)
            if key not in decoded:
                decoded[key] = tuple(unpack_matrix_ref(pool.slots[slot], pool.layout, m) for m in ("w13", "w2"))
            w13, down = decoded[key]  # [2I, H], [H, I]
            gate_up = w13 @ x[t]
            gate, up = gate_up.chunk(2)
            if swiglu_limit is not None:
                gate = gate.clamp(max=swiglu_limit)
                up = up.clamp(-swiglu_limit, swiglu_limit)
            act = torch.nn.functional.silu(gate) * up
            if act_dtype is not None:
                act = act.to(act_dtype).float()
            out[t] += topk_weights[t, j].float() * (down @ act)
    return out, missing_pairs, sorted(missing)


def w2_tier(hidden: int, inter: int, num_slots: int, layers: int, experts: int, device) -> TierPool:
    return TierPool.empty(w2_slot_layout(hidden, inter), num_slots, layers, experts, device)


def fp4_tier(hidden: int, inter: int, num_slots: int, layers: int, experts: int, device) -> TierPool:
    return TierPool.empty(fp4_slot_layout(hidden, inter), num_slots, layers, experts, device)
