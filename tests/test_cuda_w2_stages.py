"""The single-token W2 gate_up with its weight tiles staged through shared memory by cp.async (W2_STAGES,
kernels/cuda/w2_stages.cuh; benchmarks/cuda-w2-notes.md "v4").

CPU: the staged builds compile without spills, the default build's SASS does not change (W2_STAGES off), the wrapper
refuses a stage count of 1 and passes the define, its shared memory, and the benchmark's v4 variants. GPU: the staged
kernel's bytes equal the register-ring kernel's (same loads, decode and mmas in the same order) at K tile counts below,
at and above the stage count, eagerly and replayed in a CUDA graph, and the whole op with it equals the default one.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

from tests.cuda_fixtures import (bench_module, captured, fp4_pool, gate_up_into_nan, needs_nvcc, ptxas_report,
                                 registers, run_whole, same_bytes, side_stream, stub_builds, to_cuda, w2_pool)
from tests.test_cuda_w2 import _cuobjdump
from tierstore.kernels import MissLog, MoeWorkspace, moe_route
from tierstore.kernels.cuda import loader, w2_gate_up
from tierstore.kernels.layout import w2_slot_layout
from tierstore.kernels.cuda.w2_gate_up import SOURCE, W2GateUpCuda, w2_gate_up_ref
from tierstore.kernels.cuda.w2_moe import SINGLE, W2MoeCuda

INTER, EXPERTS, TOP_K = 512, 8, 2  # the down's K one 32-word tile (the whole op's test)
BEFORE = "c9e717b"  # the gate_up before W2_STAGES


@needs_nvcc
@pytest.mark.parametrize("stages", [2, 3, 4, 6])
@pytest.mark.parametrize("v3", [{}, {"W2_EARLY": 1, "W2_PDL": 1}])
def test_staged_builds_compile_without_spills(tmp_path, stages, v3):
    report = ptxas_report(SOURCE, tmp_path / "k.cubin", {"W2_AHEAD": 2, "W2_STAGES": stages} | v3)
    assert "0 bytes spill stores" in report and registers(report) <= 128  # 4 blocks of 128 threads per SM


def _sass(source: Path, defines: dict, cubin: Path) -> list[str]:
    ptxas_report(source, cubin, defines)
    text = subprocess.run([_cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    return [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+([^;]*;)", text)]


@pytest.mark.skipif(loader.nvcc_path() is None or _cuobjdump() is None, reason="needs nvcc and cuobjdump")
@pytest.mark.parametrize("defines", [{"W2_AHEAD": 1}, {"W2_AHEAD": 2}, {"W2_AHEAD": 2, "W2_EARLY": 1, "W2_PDL": 1}])
def test_stages_off_builds_the_sass_of_before(tmp_path, defines):
    """W2_STAGES 0 (the default): the gate_up's SASS equals the one at BEFORE (its .cu and headers from git)."""
    root = Path(__file__).resolve().parents[1]
    old_dir = tmp_path / "old"
    old_dir.mkdir()
    for path in [SOURCE, *SOURCE.parent.glob("*.cuh")]:
        rel = path.relative_to(root).as_posix()
        proc = subprocess.run(["git", "show", f"{BEFORE}:{rel}"], capture_output=True, cwd=root)
        if proc.returncode == 0:
            (old_dir / path.name).write_bytes(proc.stdout)
        elif path == SOURCE:
            pytest.skip(f"git show {BEFORE}:{rel} failed (no history here)")
    old = _sass(old_dir / SOURCE.name, defines, tmp_path / "old.cubin")
    new = _sass(SOURCE, defines, tmp_path / "new.cubin")
    assert len(new) > 500 and new == old


def test_wrapper_refuses_one_stage_and_passes_the_define(monkeypatch):
    built, carveouts = stub_builds(monkeypatch)
    for bad in (1, -2):
        with pytest.raises(ValueError, match="stages is 0 .* or at least 2"):
            W2GateUpCuda(ahead=2, device=0, stages=bad)
    plain = W2GateUpCuda(ahead=2, device=0)
    staged = W2GateUpCuda(ahead=2, device=0, early=True, stages=4)
    assert built == [("w2_gate_up.cu", {"W2_AHEAD": 2}), ("w2_gate_up.cu", {"W2_AHEAD": 2, "W2_EARLY": 1, "W2_STAGES": 4})]
    assert carveouts == [True]  # only the staged build asks for the largest carveout
    assert plain.shared_bytes(w2_slot_layout(7168, 2048)) == 14336  # the activation pairs alone, as before
    assert staged.shared_bytes(w2_slot_layout(7168, 2048)) == 14336 + 4 * w2_gate_up.STAGE_BYTES == 51200  # 4 per SM fit 228 KB
    moe = W2MoeCuda(device=0, gate_single=SINGLE | {"stages": 3})
    assert moe.gate_up.stages == 3 and moe.down.pdl and W2MoeCuda(device=0).gate_up.stages == 0


