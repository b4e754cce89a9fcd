"""kernels/cuda: the CUDA C++ W2 gate_up (w2_gate_up.cu) and down (w2_down.cu), their loader, the opt-in
`moe_mm(..., cuda_w2=W2MoeCuda())` and a numpy model of the kernels.

CPU: argument packing and the kernel signatures, the kernels compiling without spills (where nvcc exists),
a numpy model that follows the .cu files step by step (lane loads, LOP3/LEA.HI decode, scale pairs, the
shared-memory activation pairs, mma.m16n8k16 fragments as the PTX ISA defines them) against the references,
and the moe_mm switch with a stand-in in the Triton interpreter. The model checks the index and bit
arithmetic, not the hardware; the GPU tests run the kernels themselves.
"""

from __future__ import annotations

import ctypes
import re
import subprocess

import numpy as np
import pytest
import torch

from tests.cuda_fixtures import (M32, bench_module, bench_on_cpu, bf16_bits, captured, down_ref, fp4_pool,
                                  gate_up_into_nan, gate_up_ref,
                                  launched_twice, needs_nvcc, placed, ptxas_report, random_pool, registers,
                                  replayed_once, run_whole, same_bytes, side_stream, signature_kinds, slot_rows, stub_builds,
                                  to_cuda, w2_pool, warm_up)
from tierstore.kernels import (MissLog, MoeWorkspace, fp4_tier, moe_down, moe_gate_up, moe_mm, moe_mm_ref, moe_route,
                               w2_tier)
from tierstore.kernels.cuda import loader, w2_down
from tierstore.kernels.cuda.w2_down import W2DownCuda, w2_down_ref
from tierstore.kernels.cuda.w2_gate_up import (ARG_KINDS, SOURCE, W2GateUpCuda, check_geometry, launch_args,
                                               w2_gate_up_ref)
from tierstore.kernels.cuda.w2_moe import W2MoeCuda
from tierstore.kernels.layout import unpack_matrix_ref, w2_slot_layout

HIDDEN, INTER, EXPERTS, TOP_K = 1024, 64, 8, 2
DOWN_INTER = 1024  # the down kernel's K: two 512-K tiles, so the ring crosses tile and group boundaries


# ---- host side -------------------------------------------------------------------------------------------


def test_arg_kinds_match_the_kernel_signature_and_launch_args():
    assert signature_kinds(SOURCE.read_text()) == ARG_KINDS + "p"  # + stream_at, under W2_STREAM only
    w2 = w2_tier(HIDDEN, INTER, 2, 1, EXPERTS, "cpu")
    f4 = fp4_tier(HIDDEN, INTER, 1, 1, EXPERTS, "cpu")
    ws = MoeWorkspace.allocate(1, TOP_K, EXPERTS, HIDDEN, INTER, torch.bfloat16, "cpu", block_tokens=1)
    x = torch.zeros(1, HIDDEN, dtype=torch.bfloat16)
    args = launch_args(x, TOP_K, w2, f4, 0, ws, ws.act, None)
    assert len(args) == len(ARG_KINDS)
    for kind, value in zip(ARG_KINDS, args):
        assert isinstance(value, float if kind == "f" else int)
    assert args[-2:] == [0.0, 0] and launch_args(x, TOP_K, w2, f4, 0, ws, ws.act, 2.5)[-2:] == [2.5, 1]


def test_pack_args_points_at_each_value():
    array, held = loader.pack_args("piqf", [0x7F00_1234_5678, -7, -(1 << 40), 1.5])
    read = [ctypes.cast(array[j], ctypes.POINTER(t)).contents.value
            for j, t in enumerate((ctypes.c_uint64, ctypes.c_int32, ctypes.c_int64, ctypes.c_float))]
    assert read == [0x7F00_1234_5678, -7, -(1 << 40), 1.5] and len(held) == 4
    with pytest.raises(TypeError):
        loader.pack_args("i", [1.0])
    with pytest.raises(ValueError):
        loader.pack_args("pi", [1])


