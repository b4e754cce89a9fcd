"""kernels/cuda: the CUDA C++ W2 gate_up (w2_gate_up.cu), its loader and a numpy model of the kernel.

CPU: argument packing and the kernel signature, the kernel compiling without spills (where nvcc exists),
and a numpy model that follows the .cu step by step (lane loads, LOP3/LEA.HI decode, scale pairs, the
shared-memory activation pairs, mma.m16n8k16 fragments as the PTX ISA defines them) against the reference.
The model checks the index and bit arithmetic, not the hardware; the GPU tests run the kernel itself.
"""

from __future__ import annotations

import ctypes
import re
import subprocess

import numpy as np
import pytest
import torch

from tierstore.kernels import MissLog, MoeWorkspace, fp4_tier, moe_gate_up, moe_route, w2_tier
from tierstore.kernels.cuda import loader
from tierstore.kernels.cuda.w2_gate_up import (ARG_KINDS, SOURCE, W2GateUpCuda, check_geometry, launch_args,
                                               w2_gate_up_ref)
from tierstore.kernels.layout import unpack_matrix_ref, w2_slot_layout

HIDDEN, INTER, EXPERTS, TOP_K = 1024, 64, 8, 2
M32 = 0xFFFFFFFF


def _random_pool(pool, gen, lo=110, hi=131):
    """Random code words, scale bytes in [lo, hi)."""
    pool.slots.copy_(torch.randint(0, 256, pool.slots.shape, generator=gen, dtype=torch.uint8))
    lay = pool.layout
    for offset, m in ((lay.w13_scales_offset, lay.w13), (lay.w2_scales_offset, lay.w2)):
        part = torch.randint(lo, hi, (pool.slots.shape[0], m.scale_bytes), generator=gen, dtype=torch.uint8)
        pool.slots[:, offset: offset + m.scale_bytes] = part


# ---- host side -------------------------------------------------------------------------------------------

def _signature_kinds(source: str) -> str:
    params = re.search(r"w2_gate_up_mma\((.*?)\)\s*\{", source, re.S).group(1)
    params = re.sub(r"//[^\n]*", "", params)
    kinds = ""
    for p in params.split(","):
        p = p.strip()
        kinds += "p" if "*" in p else "q" if p.startswith("long long") else "f" if p.startswith("float") else "i"
    return kinds


def test_arg_kinds_match_the_kernel_signature_and_launch_args():
    assert _signature_kinds(SOURCE.read_text()) == ARG_KINDS
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


def test_geometry_limits():
    check_geometry(w2_slot_layout(7168, 2048))
    with pytest.raises(ValueError, match="multiple of 512"):
        check_geometry(w2_slot_layout(1280, 64))