def test_bench_v4_variants_are_checked_against_the_default_kernels():
    bench = bench_module("cuda_w2")
    names = [name for _, name, _ in bench._variants("cuda_mma_ahead2,cuda_mma_ahead2_egs4,cuda_whole,cuda_whole_egps3")]
    assert names == ["cuda_mma_ahead2", "cuda_mma_ahead2_egs4", "cuda_whole", "cuda_whole_egps3"]
    opts = {name: o for _, name, o in bench._variants("cuda_mma_ahead2_egs4,cuda_whole_egps3")}
    assert opts["cuda_mma_ahead2_egs4"] == dict(ahead=2, early=True, pairs_grid=True, stages=4)
    assert opts["cuda_whole_egps3"]["gate_single"] == dict(early=True, pairs_grid=True, pdl=True, stages=3)
    assert opts["cuda_whole_egps3"]["down_single"] == dict(early=True, pairs_grid=True, pdl=True)
    assert bench.V3_OF["cuda_mma_ahead2_egs4"] == "cuda_mma_ahead2" and bench.V3_OF["cuda_whole_egps3"] == "cuda_whole"
    assert not any(name in bench.V3_OF for _, name, _ in bench._variants(None))  # not in the default run


# ---- on a GPU --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=[1024, 3584])  # 2 and 7 K tiles: fewer than the stages, and a ragged tail
def staged_case(request):
    hidden = request.param
    gen = torch.Generator().manual_seed(hidden)
    w2 = to_cuda(w2_pool(hidden, INTER, EXPERTS, gen, missing=6))
    f4 = to_cuda(fp4_pool(hidden, INTER, EXPERTS, 3))  # expert 3 FP4-resident: skipped by the W2 gate_up
    return dict(hidden=hidden, w2=w2, f4=f4, f4_none=to_cuda(fp4_pool(hidden, INTER, EXPERTS)), gen=gen,
                ring=W2GateUpCuda(ahead=2), ring_v3=W2GateUpCuda(ahead=2, early=True, pairs_grid=True, pdl=True))


def _route(case, tokens):
    gen = case["gen"]
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(tokens)]).to(torch.int32)
    ids[0] = torch.tensor([3, 0], dtype=torch.int32)  # an FP4 pair (skipped) and a W2 pair
    if tokens > 1:
        ids[-1] = torch.tensor([6, 1], dtype=torch.int32)  # a missing pair
    ids = ids.contiguous().cuda()
    x = torch.randn(tokens, case["hidden"], generator=gen).to(torch.bfloat16).cuda()
    ws = MoeWorkspace.allocate(tokens, TOP_K, EXPERTS, case["hidden"], INTER, torch.bfloat16, "cuda", block_tokens=1)
    moe_route(ids, case["w2"], case["f4"], 0, MissLog.allocate(4, "cuda"), ws)
    return ids, x, ws


def _launch(case, kernel, x, ws) -> torch.Tensor:
    return gate_up_into_nan(kernel, x, TOP_K, case["w2"], case["f4"], ws)


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_staged_gate_up_bytes_equal_the_register_ring(staged_case, tokens):
    ids, x, ws = _route(staged_case, tokens)
    ref = w2_gate_up_ref(x, ids, staged_case["w2"], staged_case["f4"], 0)
    w2_rows = ~ref.isnan().any(dim=1)
    ring = _launch(staged_case, staged_case["ring"], x, ws)
    assert w2_rows.any() and not ring[w2_rows].isnan().any() and ring[~w2_rows].isnan().all()
    assert float((ring[w2_rows].float() - ref[w2_rows]).norm() / ref[w2_rows].norm()) <= 1e-2
    for stages in (2, 3, 4):
        for options in ({}, dict(early=True, pairs_grid=True, pdl=True)):
            kernel = W2GateUpCuda(ahead=2, stages=stages, **options)
            first, second = _launch(staged_case, kernel, x, ws), _launch(staged_case, kernel, x, ws)
            assert same_bytes(first, ring) and same_bytes(second, ring), (stages, options)


@pytest.mark.gpu
@needs_nvcc
def test_staged_gate_up_replays_in_a_cuda_graph(staged_case):
    _, x, ws = _route(staged_case, 4)
    eager = _launch(staged_case, staged_case["ring"], x, ws)
    kernel = W2GateUpCuda(ahead=2, stages=4, early=True, pairs_grid=True)
    out = torch.full_like(ws.act, float("nan"))
    graph = captured(lambda: kernel(x, TOP_K, staged_case["w2"], staged_case["f4"], 0, ws, out=out), side_stream())
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert same_bytes(out, eager)


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens", [1, 4])
def test_whole_op_with_the_staged_gate_up_equals_the_default(staged_case, tokens):
    """W2MoeCuda with gate_single SINGLE + stages (the benchmark's cuda_whole_egps<n>) against W2MoeCuda's default:
    same output bytes and miss counts (expert 6 missing), no FP4 pool."""
    ids, x, _ = _route(staged_case, tokens)
    ids[0] = torch.tensor([0, 6], dtype=torch.int32)
    weights = (torch.rand(tokens, TOP_K, generator=staged_case["gen"]) + 0.05).cuda()
    run = lambda moe: run_whole(x, ids, weights, staged_case["w2"], staged_case["f4_none"], moe, INTER, EXPERTS, 4)
    base, base_counts, _ = run(W2MoeCuda())
    assert not base.isnan().any()
    for stages in (3, 4):
        out, counts, _ = run(W2MoeCuda(gate_single=SINGLE | {"stages": stages}))
        assert same_bytes(out, base) and counts == base_counts, stages
