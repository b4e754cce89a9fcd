"""CUDA C++ FP4 gate_up and down for decode (fp4_moe.cu) and their plain-torch references.

`Fp4GateUpCuda()(hidden, top_k, fp4, layer, ws)` computes what `moe_gate_up` computes for the FP4-resident
pairs of a BT = 1 workspace (after `moe_route`): ws.act[pair] = SwiGLU(W13_e x[token]) (optional clamp), or
into `out` [P, I] bf16. `Fp4DownCuda()(fp4, layer, ws)`: ws.y[pair] = W2_e ws.act[pair] (float32), or into
`out` [P, H]. Both leave every other pair's row untouched (W2 pairs, missing experts): the W2 kernels compute
the W2 pairs (kernels/cuda/tier_moe.py runs both tiers).

The down is built for one tile width of its w2 matrix (`wps`, kernels/layout.py): 32 words per nibble slot when inter
is a multiple of 256, else 16 (ds-v2-lite's 1408; fp4_half_tiles.cuh); `w2_down.wps_of(layout)` says which.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..layout import FP4_VALUES_PER_WORD, SlotLayout, unpack_matrix_ref
from . import loader, w2_down, w2_gate_up

SOURCE = Path(__file__).with_name("fp4_moe.cu")
GATE_UP_KERNEL, DOWN_KERNEL = "fp4_gate_up_mma", "fp4_down_mma"
THREADS = 128
K_MULTIPLE = 256  # the gate_up's K (hidden) must fill whole 32-word FP4 tiles (kF4TileK)
GATE_UP_ROWS_PER_BLOCK = 32  # 4 warps x 8 gate rows
DOWN_ROWS_PER_BLOCK = 64  # 4 warps x 16 rows
# x, stride_x, slots, slot_bytes, words_off, scales_off, words_per_row, blocks_per_row, f4_table, table_row,
# block_expert, block_pairs, num_blocks, top_k, act, stride_act, inter, hidden, limit, has_limit
GATE_UP_ARG_KINDS = "pqpqqqiipipppipqiifi"
# act, stride_act, slots, slot_bytes, words_off, scales_off, words_per_row, blocks_per_row, f4_table, table_row,
# block_expert, block_pairs, num_blocks, y, stride_y, inter
DOWN_ARG_KINDS = "pqpqqqiipippppqi"


def check_geometry(layout: SlotLayout) -> None:
    """Shapes both kernels support: FP4 slots, hidden a multiple of 256 (the gate_up's whole K tiles; then also a
    multiple of the down's 64 rows per block; inter is one of the gate_up's 32, as every layout's). Any inter: the
    down has a build per tile width (`check_down_build`)."""
    if layout.values_per_word != FP4_VALUES_PER_WORD:
        raise ValueError("the CUDA FP4 stages read FP4 slots only")
    if layout.hidden % K_MULTIPLE:
        raise ValueError(f"hidden must be a multiple of {K_MULTIPLE}, got {layout.hidden}")


def check_down_build(layout: SlotLayout, wps: int) -> None:
    """That a down built for `wps`-word tiles reads this FP4 pool's w2 matrix."""
    w2_down.check_wps(wps)
    if w2_down.wps_of(layout) != wps:
        raise ValueError(f"this FP4 down kernel was built for {wps}-word tiles; the pool's w2 matrix (inter "
                         f"{layout.inter}) has {w2_down.wps_of(layout)}-word tiles: build it with wps="
                         f"{w2_down.wps_of(layout)}")


def gate_up_args(hidden, top_k: int, fp4, layer: int, ws, out, swiglu_limit: float | None, topk_ids=None) -> list:
    """fp4_gate_up_mma's arguments in GATE_UP_ARG_KINDS order (pointers as ints); topk_ids: a pair-order launch's."""
    return [hidden.data_ptr(), hidden.stride(0), *w2_gate_up.slot_args(fp4, (fp4,), layer, "w13"),
            *w2_gate_up.route_words(ws, topk_ids), top_k, out.data_ptr(), out.stride(0), fp4.layout.inter,
            fp4.layout.hidden, *w2_gate_up.limit_args(swiglu_limit)]


def down_args(fp4, layer: int, ws, out, topk_ids=None) -> list:
    """fp4_down_mma's arguments in DOWN_ARG_KINDS order (pointers as ints); topk_ids: a pair-order launch's."""
    return [ws.act.data_ptr(), ws.act.stride(0), *w2_gate_up.slot_args(fp4, (fp4,), layer, "w2"),
            *w2_gate_up.route_words(ws, topk_ids), out.data_ptr(), out.stride(0), fp4.layout.inter]



def _check_common(fp4, ws) -> None:
    check_geometry(fp4.layout)
    if ws.block_tokens != 1:
        raise ValueError(f"the CUDA FP4 stages run one pair per block (block_tokens 1), got {ws.block_tokens}")


def check_gate_up_inputs(hidden, fp4, ws, out) -> None:
    _check_common(fp4, ws)
    w2_gate_up.check_hidden_out(hidden, out, ws, fp4.layout.hidden)


def check_down_inputs(fp4, ws, out, wps: int = 32) -> None:
    _check_common(fp4, ws)
    check_down_build(fp4.layout, wps)
    w2_down.check_act_out(ws, out)


def build_image(ahead: int, wps: int = 32, mad: bool = False, pair_order: bool = False) -> bytes:
    """fp4_moe.cu's image (FP4_WPS only for 16, FP4_DECODE_MAD and FP4_PAIR_ORDER only when on: the default builds'
    commands are the ones from before those defines existed)."""
    return loader.build(SOURCE, {"FP4_AHEAD": ahead} | ({"FP4_WPS": 16} if wps == 16 else {})
                        | ({"FP4_DECODE_MAD": 1} if mad else {}) | ({"FP4_PAIR_ORDER": 1} if pair_order else {}))


class Fp4GateUpCuda:
    """Builds (nvcc, cached) and loads the kernel once; each call launches it on the current stream.
    ahead: K tiles of weight loads in flight per lane while one is computed (FP4_AHEAD; no change to the bytes).
    mad: FP4_DECODE_MAD, the decode's right shifts as the high word of a multiply (IMAD.HI, FMA pipe) instead of SHF
    on the integer ALU (fp4_fragments.cuh `f4_shr`); the same bytes out. pair_order: FP4_PAIR_ORDER, one block per
    routed pair, its expert read from the topk_ids each call passes instead of the route output (as
    `W2GateUpCuda(pair_order=True)`); the same bytes out."""

    def __init__(self, ahead: int = 2, device: int | None = None, mad: bool = False, pair_order: bool = False) -> None:
        self.device = torch.cuda.current_device() if device is None else device
        torch.cuda.init()
        self.ahead, self.mad, self.pair_order = ahead, mad, pair_order
        self.kernel = loader.load(build_image(ahead, mad=mad, pair_order=pair_order), GATE_UP_KERNEL, self.device)

    def __call__(self, hidden, top_k: int, fp4, layer: int, ws, out=None, swiglu_limit: float | None = None,
                 topk_ids=None):
        out = ws.act if out is None else out
        check_gate_up_inputs(hidden, fp4, ws, out)
        if self.pair_order:
            w2_gate_up.check_topk_ids(topk_ids, ws)
        grid = (w2_gate_up.route_blocks_grid(ws, False, self.pair_order), fp4.layout.inter // GATE_UP_ROWS_PER_BLOCK)
        smem = 2 * fp4.layout.hidden  # activation pairs: H / 2 x 4 bytes
        self.kernel.allow_shared(smem)
        self.kernel.launch(grid, (THREADS,), smem, torch.cuda.current_stream().cuda_stream, GATE_UP_ARG_KINDS,
                           gate_up_args(hidden, top_k, fp4, layer, ws, out, swiglu_limit,
                                        topk_ids if self.pair_order else None))
        return out

    def attributes(self) -> dict:
        return {name: self.kernel.attribute(name) for name in ("num_regs", "local_bytes", "shared_bytes", "max_threads")}


class Fp4DownCuda:
    """As Fp4GateUpCuda, for the down kernel; wps: the w2 matrix's words per nibble slot this build reads (32, or 16
    for an inter not a multiple of 256: `w2_down.wps_of`); mad / pair_order: FP4_DECODE_MAD / FP4_PAIR_ORDER as in
    `Fp4GateUpCuda`."""

    def __init__(self, ahead: int = 2, device: int | None = None, wps: int = 32, mad: bool = False,
                 pair_order: bool = False) -> None:
        w2_down.check_wps(wps)
        self.device = torch.cuda.current_device() if device is None else device
        torch.cuda.init()
        self.ahead, self.wps, self.mad, self.pair_order = ahead, wps, mad, pair_order
        self.kernel = loader.load(build_image(ahead, wps, mad, pair_order), DOWN_KERNEL, self.device)

    def __call__(self, fp4, layer: int, ws, out=None, topk_ids=None):
        out = ws.y if out is None else out
        check_down_inputs(fp4, ws, out, self.wps)
        if self.pair_order:
            w2_gate_up.check_topk_ids(topk_ids, ws)
        grid = (w2_gate_up.route_blocks_grid(ws, False, self.pair_order), fp4.layout.hidden // DOWN_ROWS_PER_BLOCK)
        smem = 2 * w2_down.act_k(fp4.layout)  # activation pairs: K / 2 x 4 bytes
        self.kernel.allow_shared(smem)
        self.kernel.launch(grid, (THREADS,), smem, torch.cuda.current_stream().cuda_stream, DOWN_ARG_KINDS,
                           down_args(fp4, layer, ws, out, topk_ids if self.pair_order else None))
        return out

    def attributes(self) -> dict:
        return {name: self.kernel.attribute(name) for name in ("num_regs", "local_bytes", "shared_bytes", "max_threads")}


def fp4_gate_up_ref(hidden: torch.Tensor, topk_ids: torch.Tensor, fp4, layer: int,
                    swiglu_limit: float | None = None) -> torch.Tensor:
    """Plain torch: float32 [P, I], row p = SwiGLU(W13_e x[p // k]) for FP4-resident pairs (e = topk_ids.flat[p]),
    NaN elsewhere. Weights from `unpack_matrix_ref`, float32 arithmetic."""
    top_k = topk_ids.shape[1]
    out = torch.full((topk_ids.numel(), fp4.layout.inter), float("nan"), dtype=torch.float32, device=hidden.device)
    for p, e in enumerate(topk_ids.reshape(-1).tolist()):
        slot = int(fp4.table[layer, e])
        if slot < 0:
            continue
        gate, up = (unpack_matrix_ref(fp4.slots[slot], fp4.layout, "w13") @ hidden[p // top_k].float()).chunk(2)
        if swiglu_limit is not None:
            gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
        out[p] = torch.nn.functional.silu(gate) * up
    return out


def fp4_down_ref(act: torch.Tensor, topk_ids: torch.Tensor, fp4, layer: int) -> torch.Tensor:
    """Plain torch: float32 [P, H], row p = W2_e act[p] for FP4-resident pairs, NaN elsewhere."""
    out = torch.full((topk_ids.numel(), fp4.layout.hidden), float("nan"), dtype=torch.float32, device=act.device)
    for p, e in enumerate(topk_ids.reshape(-1).tolist()):
        slot = int(fp4.table[layer, e])
        if slot >= 0:
            out[p] = unpack_matrix_ref(fp4.slots[slot], fp4.layout, "w2") @ act[p].float()  # [H, I] @ [I]
    return out