def test_down_arg_kinds_match_the_kernel_signature_and_launch_args():
    assert signature_kinds(w2_down.SOURCE.read_text(), w2_down.KERNEL) == w2_down.ARG_KINDS + "p"  # + stream_at
    w2 = w2_tier(HIDDEN, DOWN_INTER, 2, 1, EXPERTS, "cpu")
    f4 = fp4_tier(HIDDEN, DOWN_INTER, 1, 1, EXPERTS, "cpu")
    ws = MoeWorkspace.allocate(1, TOP_K, EXPERTS, HIDDEN, DOWN_INTER, torch.bfloat16, "cpu", block_tokens=1)
    args = w2_down.launch_args(w2, f4, 0, ws, ws.y)
    assert len(args) == len(w2_down.ARG_KINDS) and all(isinstance(v, int) for v in args)
    assert args[4:8] == [w2.layout.w2_words_offset, w2.layout.w2_scales_offset, DOWN_INTER // 16, DOWN_INTER // 32]
    assert args[-3:] == [ws.y.data_ptr(), HIDDEN, DOWN_INTER]


def test_geometry_limits():
    check_geometry(w2_slot_layout(7168, 2048))
    with pytest.raises(ValueError, match="multiple of 512"):
        check_geometry(w2_slot_layout(1280, 64))
    for groups in (1, 2):
        w2_down.check_geometry(w2_slot_layout(7168, 2048), groups)  # DeepSeek-V3
    w2_down.check_geometry(w2_slot_layout(2048, 768))  # 16-word tiles: a build with wps 16 reads them
    with pytest.raises(ValueError, match="built for 32-word tiles; the pool's w2 matrix \\(inter 768\\) has 16-word "
                                         "tiles: build it with wps=16"):
        w2_down.check_build(w2_slot_layout(2048, 768), 1, 32)
    with pytest.raises(ValueError, match="multiple of 128"):
        w2_down.check_geometry(w2_slot_layout(1088, 512), 2)


@needs_nvcc
@pytest.mark.parametrize("ahead", [1, 2])
def test_kernel_compiles_without_spills(tmp_path, ahead):
    report = ptxas_report(SOURCE, tmp_path / "k.cubin", {"W2_AHEAD": ahead})
    assert "0 bytes spill stores" in report and registers(report) <= 128  # 4 blocks of 128 threads per SM


@needs_nvcc
@pytest.mark.parametrize("ahead,groups", [(2, 1), (2, 2)])
def test_down_kernel_compiles_without_spills(tmp_path, ahead, groups):
    report = ptxas_report(w2_down.SOURCE, tmp_path / "k.cubin", {"W2_AHEAD": ahead, "W2_GROUPS": groups})
    assert "0 bytes spill stores" in report and registers(report) <= 128


# ---- numpy model of w2_gate_up.cu ------------------------------------------------------------------------

def prmt(a: int, b: int, sel: int) -> int:
    """__byte_perm(a, b, sel) for selectors without the sign-replicate bit."""
    both = (b << 32) | a
    return sum(((both >> (8 * ((sel >> (4 * n)) & 7))) & 0xFF) << (8 * n) for n in range(4))


def rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & M32 if r else x


def scale_pair(q: list[int], i: int) -> int:
    return (prmt(q[i >> 1], 0, 0x4342 if i & 1 else 0x4140) << 7) & M32


def w2_pair(w: int, i: int, scale: int) -> int:
    rot = (8 - 2 * i) & 31
    mask = rotl(0x81008100, (32 - rot) & 31)
    return (rotl(w & mask, rot) + scale) & M32


def bf16_halves(p: int) -> tuple[float, float]:
    as_f32 = lambda bits: float(np.array([bits], dtype=np.uint32).view(np.float32)[0])
    return as_f32((p & 0xFFFF) << 16), as_f32(p & 0xFFFF0000)


def unit_pairs(x_bits: list[int], q: int) -> list[int]:
    """`store_unit(load_unit(x, q))`: the 8 pairs of unit q, in the order they land at xp[8q ..]."""
    ti, c = q >> 2, q & 3
    k = (ti >> 3) * 512 + (ti & 7) * 64 + 4 * c
    out = []
    for m in range(4):
        out += [x_bits[k + m] | (x_bits[k + 32 + m] << 16), x_bits[k + 16 + m] | (x_bits[k + 48 + m] << 16)]
    return out


def build_pairs(x_bits: list[int], k_len: int) -> list[int]:
    xp = [0] * (k_len // 2)
    for q in range(k_len // 16):
        xp[q * 8: q * 8 + 8] = unit_pairs(x_bits, q)
    return xp


def put_a(a_mat: np.ndarray, lo, hi, lo_scales, hi_scales, t: int, i: int, mm: int, g: int, c: int) -> None:
    """Lane (g, c)'s four A registers of K tile t, pair i, word mm into the 16 x 16 A tile: rows g (`lo`) and g + 8
    (`hi`), columns 2c and 2c + 8 (PTX ISA: A fragment of m16n8k16)."""
    sl, sh = scale_pair(lo_scales[g][4 * t: 4 * t + 4], i), scale_pair(hi_scales[g][4 * t: 4 * t + 4], i)
    a = (w2_pair(lo[g][32 * t + 4 * c + mm], i, sl), w2_pair(hi[g][32 * t + 4 * c + mm], i, sh),
         w2_pair(lo[g][32 * t + 16 + 4 * c + mm], i, sl), w2_pair(hi[g][32 * t + 16 + 4 * c + mm], i, sh))
    for reg, (row, col) in enumerate(((g, 2 * c), (g + 8, 2 * c), (g, 2 * c + 8), (g + 8, 2 * c + 8))):
        a_mat[row, col: col + 2] = bf16_halves(a[reg])


def warp_acc(lo, hi, lo_scales, hi_scales, xp, column_base, tiles, put=put_a) -> np.ndarray:
    """One warp's K loop: A rows 0..7 = `lo` (8 rows), 8..15 = `hi`; B column g read at xp[column_base[g] + ...] (the
    lane's xp_lane); the two accumulators [2, 16, 8] (words mm even / odd). `put`: the lanes' A registers of a tile
    (`put_a`; the 16-word tiles' model passes its own)."""
    acc = np.zeros((2, 16, 8))
    for t in range(tiles):
        for i in range(8):
            for mm in range(4):
                a_mat, b_mat = np.zeros((16, 16)), np.zeros((16, 8))
                for lane in range(32):
                    g, c = lane >> 2, lane & 3
                    put(a_mat, lo, hi, lo_scales, hi_scales, t, i, mm, g, c)
                    at = column_base[g] + t * 256 + i * 32 + 8 * c + 2 * mm
                    for reg in range(2):
                        b_mat[2 * c + 8 * reg: 2 * c + 8 * reg + 2, g] = bf16_halves(xp[at + reg])  # B: column g
                acc[mm & 1] += a_mat @ b_mat
    return acc


def warp_mma(lo, hi, lo_scales, hi_scales, xp, tiles) -> tuple[np.ndarray, np.ndarray]:
    """One warp's K loop as both .cu files run it (every B column the same pairs); returns the D columns the storing
    lanes read: rows g (lane (g, 0), d0 = column 0) and g + 8 (d2 of lane (g, 0) in w2_gate_up.cu, of lane (g, 1) =
    column 2 in w2_down.cu: the columns are equal)."""
    acc = warp_acc(lo, hi, lo_scales, hi_scales, xp, [0] * 8, tiles)
    assert np.all(acc[:, :, 0] == acc[:, :, 2])  # B is the same in every column
    return acc[:, :8, 0].sum(0), acc[:, 8:, 2].sum(0)


def _pairs(v: torch.Tensor) -> list[int]:
    return build_pairs(bf16_bits(v), v.numel())


def model_gate_up(slot: torch.Tensor, layout, x: torch.Tensor) -> np.ndarray:
    """float64 [I]: what w2_gate_up_mma writes (before bf16 rounding) for one pair, lane by lane."""
    words, scales = slot_rows(slot, layout, "w13")
    xp, inter, out = _pairs(x), layout.inter, np.zeros(layout.inter)
    for n0 in range(0, inter, 8):  # one warp: gate rows n0.., up rows n0 + I..
        gate_v, up_v = warp_mma(words[n0: n0 + 8], words[inter + n0: inter + n0 + 8], scales[n0: n0 + 8],
                                scales[inter + n0: inter + n0 + 8], xp, layout.w13.words_per_row // 32)
        out[n0: n0 + 8] = gate_v / (1 + np.exp(-gate_v)) * up_v
    return out


def model_down(slot: torch.Tensor, layout, act: torch.Tensor) -> np.ndarray:
    """float64 [H]: what w2_down_mma writes for one pair, lane by lane (a row group of 16 = one mma A tile)."""
    words, scales = slot_rows(slot, layout, "w2")
    xp, out = _pairs(act), np.zeros(layout.hidden)
    for n0 in range(0, layout.hidden, 16):
        out[n0: n0 + 8], out[n0 + 8: n0 + 16] = warp_mma(words[n0: n0 + 8], words[n0 + 8: n0 + 16], scales[n0: n0 + 8],
                                                          scales[n0 + 8: n0 + 16], xp, layout.w2.words_per_row // 32)
    return out


def test_model_decode_is_exact_for_every_code_and_scale_byte():
    rng = np.random.default_rng(1)
    for s_lo in range(1, 241, 7):
        s_hi = 241 - s_lo
        q = [(s_lo | (s_hi << 8)) * 0x10001] * 4  # bytes 2i, 2i+1 of every pair: s_lo, s_hi
        for w in [int(v) for v in rng.integers(0, 1 << 32, 8, dtype=np.uint64)]:
            for i in range(8):
                lo, hi = bf16_halves(w2_pair(w, i, scale_pair(q, i)))
                for slot, got, s in ((2 * i, lo, s_lo), (2 * i + 1, hi, s_hi)):
                    mag_bit = (2 * (slot // 2) + 16 * (slot % 2)) % 32
                    level = (4.0 if (w >> mag_bit) & 1 else 1.0) * (-1.0 if (w >> ((mag_bit + 7) % 32)) & 1 else 1.0)
                    assert got == level * 2.0 ** (s - 127)


def test_model_of_the_kernel_matches_the_reference():
    gen = torch.Generator().manual_seed(3)
    w2 = w2_tier(HIDDEN, INTER, 1, 1, EXPERTS, "cpu")
    random_pool(w2, gen)
    x = torch.randn(HIDDEN, generator=gen).to(torch.bfloat16)
    w13 = unpack_matrix_ref(w2.slots[0], w2.layout, "w13").double()
    gate, up = (w13 @ x.double()).chunk(2)
    ref = (torch.nn.functional.silu(gate) * up).numpy()
    got = model_gate_up(w2.slots[0], w2.layout, x)
    assert np.abs(got - ref).max() <= 1e-9 * np.abs(ref).max()


def down_model_and_reference(model, hidden: int, inter: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(model(slot, layout, act), the float64 product of the unpacked w2 and act) for a random W2 slot (every word and
    scale byte random, padding included) and random bf16 activations [inter]."""
    gen = torch.Generator().manual_seed(seed)
    w2 = w2_tier(hidden, inter, 1, 1, EXPERTS, "cpu")
    random_pool(w2, gen)
    act = torch.randn(inter, generator=gen).to(torch.bfloat16)
    ref = (unpack_matrix_ref(w2.slots[0], w2.layout, "w2").double() @ act.double()).numpy()
    return model(w2.slots[0], w2.layout, act), ref


def test_model_of_the_down_kernel_matches_the_reference():
    got, ref = down_model_and_reference(model_down, 128, DOWN_INTER, 4)
    assert np.abs(got - ref).max() <= 1e-9 * np.abs(ref).max()


# ---- the moe_mm switch (CPU, Triton interpreter, a stand-in for W2MoeCuda) -----------------------------------

class _ReferenceStages:
    """Stands in for W2MoeCuda: act and y of the W2 pairs from the route output (plain torch), NaN y rows for
    FP4 pairs, as the CUDA kernels write them."""

    def __init__(self):
        self.calls = 0

    def __call__(self, hidden, top_k, w2, fp4, layer, ws, swiglu_limit=None):
        self.calls += 1
        for expert, pair in placed(ws):
            if int(fp4.table[layer, expert]) >= 0:
                ws.y[pair] = float("nan")
                continue
            slot = w2.slots[int(w2.table[layer, expert])]
            ws.act[pair] = gate_up_ref(slot, w2.layout, hidden[pair // top_k], swiglu_limit).to(ws.act.dtype)
            ws.y[pair] = down_ref(slot, w2.layout, ws.act[pair])


def _switch_case(gen, fp4_expert=None):
    w2 = w2_pool(HIDDEN, INTER, EXPERTS, gen, missing=5)  # expert 5 missing: its pairs are misses
    f4 = fp4_pool(HIDDEN, INTER, EXPERTS, fp4_expert)
    ids = torch.tensor([[5, 1], [2, 5], [0, 7]], dtype=torch.int32)
    weights = torch.rand(3, TOP_K, generator=gen) + 0.05
    x = torch.randn(3, HIDDEN, generator=gen)
    return w2, f4, ids, weights, x


def test_moe_mm_cuda_w2_switch_runs_the_stand_in_between_route_and_combine():
    gen = torch.Generator().manual_seed(6)
    w2, f4, ids, weights, x = _switch_case(gen)
    outs, counts = [], []
    for cuda_w2 in (None, _ReferenceStages()):
        ws = MoeWorkspace.allocate(3, TOP_K, EXPERTS, HIDDEN, INTER, x.dtype, "cpu", block_tokens=1)
        misses = MissLog.allocate(4, "cpu")
        outs.append(moe_mm(x, ids, weights, w2, f4, 0, misses, ws, cuda_w2=cuda_w2))
        counts.append((misses.counts.tolist(), misses.entries[:1].tolist()))
        if cuda_w2 is not None:
            assert cuda_w2.calls == 1
    ref, missing_pairs, missing = moe_mm_ref(x, ids, weights, w2, f4, 0, act_dtype=x.dtype)
    assert counts[0] == counts[1] == ([missing_pairs, len(missing)], [[0, 5]])  # misses counted once, by the route
    for out in outs:
        assert float((out - ref).norm() / ref.norm()) <= 1e-5


def test_moe_mm_cuda_w2_marks_an_fp4_pair_with_nan():
    gen = torch.Generator().manual_seed(7)
    w2, f4, ids, weights, x = _switch_case(gen, fp4_expert=7)
    ws = MoeWorkspace.allocate(3, TOP_K, EXPERTS, HIDDEN, INTER, x.dtype, "cpu", block_tokens=1)
    out = moe_mm(x, ids, weights, w2, f4, 0, MissLog.allocate(4, "cpu"), ws, cuda_w2=_ReferenceStages())
    assert out[2].isnan().all() and not out[:2].isnan().any()  # token 2 routes to expert 7 (FP4)


# ---- the kernels on a GPU ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_case():
    gen = torch.Generator().manual_seed(5)
    w2 = w2_pool(HIDDEN, INTER, EXPERTS, gen)
    f4 = fp4_pool(HIDDEN, INTER, EXPERTS, 3)  # expert 3 is FP4-resident: not the W2 kernel's work
    return dict(w2=to_cuda(w2), f4=to_cuda(f4), cuda=W2GateUpCuda(), cuda2=W2GateUpCuda(ahead=2), gen=gen)


def _routed(case, tokens, limit=None):
    ids = torch.stack([torch.randperm(EXPERTS, generator=case["gen"])[:TOP_K] for _ in range(tokens)])
    ids = ids.to(torch.int32).contiguous().cuda()
    ids[0, 0] = 3
    x = torch.randn(tokens, HIDDEN, generator=case["gen"]).to(torch.bfloat16).cuda()
    ws = MoeWorkspace.allocate(tokens, TOP_K, EXPERTS, HIDDEN, INTER, torch.bfloat16, "cuda", block_tokens=1)
    moe_route(ids, case["w2"], case["f4"], 0, MissLog.allocate(4, "cuda"), ws)
    ref = w2_gate_up_ref(x, ids, case["w2"], case["f4"], 0, swiglu_limit=limit)
    return x, ws, ref


def _run(case, x, ws, limit=None, kernel="cuda"):
    return gate_up_into_nan(case[kernel], x, TOP_K, case["w2"], case["f4"], ws, limit)


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_cuda_gate_up_matches_reference_and_triton(gpu_case, tokens):
    x, ws, ref = _routed(gpu_case, tokens)
    out = _run(gpu_case, x, ws)
    w2_rows = ~ref.isnan().any(dim=1)
    assert out[~w2_rows].isnan().all() and not out[w2_rows].isnan().any()  # FP4 pairs untouched, W2 rows written
    rel = float((out[w2_rows].float() - ref[w2_rows]).norm() / ref[w2_rows].norm())
    assert rel <= 1e-2
    assert same_bytes(out, _run(gpu_case, x, ws))  # repeat launch
    assert same_bytes(out, _run(gpu_case, x, ws, kernel="cuda2"))  # prefetch depth changes no arithmetic
    ws.act.fill_(float("nan"))
    moe_gate_up(x, TOP_K, gpu_case["w2"], gpu_case["f4"], 0, ws)
    tri = ws.act[w2_rows].float()
    assert float((out[w2_rows].float() - tri).norm() / tri.norm()) <= 1e-2


@pytest.mark.gpu
@needs_nvcc
def test_cuda_gate_up_clamps_with_a_limit(gpu_case):
    x, ws, ref = _routed(gpu_case, 2, limit=0.75)
    out = _run(gpu_case, x, ws, limit=0.75)
    rows = ~ref.isnan().any(dim=1)
    assert float((out[rows].float() - ref[rows]).norm() / ref[rows].norm()) <= 1e-2


@pytest.mark.gpu
@needs_nvcc
def test_cuda_gate_up_replays_in_a_cuda_graph(gpu_case):
    x, ws, _ = _routed(gpu_case, 4)
    eager = _run(gpu_case, x, ws)
    out = torch.full_like(ws.act, float("nan"))
    graph = captured(lambda: gpu_case["cuda"](x, TOP_K, gpu_case["w2"], gpu_case["f4"], 0, ws, out=out), side_stream())
    graph.replay()
    torch.cuda.synchronize()
    assert same_bytes(out, eager)


@pytest.fixture(scope="module")
def down_case():
    """HIDDEN x DOWN_INTER pools: expert 3 FP4-resident (f4_with), expert 6 missing; kernels and whole-op paths."""
    gen = torch.Generator().manual_seed(8)
    w2 = w2_pool(HIDDEN, DOWN_INTER, EXPERTS, gen, (112, 124), missing=6)
    f4_with, f4_none = fp4_pool(HIDDEN, DOWN_INTER, EXPERTS, 3), fp4_pool(HIDDEN, DOWN_INTER, EXPERTS)
    return dict(w2=to_cuda(w2), f4_with=to_cuda(f4_with), f4_none=to_cuda(f4_none), gen=gen,
                down={(a, g): W2DownCuda(ahead=a, groups=g) for a, g in ((2, 1), (2, 2), (1, 1))},
                whole={g: W2MoeCuda(down_groups=g) for g in (1, 2)})


def _ids(case, tokens, first=None, last=None):
    """Random distinct experts per token; `first` placed at [0, 0], `last` at [-1, -1] (still distinct per row:
    drawn from a permutation and moved into place)."""
    rows = []
    for t in range(tokens):
        perm = torch.randperm(EXPERTS, generator=case["gen"]).tolist()
        for value, at in ((first, 0 if t == 0 else None), (last, TOP_K - 1 if t == tokens - 1 else None)):
            if value is not None and at is not None:
                j = perm.index(value)
                perm[at], perm[j] = perm[j], perm[at]
        rows.append(perm[:TOP_K])
    return torch.tensor(rows, dtype=torch.int32).cuda()


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens", [3, 5, 8])
def test_cuda_down_matches_reference_and_triton(down_case, tokens):
    w2, f4 = down_case["w2"], down_case["f4_with"]
    ids = _ids(down_case, tokens, first=3, last=6)  # an FP4 pair and a missing pair
    ws = MoeWorkspace.allocate(tokens, TOP_K, EXPERTS, HIDDEN, DOWN_INTER, torch.bfloat16, "cuda", block_tokens=1)
    moe_route(ids, w2, f4, 0, MissLog.allocate(4, "cuda"), ws)
    ws.act.copy_(torch.randn(ws.act.shape, generator=down_case["gen"]).to(torch.bfloat16))
    outs = launched_twice(down_case["down"], ws.y, -7.0, lambda kernel, out: kernel(w2, f4, 0, ws, out=out))
    torch.cuda.synchronize()
    ref = w2_down_ref(ws.act, ids, w2, f4, 0)
    flat = ids.reshape(-1).cpu()
    fp4_rows, missing_rows = flat == 3, flat == 6
    w2_rows = ~(fp4_rows | missing_rows)
    assert w2_rows.any() and fp4_rows.any() and missing_rows.any()
    first = outs[(2, 1)][0]
    assert first[fp4_rows.cuda()].isnan().all() and (first[missing_rows.cuda()] == -7.0).all()
    got = first[w2_rows.cuda()]
    assert not got.isnan().any()
    assert float((got - ref[w2_rows.cuda()]).norm() / ref[w2_rows.cuda()].norm()) <= 1e-5  # fp32 sums of exact products
    for a, b in outs.values():
        assert same_bytes(a, first) and same_bytes(b, first)  # repeats, prefetch depth and row grouping
    ws.y.fill_(float("nan"))
    moe_down(TOP_K, w2, f4, 0, ws)  # Triton computes the FP4 pair too: compare the W2 rows
    tri = ws.y[w2_rows.cuda()]
    assert float((got - tri).norm() / tri.norm()) <= 1e-2


@pytest.mark.gpu
@needs_nvcc
def test_cuda_down_replays_in_a_cuda_graph(down_case):
    w2, f4 = down_case["w2"], down_case["f4_none"]
    ids = _ids(down_case, 4)
    ws = MoeWorkspace.allocate(4, TOP_K, EXPERTS, HIDDEN, DOWN_INTER, torch.bfloat16, "cuda", block_tokens=1)
    moe_route(ids, w2, f4, 0, MissLog.allocate(4, "cuda"), ws)
    ws.act.copy_(torch.randn(ws.act.shape, generator=down_case["gen"]).to(torch.bfloat16))
    kernel = down_case["down"][(2, 2)]
    eager = torch.full_like(ws.y, float("nan"))
    kernel(w2, f4, 0, ws, out=eager)
    out = torch.full_like(ws.y, float("nan"))
    graph = captured(lambda: kernel(w2, f4, 0, ws, out=out), side_stream())
    graph.replay()
    torch.cuda.synchronize()
    assert same_bytes(out, eager)


def _whole(case, f4, ids, x, cuda_w2, out=None, limit=None):
    return run_whole(x, ids, case["weights"][: ids.shape[0]], case["w2"], f4, cuda_w2, DOWN_INTER, EXPERTS, 4,
                     limit=limit, out=out)


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens,limit", [(1, None), (4, None), (8, None), (4, 0.75)])
def test_moe_mm_cuda_w2_matches_reference_with_misses(down_case, tokens, limit):
    f4 = down_case["f4_none"]
    down_case["weights"] = (torch.rand(8, TOP_K, generator=down_case["gen"]) + 0.05).cuda()
    ids = _ids(down_case, tokens, last=6)  # expert 6 is missing
    x = torch.randn(tokens, HIDDEN, generator=down_case["gen"]).to(torch.bfloat16).cuda()
    ref, missing_pairs, missing = moe_mm_ref(x, ids, down_case["weights"][:tokens], down_case["w2"], f4, 0,
                                             swiglu_limit=limit, act_dtype=torch.bfloat16)
    out, counts, entries = _whole(down_case, f4, ids, x, down_case["whole"][1], limit=limit)
    assert not out.isnan().any()
    assert float((out.float() - ref).norm() / ref.norm()) <= 1e-2
    assert counts == [missing_pairs, len(missing)] and [tuple(e) for e in entries[: len(missing)]] == missing
    again, counts2, _ = _whole(down_case, f4, ids, x, down_case["whole"][1], limit=limit)
    grouped, _, _ = _whole(down_case, f4, ids, x, down_case["whole"][2], limit=limit)
    assert same_bytes(out, again) and same_bytes(out, grouped) and counts2 == counts
    tri, tri_counts, _ = _whole(down_case, f4, ids, x, None, limit=limit)
    assert tri_counts == counts and float((out.float() - tri.float()).norm() / tri.float().norm()) <= 1e-2


@pytest.mark.gpu
@needs_nvcc
def test_moe_mm_cuda_w2_replays_in_a_cuda_graph(down_case):
    f4, tokens = down_case["f4_none"], 4
    down_case["weights"] = (torch.rand(8, TOP_K, generator=down_case["gen"]) + 0.05).cuda()
    ids = _ids(down_case, tokens, last=6)
    x = torch.randn(tokens, HIDDEN, generator=down_case["gen"]).to(torch.bfloat16).cuda()
    eager, counts, _ = _whole(down_case, f4, ids, x, down_case["whole"][2])
    ws = MoeWorkspace.allocate(tokens, TOP_K, EXPERTS, HIDDEN, DOWN_INTER, torch.bfloat16, "cuda", block_tokens=1)
    misses = MissLog.allocate(4, "cuda")
    out = torch.full_like(x, float("nan"))
    call = lambda: moe_mm(x, ids, down_case["weights"][:tokens], down_case["w2"], f4, 0, misses, ws, out=out,
                          cuda_w2=down_case["whole"][2])
    replayed_once(call, misses, out)  # Triton compiles outside capture
    assert same_bytes(out, eager) and misses.counts.tolist() == counts  # one replay counts the misses once


@pytest.mark.gpu
@needs_nvcc
def test_moe_mm_cuda_w2_gives_nan_rows_for_fp4_pairs(down_case):
    f4, tokens = down_case["f4_with"], 3
    down_case["weights"] = (torch.rand(8, TOP_K, generator=down_case["gen"]) + 0.05).cuda()
    ids = torch.tensor([[3, 0], [1, 2], [4, 5]], dtype=torch.int32).cuda()  # only token 0 routes to the FP4 expert
    x = torch.randn(tokens, HIDDEN, generator=down_case["gen"]).to(torch.bfloat16).cuda()
    out, _, _ = _whole(down_case, f4, ids, x, down_case["whole"][1])
    assert out[0].isnan().all() and not out[1:].isnan().any()
    ref, _, _ = moe_mm_ref(x, ids, down_case["weights"][:tokens], down_case["w2"], f4, 0, act_dtype=torch.bfloat16)
    assert float((out[1:].float() - ref[1:]).norm() / ref[1:].norm()) <= 1e-2


# ---- benchmarks/cuda_w2.py bookkeeping (no GPU) ----------------------------------------------------------

def _bench_module():
    return bench_module("cuda_w2")


def test_bench_marks_failed_checks_invalid_and_derives_ratios(capsys):
    bench = _bench_module()
    good = dict(rel_err=3e-3, rel_err_vs_triton=5e-3, nan=False, repeat_identical=True, same_bytes_as_first=True)
    checks = [dict(tokens=1, stage="gate_up", variants=dict(cuda_mma=good, cuda_mma_ahead2=dict(good, same_bytes_as_first=False))),
              dict(tokens=1, stage="whole", variants=dict(cuda_whole=dict(good, misses_equal_triton=True),
                                                           cuda_whole_g2=dict(good, misses_equal_triton=False)))]
    names = ("cuda_mma", "cuda_mma_ahead2", "cuda_whole", "cuda_whole_g2", "missing")
    invalid = {name: bench._invalid(checks, name) for name in names}
    assert invalid["cuda_mma"] == [] and invalid["cuda_whole"] == []
    assert "bytes differ" in invalid["cuda_mma_ahead2"][0] and "miss counts" in invalid["cuda_whole_g2"][0]
    assert invalid["missing"] == ["check did not run or raised"]
    assert bench._invalid([dict(variants=dict(cuda_mma=dict(good, rel_err=float("nan"))))], "cuda_mma")
    assert bench._invalid([dict(variants=dict(cuda_mma=dict(good, rel_err_vs_triton=0.02)))], "cuda_mma")
    row = lambda stage, variant, us, rnd=0: dict(tokens=1, stage=stage, variant=variant, round=rnd, us=us, bytes=66e6)
    rows = [row("gate_up", "cuda_mma", 25.0), row("gate_up", "cuda_mma", 24.0, 1), row("gate_up", "cuda_mma_ahead2", 20.0),
            row("gate_up", "triton_gate_up", 38.0), row("gate_up", "triton_gate_up", 40.0, 1),
            row("gate_up", "stream_read_gate_up", 18.0), row("whole", "cuda_whole", 60.0), row("whole", "triton_whole", 75.0),
            row("whole", "bf16_grouped_mm", 300.0)]
    bench._derive(rows, invalid, 4.8e12)
    assert rows[1]["triton_over_this"] == pytest.approx(38 / 24) and rows[1]["pct_of_stream"] == pytest.approx(75)
    assert rows[0]["pct_hbm"] == pytest.approx(100 * 66e6 / 25e-6 / 4.8e12)
    assert rows[2]["us"] is None and rows[2]["invalid_us"] == 20.0  # its check failed: time kept aside
    assert rows[6]["triton_over_this"] == pytest.approx(1.25) and rows[6]["bf16_over_this"] == pytest.approx(5.0)
    assert "pct_of_stream" not in rows[6] and "bf16_over_this" not in rows[0]
    rows.append(dict(row("gate_up", "cuda_mma", None, 1), error=dict(type="CudaError", message="cuLaunchKernel failed")))
    bench._print(dict(build={"cuda_mma": dict(ahead=1, num_regs=96)}, checks=checks, cases=rows, status="complete"))
    printed = capsys.readouterr().out
    assert "INVALID (20.0 us" in printed and "ERROR CudaError" in printed and "status: complete" in printed


class _ReferenceKernel:
    """Stands in for W2GateUpCuda in the CPU run of the benchmark: writes the reference from the route output."""

    def __call__(self, x, top_k, w2, f4, layer, ws, out):
        for expert, pair in placed(ws):
            if int(f4.table[layer, expert]) < 0:
                slot = w2.slots[int(w2.table[layer, expert])]
                out[pair] = gate_up_ref(slot, w2.layout, x[pair // top_k]).to(out.dtype)


class _ReferenceDown:
    """Stands in for W2DownCuda in the CPU run of the benchmark."""

    def __call__(self, w2, f4, layer, ws, out):
        for expert, pair in placed(ws):
            out[pair] = down_ref(w2.slots[int(w2.table[layer, expert])], w2.layout, ws.act[pair])


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton kernels in the CPU interpreter (set without CUDA)")
def _stand_in_build(stage, opts, multi, geo):
    """benchmarks/cuda_w2.py `_build` with the stand-ins for the CUDA kernels."""
    stand_in = {"gate_up": _ReferenceKernel, "down": _ReferenceDown, "whole": _ReferenceStages}
    return stand_in[stage](), dict(stage=stage, **opts)


def test_bench_runs_end_to_end_on_cpu_with_stand_in_kernels(monkeypatch):
    import argparse

    bench = _bench_module()
    kb = bench._bench_kernels()
    bench_on_cpu(monkeypatch, bench, kb, _stand_in_build, (EXPERTS, TOP_K, HIDDEN, INTER))
    result, emitted = {}, []
    bench.run(kb, argparse.Namespace(preset="tiny", tokens="1,2", reps=1, variants=None), result,
              lambda r: emitted.append(r["status"]))
    assert result["status"] == "complete" and not result["errors"], result["errors"]
    assert [(c["tokens"], c["stage"]) for c in result["checks"]] == [(t, s) for t in (1, 2) for s in ("gate_up", "down", "whole")]
    for check in result["checks"]:
        for name, v in check["variants"].items():
            assert bench._invalid([check], name) == [], (check["stage"], name, v)
    timed = {(r["tokens"], r["variant"], r["round"]): r for r in result["cases"]}
    assert len(timed) == 2 * 3 * (4 * bench.ROUNDS + 1)  # per stage 3 CUDA variants (one multi-token) and Triton
    for name in ("cuda_gate_up_multi", "cuda_down_multi", "cuda_whole_multi"):
        assert timed[(2, name, 1)]["block_tokens"] == 16 and timed[(2, name, 1)]["us"] == 10.0
        assert "same_bytes_as_single" in [c for c in result["checks"] if name in c["variants"]][0]["variants"][name]
    assert timed[(2, "cuda_mma_ahead2", 1)]["triton_over_this"] == 1.0
    assert timed[(2, "cuda_down_g2", 0)]["pct_of_stream"] == 50.0
    assert timed[(1, "cuda_whole", 1)]["bf16_over_this"] == 5.0
    assert timed[(1, "stream_read_gate_up", 0)]["pct_of_stream"] == 100.0


def test_bench_variants_keep_the_single_token_ones_first_and_filter_by_name():
    bench = _bench_module()
    every = bench._variants(None)
    for stage in ("gate_up", "down", "whole"):
        names = [name for s, name, _ in every if s == stage]
        assert names[0] == bench.FIRST[stage] and names[-1] == bench.MULTI[stage][0] and len(names) == 3
    picked = bench._variants("cuda_whole_multi,cuda_mma_ahead2")
    assert [name for _, name, _ in picked] == ["cuda_mma_ahead2", "cuda_whole_multi"]
    assert bench._block_tokens("cuda_whole_multi") == bench.MULTI_BT and bench._block_tokens("cuda_whole") == 1
    with pytest.raises(ValueError, match="unknown variant"):
        bench._variants("cuda_whole,nope")


def test_bench_build_records_each_variants_options(monkeypatch):
    """benchmarks/cuda_w2.py `_build` with stand-in kernel classes: every stage builds, the whole op's multi gate_up
    options are recorded flat (gate_<option>), absent for the default (W2MoeCuda's GATE_MULTI)."""
    from tierstore.kernels.cuda import w2_down, w2_gate_up, w2_moe, w2_multi

    class Kernel:
        def __init__(self, **options):
            self.options = options

        def attributes(self, k_len=None):
            return {"num_regs": 1}

    class Whole(Kernel):
        def __init__(self, gate_multi=None, **options):
            super().__init__(**options)
            self.gate_multi = gate_multi
            self.gate_up = self.down = self.gate_up_multi = self.down_multi = Kernel()

    for module, name in ((w2_gate_up, "W2GateUpCuda"), (w2_down, "W2DownCuda"), (w2_multi, "W2GateUpMultiCuda"),
                         (w2_multi, "W2DownMultiCuda")):
        monkeypatch.setattr(module, name, Kernel)
    monkeypatch.setattr(w2_moe, "W2MoeCuda", Whole)
    bench = _bench_module()
    built, record = bench._build("whole", bench.MULTI["whole"][1], True, None)
    assert built.gate_multi == {} and "gate_multi" not in record and record["block_tokens"] == bench.MULTI_BT
    v2 = [options for _, name, options in bench.MULTI_V2 if name == "cuda_whole_multi_s4e"][0]
    built, record = bench._build("whole", v2, True, None)
    assert built.gate_multi == bench.V2_GATE["s4e"] and record["gate_stage_cols"] == 4 and record["gate_early"] is True
    built, record = bench._build("whole", bench.WHOLE["cuda_whole"], False, None)
    assert built.gate_multi is None and not any(k.startswith("gate_stage") for k in record)
    built, record = bench._build("gate_up", {"ahead": 2}, False, None)
    assert built.options == {"ahead": 2} and record["num_regs"] == 1


# ---- v3 of the single-token kernels (W2_EARLY, W2_ROUTE_MAJOR; benchmarks/cuda-w2-notes.md "v3") --------------

V3_BUILDS = [dict(early=True), dict(route_major=True), dict(early=True, route_major=True),
             dict(early=True, route_major=True, pdl=True)]  # the v3 define sets (pairs_grid is host-side only)
V3_OPTIONS = [dict(early=True), dict(pairs_grid=True), dict(route_major=True), dict(early=True, pairs_grid=True),
              dict(early=True, route_major=True), dict(early=True, pairs_grid=True, pdl=True)]  # cuda_w2.py's V3
V3_BASELINE_COMMIT = "53f588c"  # the single-token kernels before the v3 defines


def _v3_defines(options: dict) -> dict:
    names = dict(early="W2_EARLY", route_major="W2_ROUTE_MAJOR", pdl="W2_PDL")
    return {names[k]: 1 for k, on in options.items() if on and k in names}


def _cuobjdump():
    import shutil
    from pathlib import Path

    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    found = [str(bundled)] if bundled.exists() else []
    found += [p for p in (shutil.which("cuobjdump"), "/usr/local/cuda/bin/cuobjdump") if p and Path(p).exists()]
    return found[0] if found else None


def _sass(tmp_path, source, defines: dict, name: str) -> tuple[list[str], str]:
    """(SASS instruction lines without addresses and encodings, ptxas -v output) of one sm_90a build."""
    cubin = tmp_path / f"{name}.cubin"
    report = ptxas_report(source, cubin, defines)
    text = subprocess.run([_cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    return [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+([^;]*;)", text)], report


def _prologue(lines: list[str]) -> str:
    """The prologue's 32-bit loads (L) and exits (X) before the first weight load (LDG.E.128), in SASS order."""
    out = ""
    for line in lines:
        if "LDG.E.128" in line:
            return out
        out += "L" if line.startswith("LDG") else "X" if line.endswith("EXIT ;") else ""
    raise AssertionError("no 128-bit load")


needs_sass = pytest.mark.skipif(loader.nvcc_path() is None or _cuobjdump() is None, reason="needs nvcc and cuobjdump")


@needs_nvcc
@pytest.mark.parametrize("options", V3_BUILDS)
@pytest.mark.parametrize("kernel,defines", [("gate_up", {"W2_AHEAD": 2}), ("gate_up", {"W2_AHEAD": 1}),
                                            ("down", {"W2_AHEAD": 2, "W2_GROUPS": 1}),
                                            ("down", {"W2_AHEAD": 2, "W2_GROUPS": 2})])
def test_v3_builds_compile_without_spills(tmp_path, kernel, defines, options):
    source = SOURCE if kernel == "gate_up" else w2_down.SOURCE
    report = ptxas_report(source, tmp_path / "k.cubin", defines | _v3_defines(options))
    regs = registers(report)
    assert "0 bytes spill stores" in report and regs <= 128  # 4 blocks of 128 threads per SM, as the defaults


@needs_sass
@pytest.mark.parametrize("kernel,defines", [("gate_up", {"W2_AHEAD": 1}), ("gate_up", {"W2_AHEAD": 2}),
                                            ("down", {"W2_AHEAD": 2, "W2_GROUPS": 1}),
                                            ("down", {"W2_AHEAD": 2, "W2_GROUPS": 2})])
def test_v3_defines_off_build_the_sass_of_before(tmp_path, kernel, defines):
    """With the v3 defines off, the SASS equals the kernel's at V3_BASELINE_COMMIT (the .cu from git; skipped where the
    checkout has no history)."""
    from pathlib import Path

    source = SOURCE if kernel == "gate_up" else w2_down.SOURCE
    root = Path(__file__).resolve().parents[1]
    old_dir = tmp_path / "old"
    old_dir.mkdir()
    for path in (source, source.with_name("w2_fragments.cuh")):
        rel = path.relative_to(root).as_posix()
        proc = subprocess.run(["git", "show", f"{V3_BASELINE_COMMIT}:{rel}"], capture_output=True, cwd=root)
        if proc.returncode != 0:
            pytest.skip(f"git show {V3_BASELINE_COMMIT}:{rel} failed (no history here)")
        (old_dir / path.name).write_bytes(proc.stdout)
    old, _ = _sass(tmp_path, old_dir / source.name, defines, "old")
    new, _ = _sass(tmp_path, source, defines, "new")
    assert new == old


@needs_sass
@pytest.mark.parametrize("kernel,defines", [("gate_up", {"W2_AHEAD": 2}), ("down", {"W2_AHEAD": 2, "W2_GROUPS": 1})])
def test_v3_early_prologue_takes_two_round_trips(tmp_path, kernel, defines):
    """SASS before the first weight load: the default loads num_blocks, exits, then block_expert, f4_table, w2_table
    one after another (4 dependent round trips); W2_EARLY loads the 3 route words, exits once, loads the 2 table words,
    exits once (2), with and without W2_ROUTE_MAJOR."""
    source = SOURCE if kernel == "gate_up" else w2_down.SOURCE
    default, _ = _sass(tmp_path, source, defines, "default")
    assert _prologue(default).startswith("LX")  # num_blocks alone, then its exit
    for options in (dict(early=True), dict(early=True, route_major=True)):
        lines, _ = _sass(tmp_path, source, defines | _v3_defines(options), "early")
        assert _prologue(lines).startswith("LLLXLLX"), (options, _prologue(lines))


def test_v3_route_major_order_visits_every_block_once_live_ones_first():
    """The W2_ROUTE_MAJOR mapping (dispatch index x + y * X -> route block, row tile), in Python: a bijection of the
    grid, and the first num_blocks * Y dispatch indices are exactly the live route blocks' CUDA blocks."""
    for grid_x, grid_y, live in ((16, 64, 8), (16, 112, 8), (4, 2, 2), (128, 64, 64), (7, 3, 7)):
        seen = []
        for y in range(grid_y):
            for x in range(grid_x):
                linear = y * grid_x + x
                seen.append((linear // grid_y, linear % grid_y))
        assert sorted(seen) == [(b, t) for b in range(grid_x) for t in range(grid_y)]
        assert all(b < live for b, _ in seen[: live * grid_y])  # `seen` is in dispatch order (x fastest)


def test_v3_wrappers_pass_their_defines_and_w2moecuda_passes_options_through(monkeypatch):
    from tierstore.kernels.cuda import w2_gate_up, w2_multi

    built, _ = stub_builds(monkeypatch)
    W2GateUpCuda(device=0)
    W2GateUpCuda(ahead=2, device=0, early=True)
    W2DownCuda(device=0)
    W2DownCuda(groups=2, device=0, route_major=True)
    assert built == [("w2_gate_up.cu", {"W2_AHEAD": 1}), ("w2_gate_up.cu", {"W2_AHEAD": 2, "W2_EARLY": 1}),
                     ("w2_down.cu", {"W2_AHEAD": 2, "W2_GROUPS": 1}),
                     ("w2_down.cu", {"W2_AHEAD": 2, "W2_ROUTE_MAJOR": 1, "W2_GROUPS": 2})]
    assert w2_gate_up.build_defines(2) == {"W2_AHEAD": 2}  # the default's command: as before the v3 defines
    assert w2_down.build_defines(2, 1, True, True, True) == {"W2_AHEAD": 2, "W2_EARLY": 1, "W2_ROUTE_MAJOR": 1,
                                                             "W2_PDL": 1, "W2_GROUPS": 1}
    with pytest.raises(ValueError, match="pdl needs early"):
        W2DownCuda(device=0, pdl=True)
    built.clear()
    default = W2MoeCuda(device=0)  # the adopted v3 options (w2_moe.SINGLE: early, pairs grid, programmatic down)
    assert (default.gate_up.early, default.gate_up.route_major, default.down.early, default.down.route_major) == (
        True, False, True, False)
    assert default.down.pdl and default.gate_up.pdl
    before_v3 = W2MoeCuda(device=0, gate_single={}, down_single={})
    assert not (before_v3.gate_up.early or before_v3.down.early or before_v3.down.pdl)
    moe = W2MoeCuda(device=0, gate_single=dict(early=True, route_major=True), down_single=dict(early=True))
    assert (moe.gate_up.early, moe.gate_up.route_major, moe.down.early, moe.down.route_major) == (True, True, True, False)
    assert built[-5:] == [("w2_gate_up.cu", {"W2_AHEAD": 2, "W2_EARLY": 1, "W2_ROUTE_MAJOR": 1}),
                          ("w2_down.cu", {"W2_AHEAD": 2, "W2_EARLY": 1, "W2_GROUPS": 1}),
                          (w2_multi.GATE_SOURCE.name, {"W2_AHEAD": 2, "W2_STAGE_COLS": 4, "W2_EARLY": 1,
                                                       "W2_DECODE_MAD": 1}),
                          (w2_multi.GATE_SOURCE.name, {"W2_AHEAD": 2, "W2_DECODE_MAD": 1}),  # 8 columns (WIDE_FROM)
                          (w2_multi.DOWN_SOURCE.name, {"W2_AHEAD": 2, "W2_GROUPS": 1, "W2_DECODE_MAD": 1})]


def test_v3_bench_variants_are_named_only_and_checked_against_the_default_kernels(monkeypatch):
    import types

    bench = _bench_module()
    assert not any(name in bench.V3_OF for _, name, _ in bench._variants(None))  # the default run is unchanged
    picked = bench._variants("cuda_whole_er,cuda_down_e,cuda_mma_ahead2_r,cuda_whole,cuda_down,cuda_mma_ahead2")
    assert [name for _, name, _ in picked] == ["cuda_mma_ahead2", "cuda_mma_ahead2_r", "cuda_down", "cuda_down_e",
                                                "cuda_whole", "cuda_whole_er"]
    assert picked[1][2] == dict(ahead=2, route_major=True) and picked[3][2] == dict(ahead=2, groups=1, early=True)
    assert picked[5][2] == dict(gate_ahead=2, down_ahead=2, down_groups=1, gate_single=dict(early=True, route_major=True),
                                down_single=dict(early=True, route_major=True))
    assert all(bench._block_tokens(name) == 1 for name in bench.V3_OF)
    assert bench.V3_OF["cuda_whole_e"] == "cuda_whole" and bench.V3_OF["cuda_down_r"] == "cuda_down"
    # checks: byte equality with the stage's default variant decides; a v3 row without its default is INVALID
    kb = types.SimpleNamespace(_rel_err=lambda got, ref: float((got.float() - ref).norm() / ref.norm()))
    a = torch.randn(4, 6).to(torch.bfloat16)
    b = a.clone()
    b[1, 2] = b[1, 2] + 1
    ref = a.float()
    check = bench._stage_check(kb, "gate_up", 1, dict(cuda_mma_ahead2=[a, a], cuda_mma_ahead2_e=[a.clone(), a.clone()],
                                                      cuda_mma_ahead2_r=[b, b]), ref, ref)
    assert check["variants"]["cuda_mma_ahead2_e"]["same_bytes_as_default"] is True
    assert bench._invalid([check], "cuda_mma_ahead2_e") == [] and bench._invalid([check], "cuda_mma_ahead2") == []
    assert any("bytes differ from cuda_mma_ahead2" in why for why in bench._invalid([check], "cuda_mma_ahead2_r"))
    alone = bench._stage_check(kb, "down", 1, dict(cuda_down_e=[a, a]), ref, ref)
    assert alone["variants"]["cuda_down_e"]["same_bytes_as_default"] is None
    assert any("not compared with cuda_down" in why for why in bench._invalid([alone], "cuda_down_e"))
    # _build records the whole op's v3 options flat (gate_single_<option>, down_single_<option>)
    from tierstore.kernels.cuda import w2_moe

    class Whole:
        def __init__(self, **options):
            self.options = options
            self.gate_up = self.down = self

        def attributes(self, k_len=None):
            return {"num_regs": 1}

    monkeypatch.setattr(w2_moe, "W2MoeCuda", Whole)
    built, record = bench._build("whole", picked[5][2], False, None)
    assert built.options["gate_single"] == dict(early=True, route_major=True)
    assert record["gate_single_early"] is True and record["down_single_route_major"] is True
    assert "gate_single" not in record and "down_single" not in record


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens", [1, 2, 8])
def test_v3_kernels_bytes_equal_the_default_kernels(gpu_case, down_case, tokens):
    """Every v3 option set against the default kernel of the same ahead / groups on the same route, NaN-poisoned
    outputs, launched twice: gate_up (an FP4 pair skipped), down (an FP4 pair's NaN rows, a missing pair untouched),
    the whole op (W2MoeCuda with both kernels so built, misses counted as the default's). The max_blocks grids hold
    exiting route blocks (the early exits and the route-major order run); the pairs grids hold P route blocks."""
    gen = gpu_case["gen"]
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)]).to(torch.int32)
    ids[0] = torch.tensor([3, 0], dtype=torch.int32)  # an FP4 pair (skipped) and a W2 pair at every T
    ids = ids.contiguous().cuda()
    x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16).cuda()
    ws = MoeWorkspace.allocate(tokens, TOP_K, EXPERTS, HIDDEN, INTER, torch.bfloat16, "cuda", block_tokens=1)
    moe_route(ids, gpu_case["w2"], gpu_case["f4"], 0, MissLog.allocate(4, "cuda"), ws)
    ref = w2_gate_up_ref(x, ids, gpu_case["w2"], gpu_case["f4"], 0)
    w2_rows = ~ref.isnan().any(dim=1)
    assert w2_rows.any() and (~w2_rows).any() and int(ws.num_blocks[0]) < ws.block_expert.numel()
    default = _run(gpu_case, x, ws, kernel="cuda2")
    for options in V3_OPTIONS:
        kernel = W2GateUpCuda(ahead=2, **options)
        outs = [torch.full_like(ws.act, float("nan")) for _ in range(2)]
        for out in outs:
            kernel(x, TOP_K, gpu_case["w2"], gpu_case["f4"], 0, ws, out=out)
        torch.cuda.synchronize()
        assert not outs[0][w2_rows].isnan().any() and outs[0][~w2_rows].isnan().all()
        assert same_bytes(outs[0], default) and same_bytes(outs[1], default), ("gate_up", options)

    w2, f4 = down_case["w2"], down_case["f4_with"]
    ids = _ids(down_case, tokens)
    ids[0] = torch.tensor([3, 0] if tokens > 1 else [0, 6], dtype=torch.int32)  # FP4 (T > 1), W2 and missing pairs
    if tokens > 1:
        ids[-1] = torch.tensor([1, 6], dtype=torch.int32)
    dws = MoeWorkspace.allocate(tokens, TOP_K, EXPERTS, HIDDEN, DOWN_INTER, torch.bfloat16, "cuda", block_tokens=1)
    moe_route(ids, w2, f4, 0, MissLog.allocate(4, "cuda"), dws)
    dws.act.copy_(torch.randn(dws.act.shape, generator=down_case["gen"]).to(torch.bfloat16))
    flat = ids.reshape(-1).cpu()
    w2_pairs = ((flat != 3) & (flat != 6)).cuda()
    assert w2_pairs.any()
    for groups in (1, 2):
        base = torch.full_like(dws.y, float("nan"))
        down_case["down"][(2, groups)](w2, f4, 0, dws, out=base)
        for options in V3_OPTIONS:
            kernel = W2DownCuda(ahead=2, groups=groups, **options)
            outs = [torch.full_like(dws.y, float("nan")) for _ in range(2)]
            for out in outs:
                kernel(w2, f4, 0, dws, out=out)
            torch.cuda.synchronize()
            assert not outs[0][w2_pairs].isnan().any()
            assert torch.equal(outs[0].view(torch.int32), base.view(torch.int32)), ("down", groups, options)
            assert torch.equal(outs[1].view(torch.int32), base.view(torch.int32)), ("down", groups, options)

    f4_none = down_case["f4_none"]
    down_case["weights"] = (torch.rand(8, TOP_K, generator=down_case["gen"]) + 0.05).cuda()
    xw = torch.randn(tokens, HIDDEN, generator=down_case["gen"]).to(torch.bfloat16).cuda()
    wids = _ids(down_case, tokens, last=6)  # a missing pair
    base, base_counts, _ = _whole(down_case, f4_none, wids, xw, down_case["whole"][1])
    assert not base.isnan().any()
    for options in V3_OPTIONS:
        moe = W2MoeCuda(gate_single=options, down_single=options)
        for _ in range(2):
            out, counts, _ = _whole(down_case, f4_none, wids, xw, moe)
            assert same_bytes(out, base) and counts == base_counts, ("whole", options)


@needs_sass
def test_v3_pdl_builds_place_the_trigger_first_and_the_wait_before_the_act_loads(tmp_path):
    """W2_PDL: gate_up's `griddepcontrol.launch_dependents` (SASS PREEXIT) comes before any load; down's
    `griddepcontrol.wait` (ACQBULK) twice: in the FP4 branch before its NaN stores, and after the first weight loads
    before every load of act, which are coherent (`LDG.E.64`, not the default build's LDG.E.64.CONSTANT); no store
    before the first wait. W2_PDL without W2_EARLY does not compile."""
    options = dict(early=True, route_major=True, pdl=True)
    gate, _ = _sass(tmp_path, SOURCE, {"W2_AHEAD": 2} | _v3_defines(options), "gate")
    first_load = next(i for i, line in enumerate(gate) if line.startswith("LDG"))
    assert [i for i, line in enumerate(gate) if line.startswith("PREEXIT")] == [gate.index("PREEXIT ;")]
    assert gate.index("PREEXIT ;") < first_load
    for groups in (1, 2):
        down, _ = _sass(tmp_path, w2_down.SOURCE, {"W2_AHEAD": 2, "W2_GROUPS": groups} | _v3_defines(options), "down")
        waits = [i for i, line in enumerate(down) if line == "ACQBULK ;"]
        stores = [i for i, line in enumerate(down) if line.startswith("STG")]
        assert len(waits) == 2 and stores and min(stores) > waits[0]
        assert any("LDG.E.128" in line for line in down[: waits[1]])
        act_loads = [i for i, line in enumerate(down) if line.startswith("LDG.E.64")]
        assert act_loads and min(act_loads) > waits[1] and not any("CONSTANT" in down[i] for i in act_loads)
        default, _ = _sass(tmp_path, w2_down.SOURCE, {"W2_AHEAD": 2, "W2_GROUPS": groups}, "down_default")
        assert "ACQBULK ;" not in default and any(line.startswith("LDG.E.64.CONSTANT") for line in default)
    cmd = loader.nvcc_command(w2_down.SOURCE, tmp_path / "p.cubin", "cubin", {"W2_AHEAD": 2, "W2_PDL": 1})
    assert subprocess.run(cmd, capture_output=True, text=True).returncode != 0


def test_dependent_launch_and_carveout_reach_the_driver(monkeypatch):
    """`w2_down.launch_dependent` (the W2 and FP4 downs' programmatic launch) and `Kernel.prefer_carveout` (the
    multi-token gate_ups' "fit" carveout) as driver calls, recorded without a GPU."""
    calls = []

    class Driver:
        def check(self, name, *args):
            calls.append((name, args))

    monkeypatch.setattr(loader, "driver", lambda: Driver())
    kernel = loader.Kernel(module=None, function=ctypes.c_void_p(0xABC), name="k")
    w2_down.launch_dependent(kernel, (16, 112), (128,), 4096, 0x1234, "pi", [0x10, 7])
    name, (cfg_ref, function, params, extra) = calls[0]
    cfg = cfg_ref._obj
    assert name == "cuLaunchKernelEx" and function.value == 0xABC and extra is None
    assert list(cfg.grid) == [16, 112, 1] and list(cfg.block) == [128, 1, 1] and cfg.shared_bytes == 4096
    assert cfg.stream == 0x1234 and cfg.num_attrs == 1 and cfg.attrs.contents.id == 6
    assert len(params) == 2
    kernel.prefer_carveout(57)
    kernel.prefer_max_shared()
    assert [(n, a[2]) for n, a in calls[1:]] == [("cuFuncSetAttribute", 57), ("cuFuncSetAttribute", 100)]
    assert calls[1][1][1] == loader._CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_CARVEOUT


@needs_nvcc
def test_v3_programmatic_launch_structs_match_cuda_h(tmp_path):
    """The ctypes CUlaunchAttribute / CUlaunchConfig of w2_down.py against cuda.h (sizes, offsets, the attribute id),
    by a host program nvcc compiles (no GPU, no libcuda call); and the config it fills."""
    from pathlib import Path

    src = tmp_path / "layout.cu"
    src.write_text('#include <cstdio>\n#include <cstddef>\n#include <cuda.h>\nint main() {\n'
                   '  printf("%zu %zu %zu %zu %zu %zu %zu %zu %d\\n", sizeof(CUlaunchAttribute),'
                   ' offsetof(CUlaunchAttribute, value),'
                   ' offsetof(CUlaunchAttributeValue, programmaticStreamSerializationAllowed), sizeof(CUlaunchConfig),'
                   ' offsetof(CUlaunchConfig, sharedMemBytes), offsetof(CUlaunchConfig, hStream),'
                   ' offsetof(CUlaunchConfig, attrs), offsetof(CUlaunchConfig, numAttrs),'
                   ' (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);\n}\n')
    exe = tmp_path / "layout"
    proc = subprocess.run([loader.nvcc_path(), str(src), "-o", str(exe)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    got = [int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    A, C = w2_down.LaunchAttribute, w2_down.LaunchConfig
    assert got == [ctypes.sizeof(A), A.value.offset, 0, ctypes.sizeof(C), C.shared_bytes.offset, C.stream.offset,
                   C.attrs.offset, C.num_attrs.offset, w2_down.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION]
    cfg, attr = w2_down.programmatic_config((16, 112), (128,), 4096, 0x1234)
    assert list(cfg.grid) == [16, 112, 1] and list(cfg.block) == [128, 1, 1] and cfg.shared_bytes == 4096
    assert cfg.stream == 0x1234 and cfg.num_attrs == 1 and cfg.attrs.contents.id == 6
    assert int.from_bytes(bytes(attr.value[:4]), "little") == 1 and not any(attr.value[4:])
    assert Path(w2_down.SOURCE).exists()


@pytest.mark.gpu
@needs_nvcc
def test_v3_pdl_whole_op_replays_in_a_cuda_graph(down_case):
    """The whole op with the programmatic down launch (gate_up triggers, down waits) captured in a CUDA graph and
    replayed: byte-identical to the default whole op run eagerly, misses counted once."""
    f4, tokens = down_case["f4_none"], 4
    down_case["weights"] = (torch.rand(8, TOP_K, generator=down_case["gen"]) + 0.05).cuda()
    ids = _ids(down_case, tokens, last=6)
    x = torch.randn(tokens, HIDDEN, generator=down_case["gen"]).to(torch.bfloat16).cuda()
    eager, counts, _ = _whole(down_case, f4, ids, x, down_case["whole"][1])
    options = dict(early=True, pairs_grid=True, pdl=True)  # cuda_whole_egp
    moe = W2MoeCuda(gate_single=options, down_single=options)
    ws = MoeWorkspace.allocate(tokens, TOP_K, EXPERTS, HIDDEN, DOWN_INTER, torch.bfloat16, "cuda", block_tokens=1)
    misses = MissLog.allocate(4, "cuda")
    out = torch.full_like(x, float("nan"))
    call = lambda: moe_mm(x, ids, down_case["weights"][:tokens], down_case["w2"], f4, 0, misses, ws, out=out, cuda_w2=moe)
    stream = side_stream()
    warm_up(call, stream)
    assert same_bytes(out, eager)
    misses.reset()
    out.fill_(float("nan"))
    graph = captured(call, stream)
    for _ in range(3):
        misses.reset()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert same_bytes(out, eager) and misses.counts.tolist() == counts


def test_v3_pairs_grid_covers_every_route_block_at_block_tokens_1():
    """pairs_grid launches min(max_blocks, P) route blocks: the route (CPU, Triton interpreter) gives num_blocks <= P
    at block_tokens 1 over random routings with missing and FP4 experts, so no live route block is left out; the grid
    is max_blocks without the option, and the option refuses block_tokens > 1."""
    from tierstore.kernels.cuda.w2_gate_up import route_blocks_grid

    gen = torch.Generator().manual_seed(31)
    w2 = w2_tier(HIDDEN, INTER, EXPERTS, 1, EXPERTS, "cpu")
    w2.table[0] = torch.arange(EXPERTS, dtype=torch.int32)
    w2.table[0, 5] = -1  # missing
    f4 = fp4_tier(HIDDEN, INTER, 1, 1, EXPERTS, "cpu")
    f4.table[0, 2] = 0  # FP4-resident
    for tokens in (1, 2, 3, 8, 9):
        for _ in range(4):
            ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)]).to(torch.int32)
            ws = MoeWorkspace.allocate(tokens, TOP_K, EXPERTS, HIDDEN, INTER, torch.bfloat16, "cpu", block_tokens=1)
            moe_route(ids.contiguous(), w2, f4, 0, MissLog.allocate(4, "cpu"), ws)
            pairs = tokens * TOP_K
            placed = int((ids != 5).sum())
            assert int(ws.num_blocks[0]) == placed <= pairs == route_blocks_grid(ws, True)
            assert route_blocks_grid(ws, False) == ws.block_expert.numel() == min(EXPERTS, pairs) + pairs
    ws16 = MoeWorkspace.allocate(4, TOP_K, EXPERTS, HIDDEN, INTER, torch.bfloat16, "cpu", block_tokens=16)
    with pytest.raises(ValueError, match="block_tokens 1"):
        route_blocks_grid(ws16, True)


def test_v3_bench_checks_isolate_a_variant_whose_launch_raises():
    """A variant whose launch raises (a refused programmatic launch, say) gets an error row and is INVALID; the other
    variants of the stage are still launched, compared and valid (benchmarks/cuda_w2.py `_launch_twice`)."""
    import types

    bench = _bench_module()
    kb = types.SimpleNamespace(_rel_err=lambda got, ref: float((got.float() - ref).norm() / ref.norm()))
    like = torch.zeros(3, 4, dtype=torch.bfloat16)
    value = torch.randn(3, 4).to(torch.bfloat16)

    def launch(kernel, out, block_tokens):
        if kernel == "refused":
            raise RuntimeError("cuLaunchKernelEx failed: CUDA_ERROR_NOT_SUPPORTED\nmore")
        out.copy_(value)

    outs = bench._launch_twice(dict(cuda_down="ok", cuda_down_egp="refused", cuda_down_eg="ok"), like, launch)
    assert isinstance(outs["cuda_down_egp"], RuntimeError) and bench._ran(outs, "cuda_down_egp") is None
    check = bench._stage_check(kb, "down", 1, outs, value.float(), value.float())
    assert check["variants"]["cuda_down_egp"] == dict(error="RuntimeError: cuLaunchKernelEx failed: CUDA_ERROR_NOT_SUPPORTED")
    assert bench._invalid([check], "cuda_down_egp") == [
        "check raised: RuntimeError: cuLaunchKernelEx failed: CUDA_ERROR_NOT_SUPPORTED"]
    assert bench._invalid([check], "cuda_down") == [] and bench._invalid([check], "cuda_down_eg") == []
    assert check["variants"]["cuda_down_eg"]["same_bytes_as_default"] is True


def test_stream_stage_builds_take_their_stage_only_where_it_fits(monkeypatch):
    """W2_STREAM_STAGE: the define only with stream (and passed through W2MoeCuda), the carveout asked for, and the
    launches' shared memory: the activation pairs plus a block's rows and scales (32 gate + 32 up rows for the gate_up,
    64 rows for the down) where that stays within STREAM_STAGE_LIMIT, else the pairs alone (DeepSeek-V3's gate_up)."""
    from tierstore.kernels.cuda import w2_gate_up

    built, carveouts = stub_builds(monkeypatch)
    with pytest.raises(ValueError, match="stage needs stream"):
        w2_gate_up.build_defines(2, early=True, pair_order=True, stage=True)
    W2MoeCuda(device=0, stream=True)
    without_stage = len(carveouts)
    built.clear()
    moe = W2MoeCuda(device=0, stream=True, stream_stage=True)
    assert built[0] == ("w2_gate_up.cu", {"W2_AHEAD": 2, "W2_EARLY": 1, "W2_PDL": 1, "W2_DECODE_MAD": 1,
                                          "W2_PAIR_ORDER": 1, "W2_STREAM": 1, "W2_STREAM_PREFETCH": 1,
                                          "W2_STREAM_STAGE": 1})
    assert built[1][1]["W2_STREAM_STAGE"] == 1  # the default carveout, "max": both single-token kernels at init
    assert len(carveouts) == 2 * without_stage + 2 and carveouts[-2:] == [True, True]
    W2MoeCuda(device=0, stream=True, stream_stage=True, stream_stage_carveout="fit")
    assert len(carveouts) == 3 * without_stage + 2  # "fit": none asked before a launch
    for hidden, inter, gate_stage, down_stage in ((2048, 1408, True, True), (2048, 768, True, True),
                                                  (7168, 2048, False, True)):
        lay = w2_slot_layout(hidden, inter)
        w13, w2m = lay.w13, lay.w2
        gate_want = 2 * hidden + (64 * (4 * w13.words_per_row + w13.blocks_per_row) if gate_stage else 0)
        down_want = 2 * w2_down.act_k(lay) + (64 * (4 * w2m.words_per_row + w2m.blocks_per_row) if down_stage else 0)
        assert moe.gate_up.shared_bytes(lay) == gate_want <= w2_gate_up.STREAM_STAGE_LIMIT
        assert moe.down.shared_bytes(lay) == down_want <= w2_gate_up.STREAM_STAGE_LIMIT
    lay = w2_slot_layout(2048, 1408)
    assert W2MoeCuda(device=0, stream=True).gate_up.shared_bytes(lay) == 2 * 2048  # no stage build: the pairs
    monkeypatch.setattr(w2_gate_up, "STREAM_STAGE_LIMIT", 0)
    assert moe.gate_up.shared_bytes(lay) == 2 * 2048 and moe.down.shared_bytes(lay) == 2 * w2_down.act_k(lay)


def test_stage_carveout_fit_asks_the_smallest_that_holds_four_blocks_once_per_size(monkeypatch):
    """ask_stage_carveout "fit": a launch asks fit_carveout(smem, 4) when its shared memory differs from the last one's,
    nothing otherwise; "max" asks 100 % once, leaving nothing for the launches; anything else is refused."""
    from tierstore.kernels.cuda import carveout, w2_gate_up

    _, carveouts = stub_builds(monkeypatch)
    kernel = loader.load(b"", "k", 0)
    fit = w2_gate_up.ask_stage_carveout(kernel, "fit")
    assert carveouts == []
    for smem in (4096, 4096, 40960, 40960, 4096):
        fit.launch(smem)
    assert carveouts == [carveout.fit_carveout(4096, 4), carveout.fit_carveout(40960, 4),
                         carveout.fit_carveout(4096, 4)]
    assert carveouts[0] < carveouts[1] <= 100
    carveouts.clear()
    assert w2_gate_up.ask_stage_carveout(kernel, "max") is None
    assert carveouts == [True]
    with pytest.raises(ValueError, match="stage_carveout is one of"):
        w2_gate_up.ask_stage_carveout(kernel, "most")


@needs_nvcc
@pytest.mark.parametrize("kernel", ["gate_up", "down"])
def test_stream_stage_builds_compile_without_spills(tmp_path, kernel):
    from tierstore.kernels.cuda import w2_gate_up

    source = SOURCE if kernel == "gate_up" else w2_down.SOURCE
    defines = w2_gate_up.build_defines(2, early=True, pdl=True, mad=True, pair_order=True, stream=True, prefetch=True,
                                       stage=True)
    for extra in ({}, {"W2_WPS": 16}) if kernel == "down" else ({},):
        report = ptxas_report(source, tmp_path / "k.cubin", defines | extra | ({"W2_GROUPS": 1} if extra or
                                                                                 kernel == "down" else {}))
        assert "0 bytes spill stores" in report and registers(report) <= 128  # 4 blocks of 128 threads per SM