@pytest.mark.skipif(loader.nvcc_path() is None, reason="needs nvcc")
@pytest.mark.parametrize("ahead", [1, 2])
def test_kernel_compiles_without_spills(tmp_path, ahead):
    cmd = loader.nvcc_command(SOURCE, tmp_path / "k.cubin", "cubin", {"W2_AHEAD": ahead}) + ["-Xptxas", "-v"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    regs = int(re.search(r"Used (\d+) registers", proc.stderr).group(1))
    assert "0 bytes spill stores" in proc.stderr and regs <= 128  # 4 blocks of 128 threads per SM


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


def build_pairs(x_bits: list[int], hidden: int) -> list[int]:
    xp = [0] * (hidden // 2)
    for q in range(hidden // 16):
        ti, c = q >> 2, q & 3
        k = (ti >> 3) * 512 + (ti & 7) * 64 + 4 * c
        for m in range(4):
            xp[q * 8 + 2 * m] = x_bits[k + m] | (x_bits[k + 32 + m] << 16)
            xp[q * 8 + 2 * m + 1] = x_bits[k + 16 + m] | (x_bits[k + 48 + m] << 16)
    return xp


def model_gate_up(slot: torch.Tensor, layout, x: torch.Tensor) -> np.ndarray:
    """float64 [I]: what w2_gate_up_mma writes (before bf16 rounding) for one pair, lane by lane."""
    m = layout.w13
    words = slot[layout.w13_words_offset: layout.w13_words_offset + m.word_bytes].view(torch.int32)
    words = (words.to(torch.int64) & M32).view(m.n, m.words_per_row).tolist()
    scales = slot[layout.w13_scales_offset: layout.w13_scales_offset + m.scale_bytes].view(torch.int32)
    scales = (scales.to(torch.int64) & M32).view(m.n, m.blocks_per_row // 4).tolist()
    xp = build_pairs((x.view(torch.int16).to(torch.int64) & 0xFFFF).tolist(), layout.hidden)
    inter, out = layout.inter, np.zeros(layout.inter)
    for n0 in range(0, inter, 8):  # one warp
        acc = np.zeros((2, 16, 8))
        for t in range(m.words_per_row // 32):
            for i in range(8):
                for mm in range(4):
                    a_mat, b_mat = np.zeros((16, 16)), np.zeros((16, 8))
                    for lane in range(32):
                        g, c = lane >> 2, lane & 3
                        gate, up = words[n0 + g], words[n0 + g + inter]
                        sg, su = scale_pair(scales[n0 + g][4 * t: 4 * t + 4], i), scale_pair(scales[n0 + g + inter][4 * t: 4 * t + 4], i)
                        a = (w2_pair(gate[32 * t + 4 * c + mm], i, sg), w2_pair(up[32 * t + 4 * c + mm], i, su),
                             w2_pair(gate[32 * t + 16 + 4 * c + mm], i, sg), w2_pair(up[32 * t + 16 + 4 * c + mm], i, su))
                        b = xp[t * 256 + i * 32 + 8 * c + 2 * mm: t * 256 + i * 32 + 8 * c + 2 * mm + 2]
                        for reg, (row, col) in enumerate(((g, 2 * c), (g + 8, 2 * c), (g, 2 * c + 8), (g + 8, 2 * c + 8))):
                            a_mat[row, col: col + 2] = bf16_halves(a[reg])  # PTX ISA: A fragment of m16n8k16
                        for reg in range(2):
                            b_mat[2 * c + 8 * reg: 2 * c + 8 * reg + 2, g] = bf16_halves(b[reg])
                    acc[mm & 1] += a_mat @ b_mat
        gate_v, up_v = acc[:, :8, 0].sum(0), acc[:, 8:, 0].sum(0)  # lane (g, 0): d0 and d2
        out[n0: n0 + 8] = gate_v / (1 + np.exp(-gate_v)) * up_v
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
    _random_pool(w2, gen)
    x = torch.randn(HIDDEN, generator=gen).to(torch.bfloat16)
    w13 = unpack_matrix_ref(w2.slots[0], w2.layout, "w13").double()
    gate, up = (w13 @ x.double()).chunk(2)
    ref = (torch.nn.functional.silu(gate) * up).numpy()
    got = model_gate_up(w2.slots[0], w2.layout, x)
    assert np.abs(got - ref).max() <= 1e-9 * np.abs(ref).max()


# ---- the kernel on a GPU ---------------------------------------------------------------------------------

needs_nvcc = pytest.mark.skipif(loader.nvcc_path() is None, reason="needs nvcc")


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))  # NaN rows compare too


@pytest.fixture(scope="module")
def gpu_case():
    gen = torch.Generator().manual_seed(5)
    w2 = w2_tier(HIDDEN, INTER, EXPERTS, 1, EXPERTS, "cpu")
    _random_pool(w2, gen)
    w2.table[0] = torch.arange(EXPERTS, dtype=torch.int32)
    f4 = fp4_tier(HIDDEN, INTER, 1, 1, EXPERTS, "cpu")
    f4.table[0, 3] = 0  # expert 3 is FP4-resident: not the W2 kernel's work
    to = lambda pool: type(pool)(pool.slots.cuda(), pool.table.cuda(), pool.layout)
    return dict(w2=to(w2), f4=to(f4), cuda=W2GateUpCuda(), cuda2=W2GateUpCuda(ahead=2), gen=gen)


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
    out = torch.full_like(ws.act, float("nan"))
    case[kernel](x, TOP_K, case["w2"], case["f4"], 0, ws, out=out, swiglu_limit=limit)
    torch.cuda.synchronize()
    return out


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
    assert _same_bytes(out, _run(gpu_case, x, ws))  # repeat launch
    assert _same_bytes(out, _run(gpu_case, x, ws, kernel="cuda2"))  # prefetch depth changes no arithmetic
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
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        gpu_case["cuda"](x, TOP_K, gpu_case["w2"], gpu_case["f4"], 0, ws, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert _same_bytes(out, eager)


# ---- benchmarks/cuda_w2.py bookkeeping (no GPU) ----------------------------------------------------------

def _bench_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "cuda_w2.py"
    spec = importlib.util.spec_from_file_location("bench_cuda_w2_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_bench_marks_failed_checks_invalid_and_derives_ratios(capsys):
    bench = _bench_module()
    good = dict(rel_err=3e-3, nan=False, repeat_identical=True, equals_cuda_mma=True)
    check = dict(tokens=1, variants=dict(cuda_mma=good, cuda_mma_ahead2=dict(good, equals_cuda_mma=False)))
    invalid = {name: bench._invalid(check, name) for name in ("cuda_mma", "cuda_mma_ahead2", "missing")}
    assert invalid["cuda_mma"] == [] and "bytes differ" in invalid["cuda_mma_ahead2"][0]
    assert invalid["missing"] == ["check did not run or raised"]
    assert bench._invalid(dict(variants=dict(cuda_mma=dict(good, rel_err=float("nan")))), "cuda_mma")
    row = lambda variant, us, rnd=0: dict(tokens=1, variant=variant, round=rnd, us=us, bytes=66e6)
    rows = [row("cuda_mma", 25.0), row("cuda_mma", 24.0, 1), row("cuda_mma_ahead2", 20.0), row("triton_gate_up", 38.0),
            row("triton_gate_up", 40.0, 1), row("stream_read", 18.0)]
    bench._derive(rows, invalid, 4.8e12)
    assert rows[1]["triton_over_this"] == pytest.approx(38 / 24) and rows[1]["pct_of_stream"] == pytest.approx(75)
    assert rows[0]["pct_hbm"] == pytest.approx(100 * 66e6 / 25e-6 / 4.8e12)
    assert rows[2]["us"] is None and rows[2]["invalid_us"] == 20.0  # its check failed: time kept aside
    rows.append(dict(row("cuda_mma", None, 1), error=dict(type="CudaError", message="cuLaunchKernel failed")))
    bench._print(dict(build={"cuda_mma": dict(ahead=1, num_regs=96)}, checks=[check], cases=rows, status="complete"))
    printed = capsys.readouterr().out
    assert "INVALID (20.0 us" in printed and "ERROR CudaError" in printed and "status: complete" in printed


class _ReferenceKernel:
    """Stands in for W2GateUpCuda in the CPU run of the benchmark: writes the reference from the route output."""

    def __call__(self, x, top_k, w2, f4, layer, ws, out):
        for b in range(int(ws.num_blocks[0])):
            expert, pair = int(ws.block_expert[b]), int(ws.block_pairs[b])
            if int(f4.table[layer, expert]) < 0:
                w13 = unpack_matrix_ref(w2.slots[int(w2.table[layer, expert])], w2.layout, "w13")
                gate, up = (w13 @ x[pair // top_k].float()).chunk(2)
                out[pair] = (torch.nn.functional.silu(gate) * up).to(out.dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="runs the Triton kernels in the CPU interpreter (set without CUDA)")
def test_bench_runs_end_to_end_on_cpu_with_a_stand_in_kernel(monkeypatch):
    import argparse

    import tierstore.geometry
    from tierstore.geometry import _preset

    bench = _bench_module()
    kb = bench._bench_kernels()
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "_build", lambda ahead: (_ReferenceKernel(), dict(ahead=ahead)))
    monkeypatch.setattr(tierstore.geometry, "get_preset", lambda name: _preset("tiny", 1, EXPERTS, TOP_K, HIDDEN, INTER))
    monkeypatch.setattr(kb, "_graph_time_us", lambda fns, reps: fns[0]() or 10.0)  # one launch of each variant
    monkeypatch.setattr(kb, "_stream_us", lambda nbytes, copies, reps, device: 5.0)
    result, emitted = {}, []
    bench.run(kb, argparse.Namespace(preset="tiny", tokens="1,8", reps=1), result, lambda r: emitted.append(r["status"]))
    assert result["status"] == "complete" and not result["errors"], result["errors"]
    for check in result["checks"]:
        for v in check["variants"].values():
            assert v["rel_err"] < 1e-2 and v["repeat_identical"] and v["equals_cuda_mma"] and not v["nan"]
    timed = {(r["tokens"], r["variant"], r["round"]): r for r in result["cases"]}
    assert len(timed) == 2 * (3 * bench.ROUNDS + 1)
    assert timed[(8, "cuda_mma_ahead2", 1)]["triton_over_this"] == 1.0
    assert timed[(1, "stream_read", 0)]["pct_of_stream"] == 100.0
