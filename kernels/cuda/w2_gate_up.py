"""CUDA C++ W2 gate_up for decode (w2_gate_up.cu) and its plain-torch reference.

`W2GateUpCuda()(hidden, top_k, w2, fp4, layer, workspace)` computes what `moe_gate_up` computes for the
W2-resident pairs of a BT = 1 workspace (after `moe_route`): workspace.act[pair] = SwiGLU(W13_e x[token]),
or into `out` [P, I] bf16 when given. Pairs of an FP4-resident expert and missing experts are left
untouched. An experiment for issue #9 section 4 (benchmarks/cuda-w2-notes.md), not wired into moe_mm.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..layout import SlotLayout, unpack_matrix_ref
from . import loader
from .carveout import FitCarveout

SOURCE = Path(__file__).with_name("w2_gate_up.cu")
KERNEL = "w2_gate_up_mma"
ROWS_PER_BLOCK = 32  # output rows per block: 4 warps x 8 (kWarps * kRowsPerWarp in the .cu)
THREADS = 128
K_MULTIPLE = 512  # hidden must fill whole 32-word tiles (kTileK)
STAGE_BYTES = 4 * 2304  # one cp.async stage of a block: 4 warps x kStageBytes (w2_stages.cuh)
# x, stride_x, slots, slot_bytes, words_off, scales_off, words_per_row, blocks_per_row, w2_table, f4_table,
# table_row, block_expert, block_pairs, num_blocks, top_k, act, stride_act, inter, hidden, limit, has_limit
ARG_KINDS = "pqpqqqiippipppipqiifi"


def check_geometry(layout: SlotLayout) -> None:
    """The shapes the kernel supports: whole 512-K tiles (SlotLayout already makes inter a multiple of 32 =
    ROWS_PER_BLOCK)."""
    if layout.values_per_word != 16:
        raise ValueError("the CUDA gate_up reads W2 slots only")
    if layout.hidden % K_MULTIPLE:
        raise ValueError(f"hidden must be a multiple of {K_MULTIPLE}, got {layout.hidden}")


def slot_args(pool, tables, layer: int, matrix: str) -> list:
    """The weight arguments of every stage kernel (W2 and FP4, single- and multi-token), after its activations and
    their stride: `pool`'s slots pointer, slot_bytes, `matrix`'s ("w13" or "w2") words and scales offsets, its words
    and scale blocks per row, then the table pointer of each tier in `tables` and the layer's table row."""
    lay = pool.layout
    m = getattr(lay, matrix)
    return [pool.slots.data_ptr(), lay.slot_bytes, getattr(lay, f"{matrix}_words_offset"),
            getattr(lay, f"{matrix}_scales_offset"), m.words_per_row, m.blocks_per_row,
            *(tier.table.data_ptr() for tier in tables), layer * pool.table.shape[1]]


def stream_args(w2, stream: bool) -> list:
    """A stream build's (W2_STREAM) last argument: the pool's `stream_at` table ([layers * E] int64, each expert's
    arena row address minus the slots' address, 0 where it has no row; `tierstore.runtime.stream_rows`); nothing for
    another build."""
    if not stream:
        return []
    at = w2.stream_at
    if at is None:
        raise ValueError("a stream build (stream=True) reads the W2 tier's stream_at table: the tier has none")
    if at.dtype != torch.int64 or at.numel() != w2.table.numel() or not at.is_contiguous() or at.device != w2.table.device:
        raise ValueError(f"stream_at must be contiguous int64 [{w2.table.numel()}] on {w2.table.device}, got "
                         f"{at.dtype} {tuple(at.shape)} on {at.device}")
    return [at.data_ptr()]


def limit_args(swiglu_limit: float | None) -> list:
    """The gate_up kernels' last two arguments: limit, has_limit."""
    return [0.0 if swiglu_limit is None else float(swiglu_limit), int(swiglu_limit is not None)]


def route_words(ws, topk_ids=None) -> list:
    """The single-token kernels' three route arguments (block_expert, block_pairs, num_blocks): the route output, or
    for a pair-order build (W2_PAIR_ORDER) the router's topk ids twice and the tables' expert count on the device."""
    if topk_ids is None:
        return [ws.block_expert.data_ptr(), ws.block_pairs.data_ptr(), ws.num_blocks.data_ptr()]
    return [topk_ids.data_ptr(), topk_ids.data_ptr(), ws.experts.data_ptr()]


