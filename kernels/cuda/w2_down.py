"""CUDA C++ W2 down GEMM for decode (w2_down.cu) and its plain-torch reference.

`W2DownCuda()(w2, fp4, layer, ws)` computes what `moe_down` computes for the W2-resident pairs of a BT = 1
workspace (after `moe_route` and a gate_up stage): ws.y[pair] = W2_e ws.act[pair] (float32), or into `out`
[P, H] float32 when given. The y rows of an FP4-resident expert's pairs are written as NaN (the CUDA path
computes no FP4 pair: kernels/cuda/w2_moe.py); missing experts' rows are left untouched (the combine does not
read them).

A build reads one tile width of the w2 matrix (`wps`, kernels/layout.py): 32 words per bit slot when inter is a
multiple of 512 (DeepSeek-V3's 2048), else 16 (ds-v2-lite's 1408, qwen3-30b-a3b's 768; w2_half_tiles.cuh), whose
build reads two 16-word tiles as one 32-word tile. `wps_of(layout)` says which a pool needs.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ..layout import SlotLayout, unpack_matrix_ref
from . import loader, w2_gate_up

SOURCE = Path(__file__).with_name("w2_down.cu")
KERNEL = "w2_down_mma"
THREADS = 128
ROWS_PER_GROUP = 16  # one mma A tile per warp and group
# act, stride_act, slots, slot_bytes, words_off, scales_off, words_per_row, blocks_per_row, w2_table, f4_table,
# table_row, block_expert, block_pairs, num_blocks, y, stride_y, inter
ARG_KINDS = "pqpqqqiippippppqi"


def rows_per_block(groups: int) -> int:
    return 4 * groups * ROWS_PER_GROUP  # kWarps * kGroups * kRowsPerGroup in the .cu


def build_defines(ahead: int, groups: int, early: bool = False, route_major: bool = False, pdl: bool = False,
                  wps: int = 32, mad: bool = False, pair_order: bool = False, stream: bool = False,
                  prefetch: bool = False, stage: bool = False) -> dict:
    """nvcc defines of a build (the v3 / v5 / pair-order / stream ones and W2_WPS only when not the default: the
    default's command is the one before they existed)."""
    defines = (w2_gate_up.build_defines(ahead, early, route_major, pdl, mad, pair_order, stream, prefetch, stage)
               | {"W2_GROUPS": groups})
    return defines | {"W2_WPS": 16} if wps == 16 else defines


def wps_of(layout: SlotLayout) -> int:
    """Words per bit slot of the w2 matrix of `layout`: the `wps` a down kernel for its pool is built with."""
    return layout.w2.wps


def check_wps(wps: int) -> None:
    if wps not in (16, 32):
        raise ValueError(f"wps (words per bit slot of the w2 matrix) is 32 or 16, got {wps}")


def act_k(layout: SlotLayout) -> int:
    """K of the activation pairs a down block stages in shared memory: inter, or with 16-word tiles 32 words' worth
    per pair of them (W2 512, FP4 256; zero past inter)."""
    return -(-layout.w2.words_per_row // 32) * 32 * layout.values_per_word


# cuLaunchKernelEx with programmatic stream serialization (W2DownCuda(pdl=True)); layouts as cuda.h (CUDA 12 / 13),
# checked against the header by a CPU test where nvcc exists.
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class LaunchAttribute(ctypes.Structure):
    """CUlaunchAttribute: the attribute id, 4 bytes of padding, the 64-byte CUlaunchAttributeValue union."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_ubyte * 64)]


class LaunchConfig(ctypes.Structure):
    """CUlaunchConfig."""
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


def programmatic_config(grid, block, shared_bytes: int, stream: int) -> tuple[LaunchConfig, LaunchAttribute]:
    """A launch config whose one attribute allows programmatic stream serialization (the value's int field = 1):
    the kernel may start before the preceding kernel on the stream completes and resolves the dependency itself
    (griddepcontrol.wait). Returns the attribute too: keep it alive until the launch."""
    attr = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1  # programmaticStreamSerializationAllowed (int, little-endian)
    cfg = LaunchConfig(shared_bytes=shared_bytes, stream=stream, num_attrs=1)
    cfg.grid[:] = (tuple(grid) + (1, 1))[:3]
    cfg.block[:] = (tuple(block) + (1, 1))[:3]
    cfg.attrs = ctypes.pointer(attr)
    return cfg, attr


def launch_dependent(kernel, grid, block, shared_bytes: int, stream: int, kinds: str, values) -> None:
    """Launch `kernel` (a loader.Kernel) as a programmatic dependent of the stream's preceding kernel
    (cuLaunchKernelEx with `programmatic_config`); a kernel so launched resolves the dependency itself
    (griddepcontrol.wait)."""
    params, _held = loader.pack_args(kinds, values)
    cfg, _attr = programmatic_config(grid, block, shared_bytes, stream)
    loader.driver().check("cuLaunchKernelEx", ctypes.byref(cfg), kernel.function, params, None)


def check_geometry(layout: SlotLayout, groups: int = 1) -> None:
    """The shapes the kernels support (every inter: a build per tile width, `wps_of`)."""
    if layout.values_per_word != 16:
        raise ValueError("the CUDA down reads W2 slots only")
    if layout.hidden % rows_per_block(groups):
        raise ValueError(f"hidden must be a multiple of {rows_per_block(groups)} ({groups} row group(s)), "
                         f"got {layout.hidden}")


def launch_args(w2, fp4, layer: int, ws, out, topk_ids=None) -> list:
    """The kernel's arguments in ARG_KINDS order (pointers as ints); topk_ids: a pair-order launch's."""
    return [ws.act.data_ptr(), ws.act.stride(0), *w2_gate_up.slot_args(w2, (w2, fp4), layer, "w2"),
            *w2_gate_up.route_words(ws, topk_ids), out.data_ptr(), out.stride(0), w2.layout.inter]


def check_build(layout: SlotLayout, groups: int, wps: int) -> None:
    """check_geometry, and that a build for `wps`-word tiles reads this pool's w2 matrix."""
    check_geometry(layout, groups)
    if wps_of(layout) != wps:
        raise ValueError(f"this down kernel was built for {wps}-word tiles; the pool's w2 matrix (inter {layout.inter}) "
                         f"has {wps_of(layout)}-word tiles: build it with wps={wps_of(layout)}")


def _check_inputs(w2, fp4, ws, out, groups: int, wps: int = 32) -> None:
    check_build(w2.layout, groups, wps)
    if ws.block_tokens != 1:
        raise ValueError(f"the CUDA down runs one pair per block (block_tokens 1), got {ws.block_tokens}")
    check_tensors(w2, fp4, ws, out)


def check_tensors(w2, fp4, ws, out) -> None:
    """dtypes, shapes and strides of ws.act and `out` (shared with the multi-token kernel, w2_multi.py)."""
    check_act_out(ws, out)
    if fp4.table.shape != w2.table.shape:
        raise ValueError("the W2 and FP4 tables must have the same shape")


def check_act_out(ws, out) -> None:
    """ws.act [P, I] bf16 and out [P, H] float32: CUDA act, unit inner strides, 16-byte aligned act rows (also
    fp4_stages.py)."""
    if ws.act.dtype != torch.bfloat16 or not ws.act.is_cuda or ws.act.stride(1) != 1 or ws.act.stride(0) % 8:
        raise ValueError("act must be a bfloat16 CUDA tensor [P, I] with unit inner stride, 16-byte aligned rows")
    if out.dtype != torch.float32 or out.shape != ws.y.shape or out.stride(1) != 1:
        raise ValueError(f"out must be float32 [P, H] = {tuple(ws.y.shape)} with unit inner stride")


class W2DownCuda:
    """Builds (nvcc, cached) and loads the kernel once; each call launches it on the current stream.

    ahead: K tiles of weight loads in flight per lane while one is computed (W2_AHEAD); groups: 16-row groups
    per warp (W2_GROUPS; rows per block = 64 * groups). Neither changes the arithmetic (same bytes).
    early / route_major: the v3 defines W2_EARLY / W2_ROUTE_MAJOR as in `W2GateUpCuda` (off: the build as before);
    pdl: W2_PDL and every launch a programmatic dependent of the stream's preceding kernel (cuLaunchKernelEx): the
    prologue and first weight loads may overlap that kernel's tail, act is read after `griddepcontrol.wait`;
    pairs_grid: P route blocks in the grid instead of max_blocks (w2_gate_up.route_blocks_grid); wps: the w2 matrix's
    words per bit slot this build reads (32, or 16 for an inter not a multiple of 512: `wps_of`); mad: the v5 decode
    (W2_DECODE_MAD, as in `W2GateUpCuda`; same bytes); pair_order: W2_PAIR_ORDER, one block per routed pair read
    from the topk_ids each call passes (as in `W2GateUpCuda`; same bytes); stream: W2_STREAM, arena rows read over
    the bus for pairs without a slot (as in `W2GateUpCuda`; same bytes); prefetch: W2_STREAM_PREFETCH (as in
    `W2GateUpCuda`); stage: W2_STREAM_STAGE, a streamed block's rows staged in shared memory first (as in
    `W2GateUpCuda`: `shared_bytes`; same bytes); stage_carveout: as in `W2GateUpCuda`.
    """

    def __init__(self, ahead: int = 2, groups: int = 1, device: int | None = None, early: bool = False,
                 route_major: bool = False, pdl: bool = False, pairs_grid: bool = False, wps: int = 32,
                 mad: bool = False, pair_order: bool = False, stream: bool = False, prefetch: bool = False,
                 stage: bool = False, stage_carveout: str = "max") -> None:
        if pdl and not early:
            raise ValueError("pdl needs early (W2_PDL builds on W2_EARLY's FP4 branch)")
        check_wps(wps)
        defines = build_defines(ahead, groups, early, route_major, pdl, wps, mad, pair_order, stream, prefetch, stage)
        self.device = torch.cuda.current_device() if device is None else device
        torch.cuda.init()
        self.ahead, self.groups, self.early, self.route_major, self.pdl = ahead, groups, early, route_major, pdl
        self.pairs_grid, self.wps, self.mad, self.pair_order, self.stream = pairs_grid, wps, mad, pair_order, stream
        self.stage = stage
        self.kernel = loader.load(loader.build(SOURCE, defines), KERNEL, self.device)
        self._fit = w2_gate_up.ask_stage_carveout(self.kernel, stage_carveout) if stage else None

    def shared_bytes(self, layout: SlotLayout) -> int:
        """Dynamic shared memory of a launch: the activation pairs (K / 2 x 4 bytes), then, in a stream stage build
        where it fits, a stage of a block's rows and their scales."""
        base = 2 * act_k(layout)
        if not self.stage:
            return base
        m = layout.w2
        rows = rows_per_block(self.groups)
        return base + w2_gate_up.stream_stage_bytes(rows * (4 * m.words_per_row + m.blocks_per_row), base)

    def __call__(self, w2, fp4, layer: int, ws, out=None, topk_ids=None):
        out = ws.y if out is None else out
        _check_inputs(w2, fp4, ws, out, self.groups, self.wps)
        if self.pair_order:
            w2_gate_up.check_topk_ids(topk_ids, ws)
        grid = (w2_gate_up.route_blocks_grid(ws, self.pairs_grid, self.pair_order),
                w2.layout.hidden // rows_per_block(self.groups))
        smem = self.shared_bytes(w2.layout)
        self.kernel.allow_shared(smem)
        if self._fit is not None:
            self._fit.launch(smem)
        stream = torch.cuda.current_stream().cuda_stream
        args = (launch_args(w2, fp4, layer, ws, out, topk_ids if self.pair_order else None)
                + w2_gate_up.stream_args(w2, self.stream))
        kinds = ARG_KINDS + "p" * self.stream
        if self.pdl:
            launch_dependent(self.kernel, grid, (THREADS,), smem, stream, kinds, args)
        else:
            self.kernel.launch(grid, (THREADS,), smem, stream, kinds, args)
        return out

    def attributes(self) -> dict:
        return {name: self.kernel.attribute(name) for name in ("num_regs", "local_bytes", "shared_bytes", "max_threads")}


def w2_down_ref(act: torch.Tensor, topk_ids: torch.Tensor, w2, fp4, layer: int) -> torch.Tensor:
    """Plain torch: float32 [P, H], row p = W2_e act[p] for W2-resident pairs (e = topk_ids.flat[p] with no FP4
    slot), NaN elsewhere. Weights from `unpack_matrix_ref`, float32 arithmetic on act's values."""
    ids = topk_ids.reshape(-1).tolist()
    out = torch.full((len(ids), w2.layout.hidden), float("nan"), dtype=torch.float32, device=act.device)
    for p, e in enumerate(ids):
        slot = int(w2.table[layer, e])
        if slot < 0 or int(fp4.table[layer, e]) >= 0:
            continue
        out[p] = unpack_matrix_ref(w2.slots[slot], w2.layout, "w2") @ act[p].float()  # [H, I] @ [I]
    return out
