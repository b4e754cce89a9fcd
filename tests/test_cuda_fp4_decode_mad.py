"""The FP4 decode's right shifts as the high word of a multiply (FP4_DECODE_MAD, kernels/cuda/fp4_fragments.cuh
`f4_shr`; benchmarks/cuda-fp4-notes.md "v2"): the same bits, moved from the integer ALU (SHF) to the FMA pipe
(IMAD.HI).

CPU: the builds compile without spills and trade SHF for IMAD.HI in SASS; the wrappers, TierMoeCuda and the
benchmark pass the option. GPU: every FP4 kernel (single- and multi-token, both down tile widths) and the whole op
give the default builds' bytes, also for down scale bytes over 0..240.
"""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

from tests.cuda_fixtures import (bench_module, launched_twice, needs_nvcc, ptxas_report, random_slots, registers,
                                 run_whole, same_bytes, stub_builds, to_cuda, w2_pool)
from tests.test_cuda_w2 import _cuobjdump
from tierstore.kernels import MissLog, MoeWorkspace, fp4_tier, moe_route
from tierstore.kernels.cuda import fp4_multi, fp4_stages, loader, w2_down
from tierstore.kernels.layout import MAX_SCALE_BYTE, unpack_matrix_ref


def _ops(source, defines: dict, cubin) -> dict:
    """Per kernel of the cubin: instruction count, SHF and IMAD.HI."""
    ptxas_report(source, cubin, defines)
    text = subprocess.run([_cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    counts = {}
    for function in re.split(r"\n\s*Function : ", text)[1:]:
        name = function.split("\n")[0].strip()
        lines = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+([^;]*;)", function)]
        ops = [re.sub(r"^@!?U?P\w+ ", "", line).split(" ")[0] for line in lines]
        counts[name] = {"total": len(ops), "SHF": sum(op.startswith("SHF") for op in ops),
                        "IMAD.HI": sum(op.startswith("IMAD.HI") for op in ops)}
    return counts


BUILDS = [(fp4_stages.SOURCE, {"FP4_AHEAD": 2}), (fp4_stages.SOURCE, {"FP4_AHEAD": 2, "FP4_WPS": 16}),
          (fp4_multi.SOURCE, {"FP4_AHEAD": 2, "FP4_PDL": 1}), (fp4_multi.SOURCE, {"FP4_AHEAD": 1, "FP4_PDL": 1}),
          (fp4_multi.SOURCE, {"FP4_AHEAD": 1, "FP4_PDL": 1, "FP4_WPS": 16})]


@needs_nvcc
@pytest.mark.parametrize("source,defines", BUILDS)
def test_mad_builds_compile_without_spills_in_the_registers_of_before(tmp_path, source, defines):
    before = ptxas_report(source, tmp_path / "a.cubin", defines)
    after = ptxas_report(source, tmp_path / "b.cubin", defines | {"FP4_DECODE_MAD": 1})
    for kernel in re.findall(r"Compiling entry function '(\w+)'", after):
        info = after.split(f"Compiling entry function '{kernel}'")[1]
        assert re.search(r"\b0 bytes stack frame, 0 bytes spill stores", info), (kernel, info[:300])
        assert registers(info) <= registers(before.split(f"Compiling entry function '{kernel}'")[1]), kernel


@pytest.mark.skipif(loader.nvcc_path() is None or _cuobjdump() is None, reason="needs nvcc and cuobjdump")
@pytest.mark.parametrize("source,defines", BUILDS)
def test_mad_trades_shifts_for_multiply_highs(tmp_path, source, defines):
    """At least 128 SHF per kernel become IMAD.HI (4 per decoded word), at most 3 % more instructions in all."""
    before = _ops(source, defines, tmp_path / "a.cubin")
    after = _ops(source, defines | {"FP4_DECODE_MAD": 1}, tmp_path / "b.cubin")
    assert set(after) == set(before) and len(after) == 2
    for kernel, ops in after.items():
        moved = before[kernel]["SHF"] - ops["SHF"]
        assert moved >= 128 and ops["IMAD.HI"] - before[kernel]["IMAD.HI"] == moved, (kernel, before[kernel], ops)
        assert ops["total"] <= 1.03 * before[kernel]["total"], (kernel, before[kernel], ops)


def test_wrappers_tier_and_bench_pass_the_option(monkeypatch):
    from tierstore.kernels.cuda.tier_moe import FP4_SINGLE, TierMoeCuda
    from tierstore.kernels.cuda.w2_moe import W2MoeCuda

    built, _ = stub_builds(monkeypatch)
    fp4_stages.Fp4GateUpCuda(device=0, mad=True)
    fp4_stages.Fp4DownCuda(device=0, wps=16, mad=True)
    fp4_stages.Fp4DownCuda(device=0)
    fp4_multi.Fp4GateUpMultiCuda(device=0, pdl=True, mad=True)
    fp4_multi.Fp4DownMultiCuda(device=0, ahead=1, mad=True)
    name = fp4_stages.SOURCE.name
    assert built == [(name, {"FP4_AHEAD": 2, "FP4_DECODE_MAD": 1}),
                     (name, {"FP4_AHEAD": 2, "FP4_WPS": 16, "FP4_DECODE_MAD": 1}),
                     (name, {"FP4_AHEAD": 2}),  # off: the command of before
                     (fp4_multi.SOURCE.name, {"FP4_AHEAD": 2, "FP4_WARPS": 8, "FP4_STAGE_COLS": 4, "FP4_EARLY": 0,
                                              "FP4_PDL": 1, "FP4_DECODE_MAD": 1}),
                     (fp4_multi.SOURCE.name, {"FP4_AHEAD": 1, "FP4_EARLY": 0, "FP4_PDL": 0, "FP4_DECODE_MAD": 1})]
    w2 = W2MoeCuda(device=0)
    tier = TierMoeCuda(w2=w2, device=0, fp4_single=dict(mad=True))
    assert tier.fp4_gate_up.mad and tier.fp4_down.mad
    default = TierMoeCuda(w2=w2, device=0)
    assert (default.fp4_gate_up.mad, default.fp4_down.mad) == (FP4_SINGLE.get("mad", False),) * 2
    bench = bench_module("cuda_fp4")
    assert bench.selected("cuda_fp4_gate_up_m") == ["cuda_fp4_gate_up", "cuda_fp4_down", "cuda_fp4_whole",
                                                    "cuda_tier_mixed", "cuda_fp4_gate_up_m"]
    assert bench.SINGLE_MAD <= set(bench.VARIANTS)
    assert all(bench.MULTI[n]["gate"]["mad"] and bench.MULTI[n]["down"]["mad"]
               for n in ("cuda_fp4_whole_multi_pdl_m", "cuda_tier_mixed_multi_pdl_m"))
    with pytest.raises(ValueError, match=r"unknown variant\(s\) \['cuda_fp4_nope'\]"):
        bench.selected("cuda_fp4_gate_up_m,cuda_fp4_nope")


# ---- on a GPU --------------------------------------------------------------------------------------------------

EXPERTS, TOP_K, MISSING = 8, 2, 6
FP4_SLOTS = {1: 0, 2: 1, 4: 2}  # expert -> FP4 slot; expert 2 in both tiers (FP4 wins)


CASE_SHAPES = [(1024, 512), (2048, 1408)]  # (hidden, inter): 32-word downs; ds-v2-lite's 16-word ones


@pytest.fixture(scope="module", params=CASE_SHAPES)
def mad_case(request):
    return build_case(*request.param)


def build_case(hidden: int, inter: int) -> dict:
    """Both tiers on the GPU for one layer: W2 slots for every expert but MISSING, FP4 slots for FP4_SLOTS' experts;
    the generator the tests draw their inputs from."""
    gen = torch.Generator().manual_seed(hidden + inter)
    w2 = w2_pool(hidden, inter, EXPERTS, gen, (112, 124), missing=MISSING)
    f4 = fp4_tier(hidden, inter, len(FP4_SLOTS), 1, EXPERTS, "cpu")
    for expert, slot in FP4_SLOTS.items():
        f4.slots[slot] = random_slots(f4.slots[slot: slot + 1].clone(), f4.layout, gen, 116, 128)[0]
        f4.table[0, expert] = slot
    return dict(hidden=hidden, inter=inter, gen=gen, w2=to_cuda(w2), f4=to_cuda(f4), wps=w2_down.wps_of(f4.layout))


def _ids(case, tokens):
    rows = [torch.randperm(EXPERTS, generator=case["gen"])[:TOP_K].tolist() for _ in range(tokens)]
    rows[0] = [1, MISSING]
    if tokens > 1:
        rows[1] = [2, 5]
    return torch.tensor(rows, dtype=torch.int32).cuda()


def _routed(case, ids, block_tokens):
    ws = MoeWorkspace.allocate(ids.shape[0], TOP_K, EXPERTS, case["hidden"], case["inter"], torch.bfloat16, "cuda",
                               block_tokens=block_tokens)
    moe_route(ids, case["w2"], case["f4"], 0, MissLog.allocate(4, "cuda"), ws)
    return ws


def _fp4_rows(ids):
    return torch.tensor([e in FP4_SLOTS for e in ids.reshape(-1).tolist()], device="cuda")


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens", [1, 3, 8, 40])
def test_mad_fp4_kernels_give_the_default_bytes(mad_case, tokens):
    """Single-token gate_up and down, multi-token gate_up (4 and 8 columns) and down: with FP4_DECODE_MAD the bytes
    of the builds without it, twice each; the FP4 pairs' rows written, every other row left as it was."""
    case, f4, wps = mad_case, mad_case["f4"], mad_case["wps"]
    ids = _ids(case, tokens)
    rows = _fp4_rows(ids)
    x = torch.randn(tokens, case["hidden"], generator=case["gen"]).to(torch.bfloat16).cuda()
    single, multi = _routed(case, ids, 1), _routed(case, ids, 16)
    gate_ups = {(1, False): fp4_stages.Fp4GateUpCuda(), (1, True): fp4_stages.Fp4GateUpCuda(mad=True),
                (4, True): fp4_multi.Fp4GateUpMultiCuda(pdl=True, mad=True),
                (8, True): fp4_multi.Fp4GateUpMultiCuda(stage_cols=8, pdl=True, mad=True)}
    outs = {key: launched_twice({key: k}, single.act, float("nan"),
                                lambda k, out, ws=(single if key[0] == 1 else multi):
                                k(x, TOP_K, f4, 0, ws, out=out))[key] for key, k in gate_ups.items()}
    base = outs[(1, False)][0]
    assert not base[rows].isnan().any() and base[~rows].isnan().all()
    assert all(same_bytes(o, base) for pair in outs.values() for o in pair)

    act = torch.randn(single.act.shape, generator=case["gen"]).to(torch.bfloat16).cuda()
    single.act.copy_(act)
    multi.act.copy_(act)
    downs = {(1, False): fp4_stages.Fp4DownCuda(wps=wps), (1, True): fp4_stages.Fp4DownCuda(wps=wps, mad=True),
             (16, True): fp4_multi.Fp4DownMultiCuda(ahead=1, wps=wps, mad=True)}
    outs = {key: launched_twice({key: k}, single.y, -7.0,
                                lambda k, out, ws=(single if key[0] == 1 else multi): k(f4, 0, ws, out=out))[key]
            for key, k in downs.items()}
    torch.cuda.synchronize()
    base = outs[(1, False)][0]
    assert not base[rows].isnan().any() and (base[~rows] == -7.0).all()
    assert all(same_bytes(o, base) for pair in outs.values() for o in pair)


@pytest.mark.gpu
@needs_nvcc
def test_mad_down_is_exact_for_every_scale_byte(mad_case):
    """One-hot act rows through the single- and multi-token mad downs: y = one weight column, exact, for down
    scale bytes running over 0..240."""
    case = mad_case
    layout, m = case["f4"].layout, case["f4"].layout.w2
    slots = case["f4"].slots.clone()
    blocks = (7 * torch.arange(m.n).view(-1, 1) + torch.arange(m.blocks_per_row).view(1, -1)) % (MAX_SCALE_BYTE + 1)
    slots[:, layout.w2_scales_offset: layout.w2_scales_offset + m.scale_bytes] = blocks.to(torch.uint8).reshape(-1).cuda()
    f4 = type(case["f4"])(slots, case["f4"].table, layout)
    ids = _ids(case, 24)
    ks = torch.randint(0, case["inter"], (ids.numel(),), generator=case["gen"])
    for kernel, bt in ((fp4_stages.Fp4DownCuda(wps=case["wps"], mad=True), 1),
                       (fp4_multi.Fp4DownMultiCuda(ahead=1, wps=case["wps"], mad=True), 16)):
        ws = MoeWorkspace.allocate(ids.shape[0], TOP_K, EXPERTS, case["hidden"], case["inter"], torch.bfloat16,
                                   "cuda", block_tokens=bt)
        moe_route(ids, case["w2"], f4, 0, MissLog.allocate(4, "cuda"), ws)
        ws.act.zero_()
        ws.act[torch.arange(ids.numel()).cuda(), ks.cuda()] = 1.0
        out = kernel(f4, 0, ws, out=torch.full_like(ws.y, float("nan")))
        torch.cuda.synchronize()
        for p, e in enumerate(ids.reshape(-1).tolist()):
            if e in FP4_SLOTS:
                col = unpack_matrix_ref(slots[FP4_SLOTS[e]], layout, "w2")[:, int(ks[p])]
                assert torch.equal(out[p], col.cuda()), (bt, p)


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens,block_tokens", [(1, 1), (4, 1), (4, 16), (40, 16)])
def test_tier_moe_with_the_mad_decode_equals_the_default(mad_case, tokens, block_tokens):
    from tierstore.kernels.cuda.tier_moe import TierMoeCuda
    from tierstore.kernels.cuda.w2_moe import W2MoeCuda

    case = mad_case
    ids = _ids(case, tokens)
    x = torch.randn(tokens, case["hidden"], generator=case["gen"]).to(torch.bfloat16).cuda()
    weights = (torch.rand(tokens, TOP_K, generator=case["gen"]) + 0.05).cuda()
    w2 = W2MoeCuda(wps=w2_down.wps_of(case["w2"].layout))
    plain = TierMoeCuda(w2=w2, fp4_wps=case["wps"], fp4_single={}, fp4_gate_multi=dict(pdl=True),
                        fp4_down_multi=dict(ahead=1, pdl=True))
    mad = TierMoeCuda(w2=w2, fp4_wps=case["wps"], fp4_single=dict(mad=True), fp4_gate_multi=dict(pdl=True, mad=True),
                      fp4_down_multi=dict(ahead=1, pdl=True, mad=True))
    run = lambda tier: run_whole(x, ids, weights, case["w2"], case["f4"], tier, case["inter"], EXPERTS, 4,
                                 block_tokens=block_tokens)
    base, base_counts, _ = run(plain)
    assert not base.isnan().any() and base_counts[0] > 0  # expert MISSING missed
    out, counts, _ = run(mad)
    assert same_bytes(out, base) and counts == base_counts