def check_topk_ids(topk_ids, ws) -> None:
    """What a pair-order launch reads in place of the route output: the [T, k] int32 ids of ws's pairs, on its device."""
    if topk_ids is None:
        raise ValueError("a pair-order build (pair_order=True) reads the router's topk_ids: pass them")
    pairs = ws.act.shape[0]
    if topk_ids.dtype != torch.int32 or topk_ids.numel() != pairs or not topk_ids.is_contiguous():
        raise ValueError(f"topk_ids must be contiguous int32 with {pairs} ids (the workspace's pairs), got "
                         f"{topk_ids.dtype} {tuple(topk_ids.shape)}")
    if topk_ids.device != ws.act.device:
        raise ValueError(f"topk_ids on {topk_ids.device}, the workspace on {ws.act.device}")


def launch_args(hidden, top_k, w2, fp4, layer: int, ws, out, swiglu_limit: float | None, topk_ids=None) -> list:
    """The kernel's arguments in ARG_KINDS order (pointers as ints); topk_ids: a pair-order launch's."""
    return [hidden.data_ptr(), hidden.stride(0), *slot_args(w2, (w2, fp4), layer, "w13"), *route_words(ws, topk_ids),
            top_k, out.data_ptr(), out.stride(0), w2.layout.inter, w2.layout.hidden, *limit_args(swiglu_limit)]


def _check_inputs(hidden, w2, fp4, ws, out) -> None:
    check_geometry(w2.layout)
    if ws.block_tokens != 1:
        raise ValueError(f"the CUDA gate_up runs one pair per block (block_tokens 1), got {ws.block_tokens}")
    check_tensors(hidden, w2, fp4, ws, out)


def check_tensors(hidden, w2, fp4, ws, out) -> None:
    """dtypes, shapes and strides of the inputs and `out` (shared with the multi-token kernel, w2_multi.py)."""
    check_hidden_out(hidden, out, ws, w2.layout.hidden)
    if fp4.table.shape != w2.table.shape:
        raise ValueError("the W2 and FP4 tables must have the same shape")


def check_hidden_out(hidden, out, ws, hidden_size: int) -> None:
    """hidden [T, H] and out [P, I]: bf16, CUDA, unit inner strides, 16-byte aligned rows (also fp4_stages.py)."""
    if hidden.dtype != torch.bfloat16 or out.dtype != torch.bfloat16 or not hidden.is_cuda:
        raise ValueError("hidden and out must be bfloat16 CUDA tensors")
    if hidden.shape[1] != hidden_size or hidden.stride(1) != 1 or hidden.stride(0) % 8:
        raise ValueError("hidden must be [T, H] with unit inner stride and 16-byte aligned rows")
    if out.shape != ws.act.shape or out.stride(1) != 1:
        raise ValueError(f"out must be [P, I] = {tuple(ws.act.shape)} with unit inner stride")


def build_defines(ahead: int, early: bool = False, route_major: bool = False, pdl: bool = False,
                  mad: bool = False, pair_order: bool = False, stream: bool = False, prefetch: bool = False,
                  stage: bool = False) -> dict:
    """nvcc defines of a build: the v3 / v5 / pair-order / stream defines only when on, so the default's command (and
    cached image) is the same as before they existed. Shared with w2_down.py."""
    if pair_order and not early:
        raise ValueError("pair_order needs early (W2_PAIR_ORDER builds on W2_EARLY's prologue)")
    if stream and not pair_order:
        raise ValueError("stream needs pair_order (W2_STREAM builds on W2_PAIR_ORDER's prologue)")
    if prefetch and not stream:
        raise ValueError("prefetch needs stream (W2_STREAM_PREFETCH prefetches streamed pairs' rows)")
    if stage and not stream:
        raise ValueError("stage needs stream (W2_STREAM_STAGE stages streamed pairs' rows)")
    defines = {"W2_AHEAD": ahead}
    for name, on in (("W2_EARLY", early), ("W2_ROUTE_MAJOR", route_major), ("W2_PDL", pdl), ("W2_DECODE_MAD", mad),
                     ("W2_PAIR_ORDER", pair_order), ("W2_STREAM", stream), ("W2_STREAM_PREFETCH", prefetch),
                     ("W2_STREAM_STAGE", stage)):
        if on:
            defines[name] = 1
    return defines


# The most dynamic shared memory a single-token block may take with its stream stage and still leave room for the 4
# blocks per SM of its launch bounds (227 KiB per SM on Hopper, 1 KiB of it reserved per block).
STREAM_STAGE_LIMIT = 227 * 1024 // 4 - 1024


STAGE_CARVEOUTS = ("fit", "max")


