"""Multi-token CUDA C++ FP4 stages (fp4_moe_multi.cu): one CUDA block decodes an FP4 expert's weight tile once for up
to 8 routed pairs of that expert (the mma's columns).

They take a workspace routed with block_tokens a multiple of 8 (`MoeWorkspace.allocate(..., block_tokens=16)`).
Outputs are the single-token FP4 kernels' (fp4_stages.py), indexed by pair, so their references apply unchanged:
`Fp4GateUpMultiCuda()(hidden, top_k, fp4, layer, ws)` writes ws.act of the FP4 pairs, `Fp4DownMultiCuda()(fp4,
layer, ws)` ws.y of the FP4 pairs; every other pair's row is left untouched (kernels/cuda/tier_moe.py runs both
tiers).
"""

from __future__ import annotations

from pathlib import Path

import torch

from . import loader, w2_down, w2_gate_up, w2_multi
from .carveout import FitCarveout
from .fp4_stages import check_down_build, check_geometry

SOURCE = Path(__file__).with_name("fp4_moe_multi.cu")
GATE_KERNEL, DOWN_KERNEL = "fp4_gate_up_multi", "fp4_down_multi"
PAD_WORDS = 2  # kPadWords: per-column shared-memory pad (8 bytes)
DOWN_COLS = 8  # kDownCols: the down kernel's columns per pass
DOWN_THREADS = 128
DOWN_ROWS_PER_BLOCK = 64  # 4 warps x 16 rows
# x, stride_x, slots, slot_bytes, words_off, scales_off, words_per_row, blocks_per_row, f4_table, table_row,
# block_expert, block_fill, block_pairs, num_blocks, block_tokens, top_k, act, stride_act, inter, hidden, limit,
# has_limit
GATE_ARG_KINDS = "pqpqqqiipippppiipqiifi"
# act, stride_act, slots, slot_bytes, words_off, scales_off, words_per_row, blocks_per_row, f4_table, table_row,
# block_expert, block_fill, block_pairs, num_blocks, block_tokens, y, stride_y, inter
DOWN_ARG_KINDS = "pqpqqqiipippppipqi"


