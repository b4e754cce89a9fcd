"""The W2 decode of slot pairs 0..4 by a multiply-add (W2_DECODE_MAD, kernels/cuda/w2_fragments.cuh `w2_pair`;
benchmarks/cuda-w2-notes.md "v5"): the same bits as the rotate-add, moved from the integer ALU to the FMA pipe.

CPU: the shift equals the rotation for pairs 0..4 on every mask bit (and not for 5..7, which keep the rotation), the
builds compile without spills with the same instruction count (LEA.HI traded for IMAD), the wrappers pass the define,
the benchmark's v5 variants. GPU: gate_up, down (both tile widths) and the whole op give the default builds' bytes.
"""

from __future__ import annotations

import re
import subprocess

import numpy as np
import pytest
import torch

from tests.cuda_fixtures import (M32, bench_module, fp4_pool, gate_up_into_nan, needs_nvcc, ptxas_report, registers,
                                 run_whole, same_bytes, stub_builds, to_cuda, w2_pool)
from tests.test_cuda_w2 import _cuobjdump, rotl
from tierstore.kernels import MissLog, MoeWorkspace, moe_route
from tierstore.kernels.cuda import loader, w2_down, w2_gate_up
from tierstore.kernels.cuda.w2_down import W2DownCuda
from tierstore.kernels.cuda.w2_gate_up import W2GateUpCuda
from tierstore.kernels.cuda import w2_multi
from tierstore.kernels.cuda.w2_moe import GATE_MULTI, SINGLE, W2MoeCuda
from tierstore.kernels.cuda.w2_multi import W2DownMultiCuda, W2GateUpMultiCuda
from tierstore.kernels.layout import w2_slot_layout

EXPERTS, TOP_K = 8, 2
EGP = dict(early=True, pairs_grid=True, pdl=True)  # the single-token options before v5


def _pair_mask(i: int) -> tuple[int, int]:
    """(rotation, mask) of slot pair i, as `w2_pair` computes them."""
    rot = (8 - 2 * i) & 31
    return rot, (rotl(0x81008100, 32 - rot) if rot else 0x81008100)


def test_the_shift_is_the_rotation_for_pairs_0_to_4_only():
    rng = np.random.default_rng(3)
    words = [int(w) for w in rng.integers(0, 2**32, 2000, dtype=np.uint64)] + [M32, 0]
    for i in range(8):
        rot, mask = _pair_mask(i)
        wraps = any((mask >> b) & 1 for b in range(32 - rot, 32)) if rot else False
        assert wraps == (i >= 5), i  # pairs 5..7 have a bit the rotation carries round: they keep the rotate-add
        if i <= 4:
            assert all(((w & mask) << rot) & M32 == rotl(w & mask, rot) for w in words)