def ask_stage_carveout(kernel, carveout: str) -> FitCarveout | None:
    """The shared-memory carveout of a stream stage build's kernel: "max" (the largest, asked now; None returned; the
    default) or "fit" (a `FitCarveout` of the launch's 4 blocks per SM for the launches to ask, the rest of the SM
    left to L1). On the H200 (stage30c, benchmarks/stream_kernels.py) "fit" cost the layers that stream nothing
    3.5 / 2.3 us at ds-v2-lite / qwen3-30b-a3b where "max" cost 2.0 / 1.8, and streamed no faster. Shared with
    w2_down.py."""
    if carveout not in STAGE_CARVEOUTS:
        raise ValueError(f"stage_carveout is one of {STAGE_CARVEOUTS}, got {carveout!r}")
    if carveout == "fit":
        return FitCarveout(kernel, 4)
    kernel.prefer_max_shared()
    return None


def stream_stage_bytes(words_bytes: int, base_bytes: int) -> int:
    """Dynamic shared memory for a W2_STREAM_STAGE build's streamed block to stage `words_bytes` (its rows' words and
    scales) after the `base_bytes` it always takes (the activation pairs): base + stage where that fits
    STREAM_STAGE_LIMIT, else 0 (the kernel then reads such blocks as a plain stream build does). Shared with
    w2_down.py."""
    return words_bytes if base_bytes + words_bytes <= STREAM_STAGE_LIMIT else 0


def route_blocks_grid(ws, pairs_grid: bool, pair_order: bool = False) -> int:
    """The grid's route-block dimension of a single-token kernel: every route block of the workspace
    (block_expert.numel() = max_blocks), or with pairs_grid at most the routed pairs P: at block_tokens 1 the route
    places each pair of a resident expert in a block of its own (kernels/_triton/route.py: num_blocks = sum of the
    resident experts' pair counts <= P), so the blocks past P would all exit (at T = 1: 16 -> 8 route blocks, no
    exiting CUDA block unless a pair misses). pair_order (a W2_PAIR_ORDER / FP4_PAIR_ORDER build): block b is pair b,
    so exactly P."""
    if pair_order:
        return ws.act.shape[0]
    if pairs_grid and ws.block_tokens != 1:
        raise ValueError("pairs_grid holds for block_tokens 1 only")
    return min(ws.block_expert.numel(), ws.act.shape[0]) if pairs_grid else ws.block_expert.numel()


