"""Multi-token CUDA C++ W2 stages (w2_gate_up_multi.cu, w2_down_multi.cu): one CUDA block decodes an expert's
weight tile once for up to 8 routed pairs of that expert (the mma's 8 columns).

They take a workspace routed with block_tokens a multiple of 8 (16, 32, 64; `MoeWorkspace.allocate(...,
block_tokens=16)`): CUDA block b runs route block b's pairs in column groups of 8, one after another. Outputs are the
single-token kernels' (w2_gate_up.py, w2_down.py), indexed by pair, so their references apply unchanged:
`W2GateUpMultiCuda()(hidden, top_k, w2, fp4, layer, ws)` writes ws.act of the W2 pairs (FP4 and missing pairs
untouched), `W2DownMultiCuda()(w2, fp4, layer, ws)` writes ws.y (FP4 pairs' rows NaN, missing pairs' untouched).
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import loader, w2_down, w2_gate_up
from .carveout import FitCarveout, fit_carveout

COLS = 8  # kCols in w2_multi.cuh: pairs per CUDA block (the mma's N)
PAD_WORDS = 4  # kPadWords: per-column shared-memory pad
GATE_SOURCE = Path(__file__).with_name("w2_gate_up_multi.cu")
GATE_KERNEL = "w2_gate_up_multi"
GATE_THREADS = 256
GATE_ROWS_PER_BLOCK = 64  # 8 warps x 8 rows
# x, stride_x, slots, slot_bytes, words_off, scales_off, words_per_row, blocks_per_row, w2_table, f4_table,
# table_row, block_expert, block_fill, block_pairs, num_blocks, block_tokens, top_k, act, stride_act, inter, hidden,
# limit, has_limit
GATE_ARG_KINDS = "pqpqqqiippippppiipqiifi"
DOWN_SOURCE = Path(__file__).with_name("w2_down_multi.cu")
DOWN_KERNEL = "w2_down_multi"
DOWN_THREADS = 128
# act, stride_act, slots, slot_bytes, words_off, scales_off, words_per_row, blocks_per_row, w2_table, f4_table,
# table_row, block_expert, block_fill, block_pairs, num_blocks, block_tokens, y, stride_y, inter
DOWN_ARG_KINDS = "pqpqqqiippippppipqi"


def shared_bytes(k_len: int, cols: int = COLS) -> int:
    """Dynamic shared memory of a block: `cols` columns (COLS; the gate_up v2's stage_cols) of k_len / 2 activation
    pairs plus the pad, 4 bytes each."""
    return 4 * cols * (k_len // 2 + PAD_WORDS)


def check_block_tokens(ws) -> None:
    if ws.block_tokens % COLS:
        raise ValueError(f"the multi-token CUDA kernels need block_tokens a multiple of {COLS}, got {ws.block_tokens}")


def gate_check_geometry(layout, rows_per_block: int = GATE_ROWS_PER_BLOCK) -> None:
    w2_gate_up.check_geometry(layout)
    if layout.inter % rows_per_block:
        raise ValueError(f"inter must be a multiple of {rows_per_block}, got {layout.inter}")


def route_args(ws) -> list:
    """The multi-token kernels' route arguments (W2 and FP4): block_expert, block_fill, block_pairs, num_blocks, block_tokens."""
    return [ws.block_expert.data_ptr(), ws.block_fill.data_ptr(), ws.block_pairs.data_ptr(), ws.num_blocks.data_ptr(),
            ws.block_tokens]


def gate_launch_args(hidden, top_k, w2, fp4, layer: int, ws, out, swiglu_limit: float | None) -> list:
    """The gate_up kernel's arguments in GATE_ARG_KINDS order (pointers as ints)."""
    return [hidden.data_ptr(), hidden.stride(0), *w2_gate_up.slot_args(w2, (w2, fp4), layer, "w13"),
            *route_args(ws), top_k, out.data_ptr(), out.stride(0), w2.layout.inter, w2.layout.hidden,
            *w2_gate_up.limit_args(swiglu_limit)]


def down_launch_args(w2, fp4, layer: int, ws, out) -> list:
    """The down kernel's arguments in DOWN_ARG_KINDS order (pointers as ints)."""
    return [ws.act.data_ptr(), ws.act.stride(0), *w2_gate_up.slot_args(w2, (w2, fp4), layer, "w2"), *route_args(ws),
            out.data_ptr(), out.stride(0), w2.layout.inter]


def gate_check_inputs(hidden, w2, fp4, ws, out, rows_per_block: int = GATE_ROWS_PER_BLOCK) -> None:
    gate_check_geometry(w2.layout, rows_per_block)
    check_block_tokens(ws)
    w2_gate_up.check_tensors(hidden, w2, fp4, ws, out)


def down_check_inputs(w2, fp4, ws, out, groups: int, wps: int = 32) -> None:
    w2_down.check_build(w2.layout, groups, wps)
    check_block_tokens(ws)
    w2_down.check_tensors(w2, fp4, ws, out)


class _Built:
    threads = 0

    def __init__(self, source: Path, kernel: str, defines: dict, device: int | None) -> None:
        self.device = torch.cuda.current_device() if device is None else device
        torch.cuda.init()
        self.kernel = loader.load(loader.build(source, defines), kernel, self.device)
        self.kernel.prefer_max_shared()  # gate_up: 2 blocks of 114.8 KB per SM at H = 7168

    def smem(self, k_len: int) -> int:
        """Dynamic shared memory of one block at K = k_len."""
        return shared_bytes(k_len)

    def attributes(self, k_len: int | None = None) -> dict:
        """The kernel's attributes; with k_len (the stage's K) also the driver's resident blocks per SM."""
        attrs = {name: self.kernel.attribute(name) for name in ("num_regs", "local_bytes", "shared_bytes", "max_threads")}
        if k_len is not None:
            self.kernel.allow_shared(self.smem(k_len))
            attrs["blocks_per_sm"] = self.kernel.blocks_per_sm(self.threads, self.smem(k_len))
        return attrs


class W2GateUpMultiCuda(_Built):
    """Builds (nvcc, cached) and loads w2_gate_up_multi once; each call launches it on the current stream.
    ahead: W2_AHEAD (K tiles of weight loads in flight per lane).

    v2 options (benchmarks/cuda-w2-notes.md, "v2"; the defaults build and launch the kernel exactly as before):
    warps: W2_WARPS, 8 (64 rows per block, 2 blocks per SM) or 4 (32 rows, 4 blocks per SM); stage_cols:
    W2_STAGE_COLS, the columns of activation pairs staged in shared memory per pass (1..8; a block runs its pairs in
    passes of stage_cols); carveout: "max" (the largest shared-memory carveout, the default) or "fit" (the smallest
    capacity holding 16 / warps blocks: the rest stays L1); early: W2_EARLY, the prologue's route and table words in
    two dependent loads instead of five; mad: the v5 decode (W2_DECODE_MAD, as in `W2GateUpCuda`). Per pair the bytes
    are the default's."""

    threads = GATE_THREADS  # the default's; an instance with warps = 4 has 128
    rows_per_block = GATE_ROWS_PER_BLOCK

    def __init__(self, ahead: int = 2, warps: int = 8, stage_cols: int = COLS, carveout: str = "max",
                 early: bool = False, device: int | None = None, mad: bool = False) -> None:
        if warps not in (4, 8) or not 1 <= stage_cols <= COLS or carveout not in ("max", "fit"):
            raise ValueError(f"warps 4 or 8, stage_cols 1..{COLS}, carveout 'max' or 'fit'; got {warps}, "
                             f"{stage_cols}, {carveout!r}")
        self.ahead, self.warps, self.stage_cols, self.carveout, self.early = ahead, warps, stage_cols, carveout, early
        self.mad = mad
        self.threads = 32 * warps
        self.rows_per_block = 8 * warps
        defines = {"W2_AHEAD": ahead}
        if warps != 8:
            defines["W2_WARPS"] = warps
        if stage_cols != COLS:
            defines["W2_STAGE_COLS"] = stage_cols
        if early:
            defines["W2_EARLY"] = 1
        if mad:
            defines["W2_DECODE_MAD"] = 1
        super().__init__(GATE_SOURCE, GATE_KERNEL, defines, device)
        self._fit = FitCarveout(self.kernel, 16 // warps) if carveout == "fit" else None

    def smem(self, k_len: int) -> int:
        return shared_bytes(k_len, self.stage_cols)

    def _set_carveout(self, k_len: int) -> None:
        if self._fit is not None:
            self._fit.launch(self.smem(k_len))

    def attributes(self, k_len: int | None = None) -> dict:
        if k_len is not None:
            self._set_carveout(k_len)
        attrs = super().attributes(k_len)
        if k_len is not None and self.carveout == "fit":
            attrs["carveout_pct"] = fit_carveout(self.smem(k_len), 16 // self.warps)
        return attrs

    def __call__(self, hidden, top_k: int, w2, fp4, layer: int, ws, out=None, swiglu_limit: float | None = None):
        out = ws.act if out is None else out
        gate_check_inputs(hidden, w2, fp4, ws, out, self.rows_per_block)
        smem = self.smem(w2.layout.hidden)
        self.kernel.allow_shared(smem)
        self._set_carveout(w2.layout.hidden)
        self.kernel.launch((ws.block_expert.numel(), w2.layout.inter // self.rows_per_block), (self.threads,), smem,
                           torch.cuda.current_stream().cuda_stream, GATE_ARG_KINDS,
                           gate_launch_args(hidden, top_k, w2, fp4, layer, ws, out, swiglu_limit))
        return out


class W2DownMultiCuda(_Built):
    """Builds (nvcc, cached) and loads w2_down_multi once; each call launches it on the current stream.
    ahead / groups / wps / mad: W2_AHEAD / W2_GROUPS / W2_WPS / W2_DECODE_MAD as in `W2DownCuda` (rows per block
    64 * groups)."""

    threads = DOWN_THREADS

    def __init__(self, ahead: int = 2, groups: int = 1, device: int | None = None, wps: int = 32,
                 mad: bool = False) -> None:
        w2_down.check_wps(wps)
        self.ahead, self.groups, self.wps, self.mad = ahead, groups, wps, mad
        defines = ({"W2_AHEAD": ahead, "W2_GROUPS": groups} | ({"W2_WPS": 16} if wps == 16 else {})
                   | ({"W2_DECODE_MAD": 1} if mad else {}))
        super().__init__(DOWN_SOURCE, DOWN_KERNEL, defines, device)

    def __call__(self, w2, fp4, layer: int, ws, out=None):
        out = ws.y if out is None else out
        down_check_inputs(w2, fp4, ws, out, self.groups, self.wps)
        smem = shared_bytes(w2_down.act_k(w2.layout))
        self.kernel.allow_shared(smem)
        self.kernel.launch((ws.block_expert.numel(), w2.layout.hidden // w2_down.rows_per_block(self.groups)), (DOWN_THREADS,),
                           smem, torch.cuda.current_stream().cuda_stream, DOWN_ARG_KINDS,
                           down_launch_args(w2, fp4, layer, ws, out))
        return out