def _ops(source, defines: dict, cubin) -> dict:
    ptxas_report(source, cubin, defines)
    text = subprocess.run([_cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    lines = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+([^;]*;)", text)]
    ops = [re.sub(r"^@!?U?P\w+ ", "", line).split(" ")[0].split(".")[0] for line in lines]
    return {"total": len(ops), "LEA": ops.count("LEA"), "IMAD": ops.count("IMAD")}


BUILDS = [(w2_gate_up.SOURCE, {"W2_AHEAD": 2}), (w2_gate_up.SOURCE, {"W2_AHEAD": 2, "W2_EARLY": 1, "W2_PDL": 1}),
          (w2_down.SOURCE, {"W2_AHEAD": 2, "W2_GROUPS": 1, "W2_EARLY": 1, "W2_PDL": 1}),
          (w2_down.SOURCE, {"W2_AHEAD": 2, "W2_GROUPS": 1, "W2_EARLY": 1, "W2_PDL": 1, "W2_WPS": 16})]


@needs_nvcc
@pytest.mark.parametrize("source,defines", BUILDS)
def test_mad_builds_compile_without_spills(tmp_path, source, defines):
    report = ptxas_report(source, tmp_path / "k.cubin", defines | {"W2_DECODE_MAD": 1})
    assert "0 bytes spill stores" in report and registers(report) <= 128  # 4 blocks of 128 threads per SM


@pytest.mark.skipif(loader.nvcc_path() is None or _cuobjdump() is None, reason="needs nvcc and cuobjdump")
@pytest.mark.parametrize("source,defines", BUILDS)
def test_mad_trades_rotate_adds_for_multiply_adds_one_for_one(tmp_path, source, defines):
    before = _ops(source, defines, tmp_path / "a.cubin")
    after = _ops(source, defines | {"W2_DECODE_MAD": 1}, tmp_path / "b.cubin")
    moved = before["LEA"] - after["LEA"]
    assert after["total"] == before["total"] and moved >= 150 and after["IMAD"] - before["IMAD"] == moved


def test_wrappers_pass_the_define(monkeypatch):
    built, _ = stub_builds(monkeypatch)
    W2GateUpCuda(ahead=2, device=0, early=True, mad=True)
    W2DownCuda(device=0, wps=16, mad=True)
    W2DownCuda(device=0)
    assert built == [("w2_gate_up.cu", {"W2_AHEAD": 2, "W2_EARLY": 1, "W2_DECODE_MAD": 1}),
                     ("w2_down.cu", {"W2_AHEAD": 2, "W2_DECODE_MAD": 1, "W2_GROUPS": 1, "W2_WPS": 16}),
                     ("w2_down.cu", {"W2_AHEAD": 2, "W2_GROUPS": 1})]  # off: the command of before
    default = W2MoeCuda(device=0)  # v5 adopted for the single-token kernels (w2_moe.SINGLE)
    assert SINGLE["mad"] and default.gate_up.mad and default.down.mad
    before = W2MoeCuda(device=0, gate_single=EGP, down_single=EGP)
    assert not (before.gate_up.mad or before.down.mad)
    built.clear()
    W2GateUpMultiCuda(device=0, early=True, mad=True)
    W2DownMultiCuda(device=0, wps=16, mad=True)
    assert built == [(w2_multi.GATE_SOURCE.name, {"W2_AHEAD": 2, "W2_EARLY": 1, "W2_DECODE_MAD": 1}),
                     (w2_multi.DOWN_SOURCE.name, {"W2_AHEAD": 2, "W2_GROUPS": 1, "W2_WPS": 16, "W2_DECODE_MAD": 1})]
    assert default.gate_up_multi.mad and default.gate_up_multi_wide.mad and default.down_multi.mad  # v5 adopted
    moe = W2MoeCuda(device=0, gate_multi={}, gate_multi_wide={}, down_multi={})
    assert not (moe.gate_up_multi.mad or moe.gate_up_multi_wide.mad or moe.down_multi.mad)


def test_bench_v5_variants_are_checked_against_the_default_kernels():
    bench = bench_module("cuda_w2")
    opts = {name: o for _, name, o in bench._variants("cuda_mma_ahead2_egm,cuda_down_gm,cuda_whole_egpm")}
    assert opts["cuda_mma_ahead2_egm"] == dict(ahead=2, early=True, pairs_grid=True, mad=True)
    assert opts["cuda_down_gm"] == dict(ahead=2, groups=1, pairs_grid=True, mad=True)
    assert opts["cuda_whole_egpm"]["gate_single"] == opts["cuda_whole_egpm"]["down_single"] == EGP | {"mad": True}
    assert [bench.V3_OF[n] for n in opts] == ["cuda_mma_ahead2", "cuda_down", "cuda_whole"]


# ---- on a GPU --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=[(1024, 512), (3584, 1408)])  # 32-word downs; 16-word ones with an odd tail
def mad_case(request):
    hidden, inter = request.param
    gen = torch.Generator().manual_seed(hidden + inter)
    return dict(hidden=hidden, inter=inter, gen=gen, w2=to_cuda(w2_pool(hidden, inter, EXPERTS, gen, missing=6)),
                f4=to_cuda(fp4_pool(hidden, inter, EXPERTS, 3)), f4_none=to_cuda(fp4_pool(hidden, inter, EXPERTS)),
                wps=w2_down.wps_of(w2_slot_layout(hidden, inter)))


def _routed(case, tokens):
    gen = case["gen"]
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)]).to(torch.int32)
    ids[0] = torch.tensor([3, 0], dtype=torch.int32)  # an FP4 pair and a W2 pair
    if tokens > 1:
        ids[-1] = torch.tensor([6, 1], dtype=torch.int32)  # a missing pair
    ids = ids.contiguous().cuda()
    ws = MoeWorkspace.allocate(tokens, TOP_K, EXPERTS, case["hidden"], case["inter"], torch.bfloat16, "cuda",
                               block_tokens=1)
    moe_route(ids, case["w2"], case["f4"], 0, MissLog.allocate(4, "cuda"), ws)
    return ids, ws


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_mad_stages_give_the_default_bytes(mad_case, tokens):
    ids, ws = _routed(mad_case, tokens)
    x = torch.randn(tokens, mad_case["hidden"], generator=mad_case["gen"]).to(torch.bfloat16).cuda()
    w2, f4 = mad_case["w2"], mad_case["f4"]

    def gate_up(kernel):
        return gate_up_into_nan(kernel, x, TOP_K, w2, f4, ws)

    base = gate_up(W2GateUpCuda(ahead=2))
    assert base.isfinite().any() and base.isnan().any()  # W2 rows written; FP4 and missing pairs' rows not
    for options in ({}, dict(early=True, pairs_grid=True)):
        kernel = W2GateUpCuda(ahead=2, mad=True, **options)
        assert same_bytes(gate_up(kernel), base) and same_bytes(gate_up(kernel), base), ("gate_up", options)

    ws.act.copy_(torch.randn(ws.act.shape, generator=mad_case["gen"]).to(torch.bfloat16))

    def down(kernel):
        out = torch.full_like(ws.y, -7.0)
        kernel(w2, f4, 0, ws, out=out)
        torch.cuda.synchronize()
        return out

    base = down(W2DownCuda(wps=mad_case["wps"]))
    flat = ids.reshape(-1).cpu()
    assert base[(flat == 3).cuda()].isnan().all() and (base[(flat == 6).cuda()] == -7.0).all()
    for options in ({}, dict(pairs_grid=True)):
        kernel = W2DownCuda(wps=mad_case["wps"], mad=True, **options)
        assert same_bytes(down(kernel), base) and same_bytes(down(kernel), base), ("down", options)


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens", [1, 4])
def test_whole_op_with_the_mad_decode_equals_the_default(mad_case, tokens):
    ids, _ = _routed(mad_case, tokens)
    ids[0] = torch.tensor([0, 6], dtype=torch.int32)
    x = torch.randn(tokens, mad_case["hidden"], generator=mad_case["gen"]).to(torch.bfloat16).cuda()
    weights = (torch.rand(tokens, TOP_K, generator=mad_case["gen"]) + 0.05).cuda()
    run = lambda moe: run_whole(x, ids, weights, mad_case["w2"], mad_case["f4_none"], moe, mad_case["inter"],
                                EXPERTS, 4)
    base, base_counts, _ = run(W2MoeCuda(wps=mad_case["wps"], gate_single=EGP, down_single=EGP))
    assert not base.isnan().any() and any(base_counts)  # expert 6 missed
    out, counts, _ = run(W2MoeCuda(wps=mad_case["wps"]))  # the default: SINGLE, mad included
    assert same_bytes(out, base) and counts == base_counts


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens", [4, 40])  # 1 and 10 pairs per expert: the 4- and the 8-column gate_up
def test_multi_token_kernels_with_the_mad_decode_give_the_default_bytes(mad_case, tokens):
    """The whole op on block_tokens 16 (the multi-token gate_up's 4- or 8-column build, and down) with W2MoeCuda's
    defaults (mad on every multi-token kernel) against the options before v5: same output bytes and miss counts."""
    ids, _ = _routed(mad_case, tokens)
    ids[0] = torch.tensor([0, 6], dtype=torch.int32)
    x = torch.randn(tokens, mad_case["hidden"], generator=mad_case["gen"]).to(torch.bfloat16).cuda()
    weights = (torch.rand(tokens, TOP_K, generator=mad_case["gen"]) + 0.05).cuda()
    run = lambda moe: run_whole(x, ids, weights, mad_case["w2"], mad_case["f4_none"], moe, mad_case["inter"],
                                EXPERTS, 4, block_tokens=16)
    before = {k: v for k, v in GATE_MULTI.items() if k != "mad"}  # the multi-token options before v5
    base, base_counts, _ = run(W2MoeCuda(wps=mad_case["wps"], gate_multi=before, gate_multi_wide={}, down_multi={}))
    assert not base.isnan().any() and any(base_counts)
    out, counts, _ = run(W2MoeCuda(wps=mad_case["wps"]))  # the defaults: mad on every multi-token kernel
    assert same_bytes(out, base) and counts == base_counts