class W2GateUpCuda:
    """Builds (nvcc, cached) and loads the kernel once; each call launches it on the current stream.

    ahead: K tiles of weight loads in flight per lane while one tile is computed (W2_AHEAD in the .cu:
    1 = 96 registers, 2 = 123 registers, both 4 blocks of 128 threads per SM).

    v3 options (benchmarks/cuda-w2-notes.md "v3"; off: the kernel built and launched exactly as before): early:
    W2_EARLY, the prologue's route and table words in 2 dependent loads instead of 4; route_major: W2_ROUTE_MAJOR,
    the CUDA blocks of live route blocks dispatched before the grid's exiting ones; pdl: W2_PDL, every block lets a
    programmatic dependent launch (W2DownCuda(pdl=True)) be scheduled before this grid completes; pairs_grid: launch
    P route blocks instead of max_blocks (`route_blocks_grid`; the kernel is the same build). None changes the bytes.

    stages (v4, cuda-w2-notes.md): 0 (default) the register ring of `ahead` tiles; n >= 2 the weight tiles staged
    through n shared-memory stages by cp.async (W2_STAGES, w2_stages.cuh; `ahead` unused), n - 1 tiles in flight per
    warp; same bytes out. mad (v5): W2_DECODE_MAD, slot pairs 0..4 decoded by a multiply-add on the FMA pipe instead
    of a rotate-add on the integer ALU (w2_fragments.cuh `w2_pair`); same bytes out. pair_order (needs early):
    W2_PAIR_ORDER, one block per routed pair in pair order, its expert read from the router's topk_ids (passed to
    each call) instead of the route output, so the routing kernel may run beside it; same bytes out. stream (needs
    pair_order): W2_STREAM, a pair whose expert has no W2 slot but an arena row (the tier's `stream_at`) is computed
    from that row in pinned host memory, over the bus; the same bytes as from a slot. prefetch (needs stream):
    W2_STREAM_PREFETCH, a streamed pair's block first asks its rows into L2 with bulk prefetches; same bytes out.
    stage (needs stream): W2_STREAM_STAGE, a streamed pair's block first copies its rows into shared memory in
    contiguous runs (512 bytes per warp instruction instead of 64 of each of eight rows) and computes from there,
    where the stage fits (`stream_stage_bytes`; elsewhere such blocks read as without, prefetching where built); same
    bytes out. stage_carveout: "fit" or "max" (`ask_stage_carveout`).
    """

    def __init__(self, ahead: int = 1, device: int | None = None, early: bool = False, route_major: bool = False,
                 pdl: bool = False, pairs_grid: bool = False, stages: int = 0, mad: bool = False,
                 pair_order: bool = False, stream: bool = False, prefetch: bool = False, stage: bool = False,
                 stage_carveout: str = "max") -> None:
        if stages == 1 or stages < 0:
            raise ValueError(f"stages is 0 (the register ring) or at least 2, got {stages}")
        if stream and stages:
            raise ValueError("stream reads the arena with plain loads: it has no staged (cp.async) build")
        defines = build_defines(ahead, early, route_major, pdl, mad, pair_order, stream, prefetch, stage)
        defines |= {"W2_STAGES": stages} if stages else {}
        self.device = torch.cuda.current_device() if device is None else device
        torch.cuda.init()
        self.ahead, self.early, self.route_major, self.pdl = ahead, early, route_major, pdl
        self.pairs_grid, self.stages, self.mad, self.pair_order = pairs_grid, stages, mad, pair_order
        self.stream, self.stage = stream, stage
        image = loader.build(SOURCE, defines)
        self.kernel = loader.load(image, KERNEL, self.device)
        if stages:
            self.kernel.prefer_max_shared()  # the stages need the largest carveout for 4 blocks per SM
        self._fit = ask_stage_carveout(self.kernel, stage_carveout) if stage else None

    def shared_bytes(self, layout: SlotLayout) -> int:
        """Dynamic shared memory of a launch: the activation pairs (H / 2 x 4 bytes), then the stages, or a stream
        stage build's stage of a block's 32 gate and 32 up rows and their scales where it fits."""
        base = 2 * layout.hidden + self.stages * STAGE_BYTES
        if not self.stage:
            return base
        m = layout.w13
        return base + stream_stage_bytes(2 * ROWS_PER_BLOCK * (4 * m.words_per_row + m.blocks_per_row), base)

    def __call__(self, hidden, top_k: int, w2, fp4, layer: int, ws, out=None, swiglu_limit: float | None = None,
                 topk_ids=None):
        out = ws.act if out is None else out
        _check_inputs(hidden, w2, fp4, ws, out)
        if self.pair_order:
            check_topk_ids(topk_ids, ws)
        grid = (route_blocks_grid(ws, self.pairs_grid, self.pair_order), w2.layout.inter // ROWS_PER_BLOCK)
        smem = self.shared_bytes(w2.layout)
        self.kernel.allow_shared(smem)
        if self._fit is not None:
            self._fit.launch(smem)
        args = launch_args(hidden, top_k, w2, fp4, layer, ws, out, swiglu_limit,
                           topk_ids if self.pair_order else None) + stream_args(w2, self.stream)
        self.kernel.launch(grid, (THREADS,), smem, torch.cuda.current_stream().cuda_stream,
                           ARG_KINDS + "p" * self.stream, args)
        return out

    def attributes(self) -> dict:
        return {name: self.kernel.attribute(name) for name in ("num_regs", "local_bytes", "shared_bytes", "max_threads")}


def w2_gate_up_ref(hidden: torch.Tensor, topk_ids: torch.Tensor, w2, fp4, layer: int,
                   swiglu_limit: float | None = None) -> torch.Tensor:
    """Plain torch: float32 [P, I], row p = SwiGLU(W13_e x[p // k]) for W2-resident pairs (e = topk_ids.flat[p]
    with no FP4 slot), NaN elsewhere. Weights from `unpack_matrix_ref`, float32 arithmetic."""
    top_k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1).tolist()
    out = torch.full((len(ids), w2.layout.inter), float("nan"), dtype=torch.float32, device=hidden.device)
    for p, e in enumerate(ids):
        slot = int(w2.table[layer, e])
        if slot < 0 or int(fp4.table[layer, e]) >= 0:
            continue
        w13 = unpack_matrix_ref(w2.slots[slot], w2.layout, "w13")  # [2I, H]
        gate, up = (w13 @ hidden[p // top_k].float()).chunk(2)
        if swiglu_limit is not None:
            gate = gate.clamp(max=swiglu_limit)
            up = up.clamp(-swiglu_limit, swiglu_limit)
        out[p] = torch.nn.functional.silu(gate) * up
    return out