def shared_bytes(k_len: int, cols: int) -> int:
    """Dynamic shared memory of a block: `cols` columns of k_len / 2 activation pairs plus the pad, 4 bytes each."""
    return 4 * cols * (k_len // 2 + PAD_WORDS)


def gate_launch_args(hidden, top_k: int, fp4, layer: int, ws, out, swiglu_limit: float | None) -> list:
    """fp4_gate_up_multi's arguments in GATE_ARG_KINDS order (pointers as ints)."""
    return [hidden.data_ptr(), hidden.stride(0), *w2_gate_up.slot_args(fp4, (fp4,), layer, "w13"), *w2_multi.route_args(ws),
            top_k, out.data_ptr(), out.stride(0), fp4.layout.inter, fp4.layout.hidden,
            *w2_gate_up.limit_args(swiglu_limit)]


def down_launch_args(fp4, layer: int, ws, out) -> list:
    """fp4_down_multi's arguments in DOWN_ARG_KINDS order (pointers as ints)."""
    return [ws.act.data_ptr(), ws.act.stride(0), *w2_gate_up.slot_args(fp4, (fp4,), layer, "w2"), *w2_multi.route_args(ws),
            out.data_ptr(), out.stride(0), fp4.layout.inter]


def check_gate_up_inputs(hidden, fp4, ws, out, rows_per_block: int) -> None:
    check_geometry(fp4.layout)
    if fp4.layout.inter % rows_per_block:
        raise ValueError(f"inter must be a multiple of {rows_per_block}, got {fp4.layout.inter}")
    w2_multi.check_block_tokens(ws)
    w2_gate_up.check_hidden_out(hidden, out, ws, fp4.layout.hidden)


def check_down_inputs(fp4, ws, out, wps: int = 32) -> None:
    check_geometry(fp4.layout)  # hidden a multiple of 256: of the 64 rows per block too
    check_down_build(fp4.layout, wps)
    w2_multi.check_block_tokens(ws)
    w2_down.check_act_out(ws, out)


def _mad_define(mad: bool) -> dict:
    """FP4_DECODE_MAD only when on (the default builds keep the commands of before the define existed)."""
    return {"FP4_DECODE_MAD": 1} if mad else {}


class _Built:
    def __init__(self, kernel: str, defines: dict, device: int | None) -> None:
        self.device = torch.cuda.current_device() if device is None else device
        torch.cuda.init()
        self.kernel = loader.load(loader.build(SOURCE, defines), kernel, self.device)
        self.kernel.prefer_max_shared()

    def attributes(self) -> dict:
        return {name: self.kernel.attribute(name) for name in ("num_regs", "local_bytes", "shared_bytes", "max_threads")}


class Fp4GateUpMultiCuda(_Built):
    """Builds (nvcc, cached) and loads fp4_gate_up_multi once; each call launches it on the current stream.
    ahead: FP4_AHEAD; warps: FP4_WARPS (4 or 8; 8 rows each); stage_cols: FP4_STAGE_COLS (1..8, pairs per pass);
    carveout: "fit" (the smallest shared-memory capacity holding 16 / warps blocks, the rest stays L1) or "max";
    early: FP4_EARLY (the prologue's route and table words in two round trips); pdl: FP4_PDL (every block lets a
    programmatic dependent launch, `Fp4DownMultiCuda(pdl=True)`, be scheduled before this grid completes); mad:
    FP4_DECODE_MAD (`Fp4GateUpCuda`). Per pair the bytes do not depend on these (same arithmetic)."""

    def __init__(self, ahead: int = 2, warps: int = 8, stage_cols: int = 4, carveout: str = "fit",
                 early: bool = False, pdl: bool = False, device: int | None = None, mad: bool = False) -> None:
        if warps not in (4, 8) or not 1 <= stage_cols <= 8 or carveout not in ("max", "fit"):
            raise ValueError(f"warps 4 or 8, stage_cols 1..8, carveout 'max' or 'fit'; got {warps}, {stage_cols}, "
                             f"{carveout!r}")
        self.ahead, self.warps, self.stage_cols, self.carveout, self.early = ahead, warps, stage_cols, carveout, early
        self.pdl, self.mad = pdl, mad
        self.threads, self.rows_per_block = 32 * warps, 8 * warps
        super().__init__(GATE_KERNEL, {"FP4_AHEAD": ahead, "FP4_WARPS": warps, "FP4_STAGE_COLS": stage_cols,
                                       "FP4_EARLY": int(early), "FP4_PDL": int(pdl)} | _mad_define(mad), device)
        self._fit = FitCarveout(self.kernel, 16 // warps) if carveout == "fit" else None

    def _set_carveout(self, k_len: int) -> None:
        if self._fit is not None:
            self._fit.launch(shared_bytes(k_len, self.stage_cols))

    def __call__(self, hidden, top_k: int, fp4, layer: int, ws, out=None, swiglu_limit: float | None = None):
        out = ws.act if out is None else out
        check_gate_up_inputs(hidden, fp4, ws, out, self.rows_per_block)
        smem = shared_bytes(fp4.layout.hidden, self.stage_cols)
        self.kernel.allow_shared(smem)
        self._set_carveout(fp4.layout.hidden)
        self.kernel.launch((ws.block_expert.numel(), fp4.layout.inter // self.rows_per_block), (self.threads,), smem,
                           torch.cuda.current_stream().cuda_stream, GATE_ARG_KINDS,
                           gate_launch_args(hidden, top_k, fp4, layer, ws, out, swiglu_limit))
        return out


class Fp4DownMultiCuda(_Built):
    """As Fp4GateUpMultiCuda, for the down kernel (4 warps of 16 rows, 8 columns per pass; ahead, early). pdl:
    FP4_PDL, and every launch a programmatic dependent of the stream's preceding kernel (cuLaunchKernelEx): for a
    down launched right after an `Fp4GateUpMultiCuda(pdl=True)`. wps: FP4_WPS as in `Fp4DownCuda`; mad: FP4_DECODE_MAD."""

    def __init__(self, ahead: int = 2, early: bool = False, pdl: bool = False, device: int | None = None,
                 wps: int = 32, mad: bool = False) -> None:
        w2_down.check_wps(wps)
        self.ahead, self.early, self.pdl, self.wps, self.mad = ahead, early, pdl, wps, mad
        defines = {"FP4_AHEAD": ahead, "FP4_EARLY": int(early), "FP4_PDL": int(pdl)} | _mad_define(mad)
        super().__init__(DOWN_KERNEL, defines | ({"FP4_WPS": 16} if wps == 16 else {}), device)

    def __call__(self, fp4, layer: int, ws, out=None):
        out = ws.y if out is None else out
        check_down_inputs(fp4, ws, out, self.wps)
        smem = shared_bytes(w2_down.act_k(fp4.layout), DOWN_COLS)
        self.kernel.allow_shared(smem)
        grid, stream = (ws.block_expert.numel(), fp4.layout.hidden // DOWN_ROWS_PER_BLOCK), torch.cuda.current_stream()
        args = down_launch_args(fp4, layer, ws, out)
        if self.pdl:
            w2_down.launch_dependent(self.kernel, grid, (DOWN_THREADS,), smem, stream.cuda_stream, DOWN_ARG_KINDS, args)
        else:
            self.kernel.launch(grid, (DOWN_THREADS,), smem, stream.cuda_stream, DOWN_ARG_KINDS, args)
        return out
