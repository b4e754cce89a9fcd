"""kernels/cuda multi-token W2 stages (w2_gate_up_multi.cu, w2_down_multi.cu, w2_multi.py) and the whole op's choice
by block size (W2MoeCuda).

CPU: argument kinds against the kernel signatures and launch arguments, the kernels compiling without spills, and a
numpy model that follows the .cu files over a real route output (block_tokens 16): a route block's column groups of 8,
the shared-memory columns with their pad, lane (g, c) reading column g's B and storing columns 2c / 2c + 1 from its
D fragment; expert fills 1, 2, 3, 8, 11 (two column groups) and 17 (two route blocks), an FP4 and a missing expert;
against float64 references. The model checks the index and bit arithmetic, not the hardware; the GPU tests run the
kernels (outputs poisoned, repeats byte-identical, vs the references, the single-token kernels and Triton's route).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tests.cuda_fixtures import (bench_on_cpu, bf16_bits, fp4_pool, launched_twice, needs_nvcc, ptxas_report,
                                  registers, replayed_once, run_whole, same_bytes, signature_kinds, slot_rows, to_cuda,
                                  w2_pool)
from tests.test_cuda_w2 import unit_pairs, warp_acc
from tierstore.kernels import MissLog, MoeWorkspace, moe_mm, moe_mm_ref, moe_route, w2_tier
from tierstore.kernels.cuda import w2_multi
from tierstore.kernels.cuda.w2_down import w2_down_ref
from tierstore.kernels.cuda.w2_gate_up import w2_gate_up_ref
from tierstore.kernels.layout import unpack_matrix_ref

EXPERTS, TOP_K, BT = 8, 2, 16
FP4_EXPERT, MISSING_EXPERT = 6, 7


def _fill_ids() -> torch.Tensor:
    """[22, 2] distinct experts per token: expert 0 has 17 pairs (two route blocks: 16 + 1), expert 1 11 (two column
    groups: 8 + 3), expert 2 3, expert 3 8, expert 4 1, expert 5 2, FP4 expert 6 one pair, missing expert 7 one."""
    first = [0] * 17 + [2] * 3 + [5] * 2
    second = [1] * 11 + [3] * 8 + [4, FP4_EXPERT, MISSING_EXPERT]
    return torch.tensor([first, second], dtype=torch.int32).T.contiguous()


def _pools(hidden, inter, gen, scales=(110, 131)):
    return w2_pool(hidden, inter, EXPERTS, gen, scales, missing=MISSING_EXPERT), fp4_pool(hidden, inter, EXPERTS,
                                                                                          FP4_EXPERT)


def _routed(ids, w2, f4, block_tokens, device="cpu"):
    tokens, top_k = ids.shape
    ws = MoeWorkspace.allocate(tokens, top_k, EXPERTS, w2.layout.hidden, w2.layout.inter, torch.bfloat16, device,
                               block_tokens=block_tokens)
    moe_route(ids, w2, f4, 0, MissLog.allocate(4, device), ws)
    return ws


# ---- host side -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("source,kernel,kinds", [(w2_multi.GATE_SOURCE, w2_multi.GATE_KERNEL, w2_multi.GATE_ARG_KINDS),
                                                 (w2_multi.DOWN_SOURCE, w2_multi.DOWN_KERNEL, w2_multi.DOWN_ARG_KINDS)])
def test_arg_kinds_match_the_kernel_signatures(source, kernel, kinds):
    assert signature_kinds(source.read_text(), kernel) == kinds


def test_launch_args_follow_the_arg_kinds():
    w2, f4 = _pools(1024, 1024, torch.Generator().manual_seed(0))
    ws = MoeWorkspace.allocate(3, TOP_K, EXPERTS, 1024, 1024, torch.bfloat16, "cpu", block_tokens=32)
    x = torch.zeros(3, 1024, dtype=torch.bfloat16)
    for kinds, args in ((w2_multi.GATE_ARG_KINDS, w2_multi.gate_launch_args(x, TOP_K, w2, f4, 0, ws, ws.act, 0.5)),
                        (w2_multi.DOWN_ARG_KINDS, w2_multi.down_launch_args(w2, f4, 0, ws, ws.y))):
        assert len(args) == len(kinds)
        for kind, value in zip(kinds, args):
            assert isinstance(value, float if kind == "f" else int)
        assert args[kinds.index("pppp") + 1] == ws.block_fill.data_ptr()  # block_expert, block_fill, pairs, count
        assert args[kinds.index("pppp") + 4] == 32  # block_tokens
    assert w2_multi.shared_bytes(7168) == 8 * (2 * 7168 + 16)  # 114,816: two blocks fit an H200 SM (228 KB)


def test_inputs_need_a_block_size_multiple_of_eight():
    w2, f4 = _pools(1024, 1024, torch.Generator().manual_seed(0))
    x = torch.zeros(1, 1024, dtype=torch.bfloat16)
    for bt in (1, 12):  # 12 is not a route size the workspace allows; the check is the kernels' own
        ws = dataclasses.replace(MoeWorkspace.allocate(1, TOP_K, EXPERTS, 1024, 1024, torch.bfloat16, "cpu",
                                                       block_tokens=1), block_tokens=bt)
        with pytest.raises(ValueError, match="multiple of 8"):
            w2_multi.gate_check_inputs(x, w2, f4, ws, ws.act)
        with pytest.raises(ValueError, match="multiple of 8"):
            w2_multi.down_check_inputs(w2, f4, ws, ws.y, 1)
    with pytest.raises(ValueError, match="multiple of 64"):
        w2_multi.gate_check_geometry(w2_tier(1024, 96, 1, 1, 1, "cpu").layout)


@needs_nvcc
@pytest.mark.parametrize("source,defines", [(w2_multi.GATE_SOURCE, {"W2_AHEAD": 1}), (w2_multi.GATE_SOURCE, {"W2_AHEAD": 2}),
                                            (w2_multi.DOWN_SOURCE, {"W2_AHEAD": 2, "W2_GROUPS": 1}),
                                            (w2_multi.DOWN_SOURCE, {"W2_AHEAD": 2, "W2_GROUPS": 2})])
def test_kernels_compile_without_spills(tmp_path, source, defines):
    report = ptxas_report(source, tmp_path / "k.cubin", defines)
    # gate_up: 256 threads x 2 blocks per SM; down: 128 threads x 4 blocks: both at most 128 registers
    assert "0 bytes spill stores" in report and registers(report) <= 128


# ---- numpy model of the multi-token kernels ----------------------------------------------------------------

def build_pairs_multi(rows: torch.Tensor, pairs: list[int], divisor: int, count: int, stride: int, k_len: int):
    """w2_multi.cuh `build_pairs_multi`: flat unit index -> (column, unit); columns past `count` stay NaN pairs."""
    xp = [0x7FC07FC0] * (w2_multi.COLS * stride)
    units = k_len // 16
    bits = {}
    for idx in range(count * units):
        col, q = divmod(idx, units)
        row = pairs[col] // divisor
        bits.setdefault(row, bf16_bits(rows[row]))
        xp[col * stride + q * 8: col * stride + q * 8 + 8] = unit_pairs(bits[row], q)
    return xp


def warp_mma_multi(lo, hi, lo_scales, hi_scales, xp, column_base, tiles) -> np.ndarray:
    """One warp's K loop with B column g read at xp[column_base[g] + ...] (the lane's xp_lane); returns each lane's
    D registers [32, 4] = (row g col 2c, row g col 2c + 1, row g + 8 col 2c, row g + 8 col 2c + 1), acc[0] + acc[1]."""
    acc = warp_acc(lo, hi, lo_scales, hi_scales, xp, column_base, tiles)
    d = acc[0] + acc[1]
    return np.array([[d[g, 2 * c], d[g, 2 * c + 1], d[g + 8, 2 * c], d[g + 8, 2 * c + 1]]
                     for g in range(8) for c in range(4)])


def _blocks(ws, f4):
    """The column groups the kernels run, in order: CUDA block b < num_blocks (route block b), then its groups
    z0 = 0, 8, .. < fill: (expert, z0, count, the group's pairs, FP4?)."""
    for b in range(min(ws.block_expert.numel(), int(ws.num_blocks[0]))):
        expert, fill = int(ws.block_expert[b]), int(ws.block_fill[b])
        pairs = ws.block_pairs[b * ws.block_tokens: b * ws.block_tokens + fill].tolist()
        for z0 in range(0, fill, w2_multi.COLS):
            count = min(fill - z0, w2_multi.COLS)
            yield expert, z0, count, pairs[z0: z0 + count], int(f4.table[0, expert]) >= 0


def gate_up_warp_store(out, words, scales, n0, inter, xp, base, tiles, pairs, count) -> None:
    """One gate_up warp (gate rows n0 .. n0 + 7, up rows I + n0 ..) over B columns `base`: lane (g, c) stores
    silu(gate) * up of columns 2c, 2c + 1 (those below `count`) at out[pairs[column], n0 + g]."""
    d = warp_mma_multi(words[n0: n0 + 8], words[inter + n0: inter + n0 + 8], scales[n0: n0 + 8],
                       scales[inter + n0: inter + n0 + 8], xp, base, tiles)
    for lane in range(32):
        g, c = lane >> 2, lane & 3
        for h in range(2):
            if 2 * c + h < count:
                gate, up = d[lane, h], d[lane, 2 + h]
                out[pairs[2 * c + h], n0 + g] = gate / (1 + np.exp(-gate)) * up


def model_gate_up_multi(w2, f4, ws, x, top_k) -> np.ndarray:
    """float64 [P, I], NaN where nothing is written: what w2_gate_up_multi stores (before bf16 rounding)."""
    lay, inter = w2.layout, w2.layout.inter
    out = np.full((ws.act.shape[0], inter), np.nan)
    stride = lay.hidden // 2 + w2_multi.PAD_WORDS
    for expert, _, count, pairs, fp4 in _blocks(ws, f4):
        if fp4:
            continue
        words, scales = slot_rows(w2.slots[int(w2.table[0, expert])], lay, "w13")
        xp = build_pairs_multi(x, pairs, top_k, count, stride, lay.hidden)
        base = [min(g, count - 1) * stride for g in range(8)]
        for n0 in range(0, inter, 8):  # block y, warp: gate rows n0 .. n0 + 7, up rows I + n0 ..
            gate_up_warp_store(out, words, scales, n0, inter, xp, base, lay.w13.words_per_row // 32, pairs, count)
    return out


def model_down_multi(w2, f4, ws, act) -> np.ndarray:
    """float64 [P, H], NaN where nothing is written or the pair is FP4's: what w2_down_multi stores (groups 1)."""
    lay = w2.layout
    out = np.full((ws.y.shape[0], lay.hidden), np.inf)  # inf: not written
    stride = lay.inter // 2 + w2_multi.PAD_WORDS
    for expert, z0, count, pairs, fp4 in _blocks(ws, f4):
        if fp4:  # the kernel's FP4 branch: lane (g, c) marks rows g, g + 8 of the pairs c, c + 4, ..
            for n0 in range(0, lay.hidden, 16):
                for g in range(8):
                    for c in range(4):
                        for col in range(c, count, 4):
                            out[pairs[col], [n0 + g, n0 + g + 8]] = np.nan
            continue
        words, scales = slot_rows(w2.slots[int(w2.table[0, expert])], lay, "w2")
        xp = build_pairs_multi(act, pairs, 1, count, stride, lay.inter)
        base = [min(g, count - 1) * stride for g in range(8)]
        for n0 in range(0, lay.hidden, 16):  # one warp's row group: rows n0 + g and n0 + g + 8
            d = warp_mma_multi(words[n0: n0 + 8], words[n0 + 8: n0 + 16], scales[n0: n0 + 8], scales[n0 + 8: n0 + 16],
                               xp, base, lay.w2.words_per_row // 32)
            for lane in range(32):
                g, c = lane >> 2, lane & 3
                for h in range(2):
                    if 2 * c + h < count:
                        out[pairs[2 * c + h], n0 + g] = d[lane, h]
                        out[pairs[2 * c + h], n0 + g + 8] = d[lane, 2 + h]
    return out


def test_the_fill_case_routes_as_intended():
    w2, f4 = _pools(512, 64, torch.Generator().manual_seed(1))
    ws = _routed(_fill_ids(), w2, f4, BT)
    fills = {}
    for b in range(int(ws.num_blocks[0])):
        fills.setdefault(int(ws.block_expert[b]), []).append(int(ws.block_fill[b]))
    assert fills == {0: [16, 1], 1: [11], 2: [3], 3: [8], 4: [1], 5: [2], FP4_EXPERT: [1]}
    counts = sorted(count for _, _, count, _, _ in _blocks(ws, f4))
    assert counts == [1, 1, 1, 2, 3, 3, 8, 8, 8, 8]  # expert 0: 8 + 8 + 1, expert 1: 8 + 3


def test_model_of_the_gate_up_kernel_matches_the_reference():
    gen = torch.Generator().manual_seed(2)
    w2, f4 = _pools(512, 64, gen)
    ids = _fill_ids()
    x = torch.randn(ids.shape[0], 512, generator=gen).to(torch.bfloat16)
    got = model_gate_up_multi(w2, f4, _routed(ids, w2, f4, BT), x, TOP_K)
    for p, e in enumerate(ids.reshape(-1).tolist()):
        if e in (FP4_EXPERT, MISSING_EXPERT):
            assert np.isnan(got[p]).all()  # skipped: left untouched
            continue
        gate, up = (unpack_matrix_ref(w2.slots[e], w2.layout, "w13").double() @ x[p // TOP_K].double()).chunk(2)
        ref = (torch.nn.functional.silu(gate) * up).numpy()
        assert np.abs(got[p] - ref).max() <= 1e-9 * np.abs(ref).max(), p


def test_model_of_the_down_kernel_matches_the_reference():
    gen = torch.Generator().manual_seed(3)
    w2, f4 = _pools(64, 512, gen)
    ids = _fill_ids()
    act = torch.randn(ids.numel(), 512, generator=gen).to(torch.bfloat16)
    got = model_down_multi(w2, f4, _routed(ids, w2, f4, BT), act)
    for p, e in enumerate(ids.reshape(-1).tolist()):
        if e == FP4_EXPERT:
            assert np.isnan(got[p]).all()
        elif e == MISSING_EXPERT:
            assert np.isinf(got[p]).all()  # no route block: untouched
        else:
            ref = (unpack_matrix_ref(w2.slots[e], w2.layout, "w2").double() @ act[p].double()).numpy()
            assert np.abs(got[p] - ref).max() <= 1e-9 * np.abs(ref).max(), p


# ---- the kernels on a GPU ---------------------------------------------------------------------------------

HIDDEN, INTER = 1024, 1024  # gate_up K = 2 tiles, down K = 2 tiles, 16 row tiles of 64


@pytest.fixture(scope="module")
def case():
    from tierstore.kernels.cuda.w2_down import W2DownCuda
    from tierstore.kernels.cuda.w2_gate_up import W2GateUpCuda
    from tierstore.kernels.cuda.w2_moe import W2MoeCuda

    gen = torch.Generator().manual_seed(9)
    w2, f4 = _pools(HIDDEN, INTER, gen, (112, 124))  # tame magnitudes through both GEMMs (as test_cuda_w2's down_case)
    f4_none = fp4_pool(HIDDEN, INTER, EXPERTS)
    return dict(w2=to_cuda(w2), f4=to_cuda(f4), f4_none=to_cuda(f4_none), gen=gen,
                gate={a: w2_multi.W2GateUpMultiCuda(ahead=a) for a in (1, 2)}, gate_single=W2GateUpCuda(ahead=2),
                down={(a, g): w2_multi.W2DownMultiCuda(ahead=a, groups=g) for a, g in ((2, 1), (2, 2), (1, 1))},
                down_single=W2DownCuda(), whole=W2MoeCuda())


def _ids_rows(gen, tokens, with_fp4=True) -> list[list[int]]:
    """Random distinct experts per token; with_fp4: token 0 is (FP4 expert, a W2-resident expert), so a routing is
    never without W2 pairs (at tokens = 2 a random second pair could be the missing expert and the next token
    (FP4, missing): nothing to compare); the last token's last pair missing (unless it is token 0's W2 pair)."""
    rows = [torch.randperm(EXPERTS, generator=gen).tolist() for _ in range(tokens)]
    if with_fp4:
        w2_expert = next(e for e in rows[0] if e not in (FP4_EXPERT, MISSING_EXPERT))
        rows[0] = [FP4_EXPERT, w2_expert] + [e for e in rows[0] if e not in (FP4_EXPERT, w2_expert)]
    if not (with_fp4 and tokens == 1):  # without FP4 residents (f4_none) every expert but the missing one is W2
        j = rows[-1].index(MISSING_EXPERT)
        rows[-1][TOP_K - 1], rows[-1][j] = rows[-1][j], rows[-1][TOP_K - 1]
    return [r[:TOP_K] for r in rows]


def _ids(case, tokens, with_fp4=True) -> torch.Tensor:
    return torch.tensor(_ids_rows(case["gen"], tokens, with_fp4), dtype=torch.int32).cuda()


@pytest.mark.parametrize("tokens", [1, 2, 8, 32])
def test_gpu_routings_always_hold_w2_fp4_and_missing_pairs(tokens):
    """The GPU tests' routings (_ids_rows) over many generator states: distinct experts per token, W2 pairs always,
    the FP4 pair and (beyond one token) the missing pair where the tests expect them."""
    gen = torch.Generator().manual_seed(tokens)
    for _ in range(200):
        for with_fp4 in (True, False):
            rows = _ids_rows(gen, tokens, with_fp4)
            flat = [e for r in rows for e in r]
            assert len(rows) == tokens and all(len(set(r)) == TOP_K for r in rows)
            non_w2 = (FP4_EXPERT, MISSING_EXPERT) if with_fp4 else (MISSING_EXPERT,)  # f4_none: expert 6 is W2
            assert any(e not in non_w2 for e in flat)
            assert (MISSING_EXPERT in flat) == (not (with_fp4 and tokens == 1))
            if with_fp4:
                assert rows[0][0] == FP4_EXPERT and rows[0][1] not in (FP4_EXPERT, MISSING_EXPERT)


def _kinds(ids):
    flat = ids.reshape(-1).cpu()
    fp4, missing = (flat == FP4_EXPERT).cuda(), (flat == MISSING_EXPERT).cuda()
    return fp4, missing, ~(fp4 | missing)


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens", [1, 2, 8, 32])
def test_multi_gate_up_matches_reference_and_single_token_kernel(case, tokens):
    w2, f4 = case["w2"], case["f4"]
    ids = _ids(case, tokens)
    x = torch.randn(tokens, HIDDEN, generator=case["gen"]).to(torch.bfloat16).cuda()
    ws = _routed(ids, w2, f4, BT, "cuda")
    if tokens == 32:  # 64 pairs over 8 experts: some route block runs a second column group
        assert int(ws.block_fill[: int(ws.num_blocks[0])].max()) > 8
    outs = launched_twice(case["gate"], ws.act, float("nan"),
                          lambda kernel, out: kernel(x, TOP_K, w2, f4, 0, ws, out=out))
    single = torch.full_like(ws.act, float("nan"))
    case["gate_single"](x, TOP_K, w2, f4, 0, _routed(ids, w2, f4, 1, "cuda"), out=single)
    torch.cuda.synchronize()
    fp4, missing, w2_rows = _kinds(ids)
    assert w2_rows.any()  # an empty compared set would give 0 / 0
    got = outs[2][0]
    assert got[fp4 | missing].isnan().all() and not got[w2_rows].isnan().any()  # skipped rows untouched
    ref = w2_gate_up_ref(x, ids, w2, f4, 0)[w2_rows]
    assert float((got[w2_rows].float() - ref).norm() / ref.norm()) <= 1e-2
    assert float((got[w2_rows].float() - single[w2_rows].float()).norm() / ref.norm()) <= 1e-3
    for a, b in outs.values():
        assert same_bytes(a, got) and same_bytes(b, got)  # repeats; prefetch depth changes no arithmetic


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens", [1, 2, 8, 32])
def test_multi_down_matches_reference_and_single_token_kernel(case, tokens):
    w2, f4 = case["w2"], case["f4"]
    ids = _ids(case, tokens)
    ws = _routed(ids, w2, f4, BT, "cuda")
    if tokens == 32:  # 64 pairs over 8 experts: some route block runs a second column group
        assert int(ws.block_fill[: int(ws.num_blocks[0])].max()) > 8
    ws.act.copy_(torch.randn(ws.act.shape, generator=case["gen"]).to(torch.bfloat16))
    outs = launched_twice(case["down"], ws.y, -7.0, lambda kernel, out: kernel(w2, f4, 0, ws, out=out))
    ws1 = _routed(ids, w2, f4, 1, "cuda")
    ws1.act.copy_(ws.act)
    single = torch.full_like(ws.y, -7.0)
    case["down_single"](w2, f4, 0, ws1, out=single)
    torch.cuda.synchronize()
    fp4, missing, w2_rows = _kinds(ids)
    assert w2_rows.any()  # an empty compared set would give 0 / 0 (tokens = 2 at 998c5b7: nan)
    got = outs[(2, 1)][0]
    assert got[fp4].isnan().all() and (got[missing] == -7.0).all() and not got[w2_rows].isnan().any()
    ref = w2_down_ref(ws.act, ids, w2, f4, 0)[w2_rows]
    assert float((got[w2_rows] - ref).norm() / ref.norm()) <= 1e-5  # fp32 sums of exact products
    assert float((got[w2_rows] - single[w2_rows]).norm() / ref.norm()) <= 1e-6
    for a, b in outs.values():
        assert same_bytes(a, got) and same_bytes(b, got)  # repeats, prefetch depth, row grouping


def _whole(case, ids, x, weights, block_tokens, out=None):
    return run_whole(x, ids, weights, case["w2"], case["f4_none"], case["whole"], INTER, EXPERTS, 4, block_tokens,
                     out=out)


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens", [1, 2, 8, 32])
def test_multi_whole_op_matches_reference_with_misses(case, tokens):
    ids = _ids(case, tokens, with_fp4=False)
    x = torch.randn(tokens, HIDDEN, generator=case["gen"]).to(torch.bfloat16).cuda()
    weights = (torch.rand(tokens, TOP_K, generator=case["gen"]) + 0.05).cuda()
    ref, missing_pairs, missing = moe_mm_ref(x, ids, weights, case["w2"], case["f4_none"], 0, act_dtype=torch.bfloat16)
    out, counts, entries = _whole(case, ids, x, weights, BT)
    assert not out.isnan().any()
    assert float((out.float() - ref).norm() / ref.norm()) <= 1e-2
    assert counts == [missing_pairs, len(missing)] and [tuple(e) for e in entries[: len(missing)]] == missing
    again, counts2, _ = _whole(case, ids, x, weights, BT)
    assert same_bytes(out, again) and counts2 == counts
    for bt in (32, 64):  # more column groups per route block: each pair's arithmetic is the same
        assert same_bytes(_whole(case, ids, x, weights, bt)[0], out)
    single, single_counts, _ = _whole(case, ids, x, weights, 1)
    assert single_counts == counts and float((out.float() - single.float()).norm() / ref.norm()) <= 1e-3


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens,wide", [(8, False), (16, False), (17, True), (32, True)])
def test_whole_op_picks_the_gate_up_width_by_pairs_per_expert(case, tokens, wide):
    """Above WIDE_FROM (4) pairs per expert (here 16 pairs over 8 experts at 8 tokens, 34 at 17) the whole op runs the
    8-column gate_up, else the 4-column one; either gives the same bytes (each pair's arithmetic is the same)."""
    from tierstore.kernels.cuda.w2_moe import GATE_MULTI, WIDE_FROM, W2MoeCuda

    assert WIDE_FROM == 4
    moe = case["whole"]
    ran, kernels = [], {name: getattr(moe, name) for name in ("gate_up_multi", "gate_up_multi_wide")}
    for name, kernel in kernels.items():
        setattr(moe, name, lambda *a, _k=kernel, _n=name, **kw: (ran.append(_n), _k(*a, **kw))[1])
    try:
        ids = _ids(case, tokens, with_fp4=False)
        x = torch.randn(tokens, HIDDEN, generator=case["gen"]).to(torch.bfloat16).cuda()
        weights = (torch.rand(tokens, TOP_K, generator=case["gen"]) + 0.05).cuda()
        out, counts, _ = _whole(case, ids, x, weights, BT)
    finally:
        for name, kernel in kernels.items():
            setattr(moe, name, kernel)
    assert ran == ["gate_up_multi_wide" if wide else "gate_up_multi"]
    narrow_only = W2MoeCuda(gate_multi_wide=GATE_MULTI)  # the 4-column kernel at every fill
    again, counts2, _ = run_whole(x, ids, weights, case["w2"], case["f4_none"], narrow_only, INTER, EXPERTS, 4, BT)
    assert not out.isnan().any() and same_bytes(out, again) and counts2 == counts
    ref, _, _ = moe_mm_ref(x, ids, weights, case["w2"], case["f4_none"], 0, act_dtype=torch.bfloat16)
    assert float((out.float() - ref).norm() / ref.norm()) <= 1e-2


@pytest.mark.gpu
@needs_nvcc
def test_multi_whole_op_gives_nan_rows_for_fp4_pairs(case):
    ids = torch.tensor([[FP4_EXPERT, 0], [1, 2], [0, 1]], dtype=torch.int32).cuda()  # token 0 routes to FP4
    x = torch.randn(3, HIDDEN, generator=case["gen"]).to(torch.bfloat16).cuda()
    weights = (torch.rand(3, TOP_K, generator=case["gen"]) + 0.05).cuda()
    ws = MoeWorkspace.allocate(3, TOP_K, EXPERTS, HIDDEN, INTER, torch.bfloat16, "cuda", block_tokens=BT)
    out = moe_mm(x, ids, weights, case["w2"], case["f4"], 0, MissLog.allocate(4, "cuda"), ws, cuda_w2=case["whole"])
    ref, _, _ = moe_mm_ref(x, ids, weights, case["w2"], case["f4"], 0, act_dtype=torch.bfloat16)
    assert out[0].isnan().all() and not out[1:].isnan().any()
    assert float((out[1:].float() - ref[1:]).norm() / ref[1:].norm()) <= 1e-2


@pytest.mark.gpu
@needs_nvcc
def test_multi_whole_op_replays_in_a_cuda_graph(case):
    tokens = 32
    ids = _ids(case, tokens, with_fp4=False)
    x = torch.randn(tokens, HIDDEN, generator=case["gen"]).to(torch.bfloat16).cuda()
    weights = (torch.rand(tokens, TOP_K, generator=case["gen"]) + 0.05).cuda()
    eager, counts, _ = _whole(case, ids, x, weights, BT)
    ws = MoeWorkspace.allocate(tokens, TOP_K, EXPERTS, HIDDEN, INTER, torch.bfloat16, "cuda", block_tokens=BT)
    misses = MissLog.allocate(4, "cuda")
    out = torch.full_like(x, float("nan"))
    call = lambda: moe_mm(x, ids, weights, case["w2"], case["f4_none"], 0, misses, ws, out=out, cuda_w2=case["whole"])
    replayed_once(call, misses, out)  # Triton compiles outside capture
    assert same_bytes(out, eager) and misses.counts.tolist() == counts  # one replay counts the misses once


@pytest.mark.gpu
@needs_nvcc
def test_occupancy_at_deepseek_v3_shapes(case):
    """The design's residency (w2_gate_up_multi.cu, w2_down_multi.cu): 2 gate_up blocks (16 warps) per SM with
    114.8 KB of shared memory each at H = 7168, 4 down blocks per SM at I = 2048."""
    assert case["gate"][2].attributes(7168)["blocks_per_sm"] == 2
    assert case["down"][(2, 1)].attributes(2048)["blocks_per_sm"] == 4


# ---- v2 of the gate_up kernel (W2_STAGE_COLS, W2_WARPS; benchmarks/cuda-w2-notes.md "v2") --------------------

V2_SHAPES = [(8, 4), (4, 3), (4, 2)]  # (warps, stage_cols) of the benchmark's v2 variants
V2_BUILDS = [(8, 4, False), (4, 3, False), (4, 2, False), (8, 8, True), (8, 4, True), (4, 3, True)]  # + W2_EARLY


def model_gate_up_v2(w2, f4, ws, x, top_k, stage_cols: int, warps: int) -> np.ndarray:
    """w2_gate_up_multi built with W2_STAGE_COLS = stage_cols, W2_WARPS = warps: CUDA block (b, y), its warps
    (rows y * 8 * warps + 8 w ..), the passes z0 = 0, S, 2S, .. over the block's fill with only S columns in shared
    memory; float64 [P, I], NaN where nothing is written."""
    lay, inter = w2.layout, w2.layout.inter
    out = np.full((ws.act.shape[0], inter), np.nan)
    stride = lay.hidden // 2 + w2_multi.PAD_WORDS
    rows = 8 * warps
    for b in range(min(ws.block_expert.numel(), int(ws.num_blocks[0]))):
        expert, fill = int(ws.block_expert[b]), int(ws.block_fill[b])
        if int(f4.table[0, expert]) >= 0:
            continue
        block_pairs = ws.block_pairs[b * ws.block_tokens: b * ws.block_tokens + fill].tolist()
        words, scales = slot_rows(w2.slots[int(w2.table[0, expert])], lay, "w13")
        for y in range(inter // rows):
            for z0 in range(0, fill, stage_cols):
                count = min(fill - z0, stage_cols)
                pairs = block_pairs[z0: z0 + count]
                xp = build_pairs_multi(x, pairs, top_k, count, stride, lay.hidden)
                assert all(v == 0x7FC07FC0 for v in xp[stage_cols * stride:])  # nothing past the S staged columns
                base = [min(g, count - 1) * stride for g in range(8)]
                assert max(base) < stage_cols * stride
                for w in range(warps):
                    gate_up_warp_store(out, words, scales, y * rows + 8 * w, inter, xp, base,
                                       lay.w13.words_per_row // 32, pairs, count)
    return out


def test_v2_model_gives_the_default_kernels_values_exactly():
    """Passes of S staged columns (fills 1, 2, 3, 8, 11, 16 + 1 against S = 2, 3, 4) and 4-warp blocks write each
    pair's values exactly as the default model (column groups of 8, 8 warps), and those match the float64 reference;
    S = 8 with 8 warps is the default model itself."""
    gen = torch.Generator().manual_seed(21)
    w2, f4 = _pools(512, 64, gen)
    ids = _fill_ids()
    x = torch.randn(ids.shape[0], 512, generator=gen).to(torch.bfloat16)
    ws = _routed(ids, w2, f4, BT)
    default = model_gate_up_multi(w2, f4, ws, x, TOP_K)
    assert np.array_equal(model_gate_up_v2(w2, f4, ws, x, TOP_K, 8, 8), default, equal_nan=True)
    for warps, stage in V2_SHAPES:
        got = model_gate_up_v2(w2, f4, ws, x, TOP_K, stage, warps)
        assert np.array_equal(got, default, equal_nan=True), (warps, stage)
    for p, e in enumerate(ids.reshape(-1).tolist()):
        if e in (FP4_EXPERT, MISSING_EXPERT):
            assert np.isnan(default[p]).all()
            continue
        gate, up = (unpack_matrix_ref(w2.slots[e], w2.layout, "w13").double() @ x[p // TOP_K].double()).chunk(2)
        ref = (torch.nn.functional.silu(gate) * up).numpy()
        assert np.abs(default[p] - ref).max() <= 1e-9 * np.abs(ref).max(), p


def test_v2_shared_memory_and_carveout():
    assert w2_multi.shared_bytes(7168, 4) == 4 * (2 * 7168 + 16)  # 57,408
    assert w2_multi.fit_carveout(w2_multi.shared_bytes(7168), 2) == 100  # the default: 2 x 115.8 KB -> 228 KB
    assert w2_multi.fit_carveout(w2_multi.shared_bytes(7168, 4), 2) == 58  # 2 x 57.4 KB -> 132 KB, L1 124 KB
    assert w2_multi.fit_carveout(w2_multi.shared_bytes(7168, 3), 4) == 86  # 4 x 43.1 KB -> 196 KB, L1 60 KB
    assert w2_multi.fit_carveout(w2_multi.shared_bytes(7168, 2), 4) == 58  # 4 x 28.7 KB -> 132 KB
    with pytest.raises(ValueError, match="do not fit"):
        w2_multi.fit_carveout(w2_multi.shared_bytes(7168, 4), 4)  # 4 x (57,408 + 1,024) > 228 KB
    layout = w2_tier(1024, 96, 1, 1, 1, "cpu").layout
    w2_multi.gate_check_geometry(layout, 32)  # 4 warps: 32-row tiles
    with pytest.raises(ValueError, match="multiple of 64"):
        w2_multi.gate_check_geometry(layout)


@needs_nvcc
@pytest.mark.parametrize("warps,stage,early", V2_BUILDS)
def test_v2_compiles_without_spills(tmp_path, warps, stage, early):
    defines = {"W2_AHEAD": 2, "W2_WARPS": warps, "W2_STAGE_COLS": stage, "W2_EARLY": int(early)}
    report = ptxas_report(w2_multi.GATE_SOURCE, tmp_path / "k.cubin", defines)
    assert "0 bytes spill stores" in report and registers(report) <= 128  # 16 warps per SM at 128 registers


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens", [1, 2, 8, 32])
def test_v2_gate_up_bytes_equal_the_default_multi_kernel(case, tokens):
    """Every v2 build (carveout "fit" where S < 8) against the default multi kernel on the same route: NaN-poisoned
    outputs, byte-identical (FP4 and missing pairs' rows untouched), repeats byte-identical; at 32 tokens fills
    exceed 8 and every S (several passes per block); route blocks past num_blocks exit (grid = max_blocks)."""
    w2, f4 = case["w2"], case["f4"]
    ids = _ids(case, tokens)
    x = torch.randn(tokens, HIDDEN, generator=case["gen"]).to(torch.bfloat16).cuda()
    ws = _routed(ids, w2, f4, BT, "cuda")
    if tokens == 32:
        assert int(ws.block_fill[: int(ws.num_blocks[0])].max()) > 8
    default = torch.full_like(ws.act, float("nan"))
    case["gate"][2](x, TOP_K, w2, f4, 0, ws, out=default)
    fp4, missing, w2_rows = _kinds(ids)
    for warps, stage, early in V2_BUILDS:
        kernel = w2_multi.W2GateUpMultiCuda(ahead=2, warps=warps, stage_cols=stage, early=early,
                                            carveout="fit" if stage < 8 else "max")
        assert kernel.attributes(7168)["blocks_per_sm"] == 16 // warps  # the residency at DeepSeek-V3's H
        outs = [torch.full_like(ws.act, float("nan")) for _ in range(2)]
        for out in outs:
            kernel(x, TOP_K, w2, f4, 0, ws, out=out)
        torch.cuda.synchronize()
        assert w2_rows.any() and not outs[0][w2_rows].isnan().any() and outs[0][fp4 | missing].isnan().all()
        assert same_bytes(outs[0], default) and same_bytes(outs[1], default), (warps, stage, early)


def test_v2_bench_variants_are_named_only_and_checked_against_the_multi_kernel():
    from tests.test_cuda_w2 import _bench_module

    bench = _bench_module()
    names = [name for _, name, _ in bench._variants(None)]
    assert not any(name in names for _, name, _ in bench.MULTI_V2)  # the default run is unchanged
    picked = bench._variants("cuda_whole_multi_s4,cuda_gate_up_multi_w4s3,cuda_gate_up_multi,cuda_whole_multi")
    assert [name for _, name, _ in picked] == ["cuda_gate_up_multi", "cuda_gate_up_multi_w4s3", "cuda_whole_multi",
                                                "cuda_whole_multi_s4"]
    assert picked[1][2] == dict(ahead=2, warps=4, stage_cols=3, carveout="fit")
    assert picked[3][2]["gate_multi"] == dict(warps=8, stage_cols=4, carveout="fit")
    assert all(bench._block_tokens(name) == bench.MULTI_BT for _, name, _ in bench.MULTI_V2)
    good = dict(rel_err=3e-3, rel_err_vs_triton=5e-3, nan=False, repeat_identical=True, same_bytes_as_first=None)
    check = lambda v: [dict(variants=dict(cuda_gate_up_multi_s4=v))]
    assert bench._invalid(check(dict(good, same_bytes_as_multi=True)), "cuda_gate_up_multi_s4") == []
    assert "current multi-token" in bench._invalid(check(dict(good, same_bytes_as_multi=False)),
                                                   "cuda_gate_up_multi_s4")[0]
    a, b = torch.zeros(3, 4, dtype=torch.bfloat16), torch.zeros(3, 4, dtype=torch.bfloat16)
    b[1, 2] = -0.0  # one bit apart
    assert bench._vs_first("cuda_gate_up_multi_s4", a, None, b) == dict(same_bytes_as_first=None,
                                                                        same_bytes_as_multi=False)
    assert bench._vs_first("cuda_gate_up_multi", a, None, b) == dict(same_bytes_as_first=None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton kernels in the CPU interpreter (set without CUDA)")
def test_v2_bench_runs_end_to_end_on_cpu_with_stand_in_kernels(monkeypatch):
    """benchmarks/cuda_w2.py with the v2 variants named (stand-ins for every CUDA kernel, as test_cuda_w2's end-to-end
    test): checked against the multi variant (same_bytes_as_multi), timed on block_tokens 16, valid."""
    import argparse

    from tests.test_cuda_w2 import EXPERTS as E, HIDDEN as H, INTER as I, TOP_K as K, _bench_module, _stand_in_build

    bench = _bench_module()
    kb = bench._bench_kernels()
    bench_on_cpu(monkeypatch, bench, kb, _stand_in_build, (E, K, H, I))
    names = "cuda_gate_up_multi,cuda_gate_up_multi_s4,cuda_gate_up_multi_w4s3,cuda_whole_multi,cuda_whole_multi_w4s3"
    result = {}
    bench.run(kb, argparse.Namespace(preset="tiny", tokens="2", reps=1, variants=names), result, lambda r: None)
    assert result["status"] == "complete" and not result["errors"], result["errors"]
    checked = {}
    for check in result["checks"]:  # the down stage has no variant here: its row says so
        for name, v in check.get("variants", {}).items():
            assert bench._invalid([check], name) == [], (check["stage"], name, v)
            checked[name] = v.get("same_bytes_as_multi")
    assert checked == {name: True if "_multi_" in name else None for name in names.split(",")}
    timed = {(r["variant"], r["round"]): r for r in result["cases"]}
    for name in names.split(","):
        assert timed[(name, 1)]["block_tokens"] == 16 and timed[(name, 1)]["us"] == 10.0
