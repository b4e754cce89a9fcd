"""Side-by-side MoE kernel benchmark on one GPU (CUDA-graph replay, L2 defeated by rotating routings).

Per (preset, T): fused W2 (all experts in the W2 pool; for BT = 1 also the plain-Triton decode
beside the default inline-PTX one, the two-pairs-per-program BT = 2 variant (`*_bt2`, v7), and the
tensor-core BT = 16 path), fused FP4 (all in the FP4
pool; for BT = 1 also its gate_up alone and the v8 bf16x2 decode, `fp4_*_bf16x2`, beside the default), the W2 gate_up stage alone, torch._grouped_mm in bf16 on the same routing (GEMM + SwiGLU
only, the routing sort precomputed), dequantize-then-_grouped_mm on the same W2 codes, and a
streaming-read kernel over the same number of bytes (the ceiling). Bytes = the unique routed experts' packed codes + scales (bf16: their bf16 weights).
Correctness against moe_mm_ref is checked first at T = 1 and 8.

    python benchmarks/kernels.py --preset deepseek-v3 --tokens 1,8,32 --config 64,8 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys

import torch
import triton
import triton.language as tl

from tierstore.geometry import get_preset
from tierstore.kernels._triton.decode import decode_w2_slot_scaled
from tierstore.kernels import (ABI_TAG, MissLog, MoeWorkspace, fp4_bf16x2_scales_exact, fp4_tier, moe_gate_up, moe_mm,
                               moe_mm_ref, moe_route, w2_tier)

HBM_BYTES_PER_S = 4.8e12


@triton.jit
def _stream_read_kernel(src_ptr, partial_ptr, n_words, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(ITERS):
        idx = (pid * ITERS + i) * BLOCK + offs
        acc += tl.load(src_ptr + idx, mask=idx < n_words, other=0)
    tl.store(partial_ptr + pid, tl.sum(acc, axis=0))


@triton.jit
def _dequant_w2_kernel(words_ptr, scales_ptr, slot_bytes, words_off, scales_off, words_per_row, blocks_per_row,
                       experts_ptr, table_ptr, out_ptr, N, K, WPS: tl.constexpr, BN: tl.constexpr):
    """Baseline: W2 slot of expert experts[program 0] -> bf16 out[expert] [N, K] (rows of program 1)."""
    expert = tl.load(experts_ptr + tl.program_id(0))
    base = tl.load(table_ptr + expert).to(tl.int64) * slot_bytes
    rows = tl.program_id(1) * BN + tl.arange(0, BN)
    u = tl.arange(0, WPS)
    words = words_ptr + (base + words_off) // 4 + rows[:, None] * words_per_row
    scales = scales_ptr + base + scales_off + rows[:, None] * blocks_per_row
    out = out_ptr + expert.to(tl.int64) * N * K + rows[:, None] * K
    for t in range(0, words_per_row // WPS):
        w = tl.load(words + t * WPS + u[None, :])
        for j in tl.static_range(16):
            k = t * 16 * WPS + j * WPS + u
            s = tl.load(scales + (k // 32)[None, :]).to(tl.int32)
            tl.store(out + k[None, :], decode_w2_slot_scaled(w, j, (s - 125) << 23).to(tl.bfloat16),
                     mask=(k < K)[None, :])


def _randomize_pool(pool) -> None:
    """Random code words, scale bytes in [118, 126] (random data, never zeros)."""
    pool.slots.random_(0, 256)
    lay = pool.layout
    for offset, m in ((lay.w13_scales_offset, lay.w13), (lay.w2_scales_offset, lay.w2)):
        pool.slots[:, offset: offset + m.scale_bytes].random_(118, 127)


def _graph_time_us(fns, reps: int) -> float:
    """Median over `reps` replays of one graph that runs every fn once, divided by len(fns)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:  # warm-up / compile outside capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    times.sort()
    return times[len(times) // 2]


def _stream_us(nbytes: int, copies: int, reps: int) -> float:
    words = nbytes // 4
    src = torch.randint(0, 1 << 20, (copies * words,), dtype=torch.int32, device="cuda")
    best = float("inf")
    for block, iters in ((2048, 4), (4096, 8), (8192, 4)):
        programs = triton.cdiv(words, block * iters)
        partial = torch.empty(programs, dtype=torch.int32, device="cuda")
        fns = [lambda c=c: _stream_read_kernel[(programs,)](src[c * words:], partial, words, BLOCK=block, ITERS=iters,
                                                            num_warps=8) for c in range(copies)]
        best = min(best, _graph_time_us(fns, reps))
    del src
    return best


def _routings(tokens, top_k, experts, count, gen):
    out = []
    for _ in range(count):
        scores = torch.rand(tokens, experts, generator=gen, device="cuda")
        ids = scores.topk(top_k, dim=1).indices.to(torch.int32)
        weights = torch.rand(tokens, top_k, generator=gen, device="cuda") + 0.05
        out.append((ids.contiguous(), weights))
    return out


def _check_correctness(geo, w2, f4, gen) -> list[dict]:
    rows = []
    for tier in ("w2", "fp4"):
        f4.table[0] = torch.arange(geo.num_experts, dtype=torch.int32) if tier == "fp4" else -1
        for tokens in (1, 8):
            ids, weights = _routings(tokens, geo.top_k, geo.num_experts, 1, gen)[0]
            x = torch.randn(tokens, geo.hidden, generator=gen, device="cuda").to(torch.bfloat16)
            ws = MoeWorkspace.allocate(tokens, geo.top_k, geo.num_experts, geo.hidden, geo.expert_inter, x.dtype, "cuda")
            ws.act.fill_(float("nan"))
            ws.y.fill_(float("nan"))
            out = torch.full_like(x, float("nan"))
            moe_mm(x, ids, weights, w2, f4, 0, MissLog.allocate(4, "cuda"), ws, out=out)
            ref, _, _ = moe_mm_ref(x, ids, weights, w2, f4, 0, act_dtype=torch.bfloat16)
            err = float((out.float() - ref).norm() / ref.norm())
            again = moe_mm(x, ids, weights, w2, f4, 0, MissLog.allocate(4, "cuda"), ws, out=torch.empty_like(x))
            ws2 = MoeWorkspace.allocate(tokens, geo.top_k, geo.num_experts, geo.hidden, geo.expert_inter, x.dtype,
                                        "cuda", block_tokens=2)
            bt2 = moe_mm(x, ids, weights, w2, f4, 0, MissLog.allocate(4, "cuda"), ws2, out=torch.full_like(x, float("nan")))
            bt2_err = float((bt2.float() - ref).norm() / ref.norm())
            rows.append(dict(tier=tier, tokens=tokens, rel_err=err, nan=bool(out.isnan().any()),
                             repeat_identical=bool(torch.equal(out, again)), bt2_rel_err=bt2_err,
                             bt2_equals_bt1=bool(torch.equal(out, bt2))))
            if tier == "fp4":  # v8: bf16x2 FP4 decode (inline PTX) and its plain-Triton twin, BT = 1
                extra = {}
                for mode in ("ptx", "triton"):
                    wsm = MoeWorkspace.allocate(tokens, geo.top_k, geo.num_experts, geo.hidden, geo.expert_inter,
                                                x.dtype, "cuda", block_tokens=1, fp4_bf16x2=mode)
                    wsm.act.fill_(float("nan"))
                    wsm.y.fill_(float("nan"))
                    o = moe_mm(x, ids, weights, w2, f4, 0, MissLog.allocate(4, "cuda"), wsm,
                               out=torch.full_like(x, float("nan")))
                    o2 = moe_mm(x, ids, weights, w2, f4, 0, MissLog.allocate(4, "cuda"), wsm, out=torch.empty_like(x))
                    extra[f"fp4_{mode}_rel_err"] = float((o.float() - ref).norm() / ref.norm())
                    extra[f"fp4_{mode}_nan"] = bool(o.isnan().any())
                    extra[f"fp4_{mode}_repeat_identical"] = bool(torch.equal(o, o2))
                    extra[f"fp4_{mode}_equals_default"] = bool(torch.equal(o, out))
                extra["fp4_scales_exact"] = fp4_bf16x2_scales_exact(f4)
                rows[-1].update(extra)
                print(f"check fp4 bf16x2 T={tokens}: {extra}", flush=True)
            print(f"check {tier} T={tokens}: rel_err {err:.2e} nan={rows[-1]['nan']} "
                  f"repeat_identical={rows[-1]['repeat_identical']} bt2_rel_err {bt2_err:.2e} "
                  f"bt2_equals_bt1={rows[-1]['bt2_equals_bt1']}", flush=True)
    f4.table[0] = -1
    return rows


def _bf16_case(geo, w13, w2d, routings, reps):
    """torch._grouped_mm gate_up + SwiGLU + down on the routed pairs, sorted by expert outside timing."""
    fns = []
    for ids, _ in routings:
        flat = ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=geo.num_experts)
        offs = torch.cumsum(counts, 0).to(torch.int32)
        x = torch.randn(flat.numel(), geo.hidden, device="cuda", dtype=torch.bfloat16)[order]

        def fn(x=x, offs=offs):
            gate_up = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs)
            gate, up = gate_up.chunk(2, dim=-1)
            act = torch.nn.functional.silu(gate) * up
            return torch._grouped_mm(act, w2d.transpose(-2, -1), offs=offs)
        fns.append(fn)
    return _graph_time_us(fns, reps)


def _dequant_case(geo, w2, w13_out, w2_out, routings, reps):
    """Dequantize the routed experts' W2 slots to bf16 (into the bf16 baseline's buffers), then the bf16 path."""
    lay = w2.layout
    fns = []
    for ids, _ in routings:
        flat = ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        offs = torch.cumsum(torch.bincount(flat, minlength=geo.num_experts), 0).to(torch.int32)
        experts = torch.unique(flat).to(torch.int32)
        x = torch.randn(flat.numel(), geo.hidden, device="cuda", dtype=torch.bfloat16)[order]

        def fn(x=x, offs=offs, experts=experts):
            for m, out, off_w, off_s in ((lay.w13, w13_out, lay.w13_words_offset, lay.w13_scales_offset),
                                         (lay.w2, w2_out, lay.w2_words_offset, lay.w2_scales_offset)):
                _dequant_w2_kernel[(experts.numel(), triton.cdiv(m.n, 32))](
                    w2.slots.view(torch.int32), w2.slots, lay.slot_bytes, off_w, off_s, m.words_per_row,
                    m.blocks_per_row, experts, w2.table, out, m.n, m.k, WPS=m.wps, BN=32, num_warps=4)
            gate_up = torch._grouped_mm(x, w13_out.transpose(-2, -1), offs=offs)
            gate, up = gate_up.chunk(2, dim=-1)
            act = torch.nn.functional.silu(gate) * up
            return torch._grouped_mm(act, w2_out.transpose(-2, -1), offs=offs)
        fns.append(fn)
    return _graph_time_us(fns, reps)


def _fused_case(geo, w2, f4, routings, reps, gate_up_only: bool, block_tokens: int | None = None,
                config: tuple[int, int] = (64, 4), ptx_w2: bool = True, fp4_bf16x2: str = "off"):
    fns = []
    for ids, weights in routings:
        tokens = ids.shape[0]
        x = torch.randn(tokens, geo.hidden, device="cuda", dtype=torch.bfloat16)
        ws = MoeWorkspace.allocate(tokens, geo.top_k, geo.num_experts, geo.hidden, geo.expert_inter, x.dtype, "cuda",
                                   block_tokens=block_tokens, block_n=config[0], num_warps=config[1], ptx_w2=ptx_w2,
                                   fp4_bf16x2=fp4_bf16x2)
        misses = MissLog.allocate(16, "cuda")
        out = torch.empty_like(x)
        if gate_up_only:
            moe_route(ids, w2, f4, 0, misses, ws)
            fns.append(lambda x=x, ws=ws: moe_gate_up(x, geo.top_k, w2, f4, 0, ws))
        else:
            fns.append(lambda x=x, ids=ids, w=weights, ws=ws, m=misses, o=out: moe_mm(x, ids, w, w2, f4, 0, m, ws, out=o))
    return _graph_time_us(fns, reps)


def _unique_experts(routings) -> float:
    return sum(torch.unique(ids).numel() for ids, _ in routings) / len(routings)


SWEEP_CONFIGS = [(16, 2), (32, 2), (32, 4), (64, 2), (64, 4), (64, 8), (128, 4), (128, 8), (256, 8)]


def _sweep(geo, w2, f4, gen, reps) -> tuple[list[dict], tuple[int, int]]:
    """W2 gate_up time per (block_n, num_warps) at T = 1 and 8; the best at T = 1 is used for the run."""
    rows = []
    routings = {t: _routings(t, geo.top_k, geo.num_experts, 6 if t == 1 else 4, gen) for t in (1, 8)}
    for config in SWEEP_CONFIGS:
        for tokens, rts in routings.items():
            us = _fused_case(geo, w2, f4, rts, reps, gate_up_only=True, config=config)
            rows.append(dict(tokens=tokens, block_n=config[0], num_warps=config[1], us=us))
            print(f"sweep gate_up T={tokens} BN={config[0]} warps={config[1]}: {us:.1f} us", flush=True)
    best = min((r for r in rows if r["tokens"] == 1), key=lambda r: r["us"])
    return rows, (best["block_n"], best["num_warps"])


def run(preset: str, token_counts: list[int], reps: int, sweep: bool, config: tuple[int, int] = (64, 8)) -> dict:
    geo = get_preset(preset)
    gen = torch.Generator(device="cuda").manual_seed(0)
    w2 = w2_tier(geo.hidden, geo.expert_inter, geo.num_experts, 1, geo.num_experts, "cuda")
    f4 = fp4_tier(geo.hidden, geo.expert_inter, geo.num_experts, 1, geo.num_experts, "cuda")
    _randomize_pool(w2)
    _randomize_pool(f4)
    w2.table[0] = torch.arange(geo.num_experts, dtype=torch.int32)
    checks = _check_correctness(geo, w2, f4, gen)
    sweep_rows, config = _sweep(geo, w2, f4, gen, reps) if sweep else ([], config)
    w13_bf16 = torch.randn(geo.num_experts, 2 * geo.expert_inter, geo.hidden, device="cuda", dtype=torch.bfloat16)
    w2_bf16 = torch.randn(geo.num_experts, geo.hidden, geo.expert_inter, device="cuda", dtype=torch.bfloat16)
    lay2, lay4 = w2.layout, f4.layout
    w2_expert = lay2.w13.word_bytes + lay2.w13.scale_bytes + lay2.w2.word_bytes + lay2.w2.scale_bytes
    w2_gate_up = lay2.w13.word_bytes + lay2.w13.scale_bytes
    f4_expert = lay4.w13.word_bytes + lay4.w13.scale_bytes + lay4.w2.word_bytes + lay4.w2.scale_bytes
    f4_gate_up = lay4.w13.word_bytes + lay4.w13.scale_bytes
    bf16_expert = 2 * 3 * geo.hidden * geo.expert_inter
    cases = []
    for tokens in token_counts:
        count = max(4, min(32, int(8 * 2**20 * 60 / (tokens * geo.top_k * w2_expert) + 1)))
        routings = _routings(tokens, geo.top_k, geo.num_experts, count, gen)
        unique = _unique_experts(routings)
        times = {
            "bf16_grouped_mm": _bf16_case(geo, w13_bf16, w2_bf16, routings, reps),
            "w2_fused": _fused_case(geo, w2, f4, routings, reps, gate_up_only=False, config=config),
            "w2_gate_up": _fused_case(geo, w2, f4, routings, reps, gate_up_only=True, config=config),
        }
        if tokens * geo.top_k <= geo.num_experts:  # BT = 1: the plain-Triton decode beside the inline-PTX one
            times["w2_fused_plain"] = _fused_case(geo, w2, f4, routings, reps, gate_up_only=False, config=config,
                                                  ptx_w2=False)
            times["w2_gate_up_plain"] = _fused_case(geo, w2, f4, routings, reps, gate_up_only=True, config=config,
                                                    ptx_w2=False)
        if tokens * geo.top_k <= geo.num_experts:  # v7: two pairs of one expert per program (BT = 2) beside BT = 1
            times["w2_fused_bt2"] = _fused_case(geo, w2, f4, routings, reps, gate_up_only=False, block_tokens=2,
                                                config=config)
            times["w2_gate_up_bt2"] = _fused_case(geo, w2, f4, routings, reps, gate_up_only=True, block_tokens=2,
                                                  config=config)
            # BN 64 / 8 warps compiles to 174 registers at BT = 2 (128 at BT = 1: one 8-warp block per SM
            # instead of two); BN 32 / 8 warps stays at 128. Both are timed.
            times["w2_fused_bt2_bn32"] = _fused_case(geo, w2, f4, routings, reps, gate_up_only=False, block_tokens=2,
                                                     config=(32, 8))
            times["w2_gate_up_bt2_bn32"] = _fused_case(geo, w2, f4, routings, reps, gate_up_only=True, block_tokens=2,
                                                       config=(32, 8))
        if tokens * geo.top_k <= 2 * geo.num_experts:  # default there is BT = 1 (FMA); compare the MMA path
            times["w2_fused_mma16"] = _fused_case(geo, w2, f4, routings, reps, gate_up_only=False, block_tokens=16,
                                                  config=config)
        times["dequant_grouped_mm"] = _dequant_case(geo, w2, w13_bf16, w2_bf16, routings, reps)
        f4.table[0] = torch.arange(geo.num_experts, dtype=torch.int32)
        times["fp4_fused"] = _fused_case(geo, w2, f4, routings, reps, gate_up_only=False, config=config)
        if tokens * geo.top_k <= geo.num_experts:  # v8: FP4 e2m1 -> bf16x2 construction + packed FMA (BT = 1)
            times["fp4_gate_up"] = _fused_case(geo, w2, f4, routings, reps, gate_up_only=True, config=config)
            times["fp4_fused_bf16x2"] = _fused_case(geo, w2, f4, routings, reps, gate_up_only=False, block_tokens=1,
                                                    config=config, fp4_bf16x2="ptx")
            times["fp4_gate_up_bf16x2"] = _fused_case(geo, w2, f4, routings, reps, gate_up_only=True, block_tokens=1,
                                                      config=config, fp4_bf16x2="ptx")
        if tokens * geo.top_k <= geo.num_experts:
            times["fp4_fused_bt2"] = _fused_case(geo, w2, f4, routings, reps, gate_up_only=False, block_tokens=2,
                                                 config=config)
        f4.table[0] = -1
        nbytes = {"bf16_grouped_mm": unique * bf16_expert, "w2_fused": unique * w2_expert,
                  "w2_fused_mma16": unique * w2_expert, "w2_fused_plain": unique * w2_expert, "dequant_grouped_mm": unique * w2_expert,
                  "w2_gate_up_plain": unique * w2_gate_up,
                  "w2_gate_up": unique * w2_gate_up, "fp4_fused": unique * f4_expert,
                  "w2_fused_bt2": unique * w2_expert, "w2_gate_up_bt2": unique * w2_gate_up,
                  "w2_fused_bt2_bn32": unique * w2_expert, "w2_gate_up_bt2_bn32": unique * w2_gate_up,
                  "fp4_fused_bt2": unique * f4_expert, "fp4_fused_bf16x2": unique * f4_expert,
                  "fp4_gate_up": unique * f4_gate_up, "fp4_gate_up_bf16x2": unique * f4_gate_up}
        stream = {name: _stream_us(int(b), 4 if b > 256e6 else max(4, int(4 * 64e6 / b) + 1), reps)
                  for name, b in nbytes.items()
                  if name in times and name not in ("bf16_grouped_mm", "w2_fused_mma16", "w2_fused_plain", "w2_gate_up_plain",
                                                        "dequant_grouped_mm", "w2_fused_bt2", "w2_gate_up_bt2",
                                                        "fp4_fused_bt2", "w2_fused_bt2_bn32", "w2_gate_up_bt2_bn32",
                                                        "fp4_fused_bf16x2", "fp4_gate_up_bf16x2")}
        for name, us in times.items():
            row = dict(preset=preset, tokens=tokens, variant=name, us=us, unique_experts=unique, bytes=nbytes[name],
                       gb_per_s=nbytes[name] / us / 1e3, pct_hbm=100 * nbytes[name] / (us * 1e-6) / HBM_BYTES_PER_S,
                       speedup_vs_bf16=times["bf16_grouped_mm"] / us, rotations=count)
            same_bytes = ("fp4_gate_up" if name.startswith("fp4_gate_up") else "w2_gate_up" if "gate_up" in name
                          else "fp4_fused" if name.startswith("fp4") else "w2_fused")
            ceiling = None if name == "bf16_grouped_mm" else stream.get(name, stream[same_bytes])
            if ceiling is not None:
                row["stream_us"] = ceiling
                row["pct_of_stream"] = 100 * ceiling / us
            cases.append(row)
            print(json.dumps(row), flush=True)
    return dict(checks=checks, sweep=sweep_rows, config=dict(block_n=config[0], num_warps=config[1]), cases=cases)


def _provenance(commit_hint: str | None) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "kernels", "benchmarks/kernels.py"],
                                    capture_output=True, text=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = commit_hint or "unknown", None  # the GPU machine's copy has no .git
    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                commit=commit, dirty=dirty, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                abi_tag=ABI_TAG, python=sys.version.split()[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="deepseek-v3")
    parser.add_argument("--tokens", default="1,8,32,64,512")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", required=True)
    parser.add_argument("--sweep", action="store_true", help="pick block_n/num_warps by W2 gate_up time at T=1 first")
    parser.add_argument("--config", default="64,8", help="block_n,num_warps when not sweeping")
    parser.add_argument("--commit", help="commit of the tree being measured, where it has no .git")
    args = parser.parse_args()
    result = dict(provenance=_provenance(args.commit), **run(args.preset, [int(t) for t in args.tokens.split(",")], args.reps, args.sweep,
                                                          tuple(int(v) for v in args.config.split(","))))
    with open(args.json, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"\n{'T':>4} {'variant':<20} {'us':>9} {'GB/s':>7} {'%HBM':>6} {'%stream':>8} {'x bf16':>7}")
    for r in result["cases"]:
        print(f"{r['tokens']:>4} {r['variant']:<20} {r['us']:>9.1f} {r['gb_per_s']:>7.0f} {r['pct_hbm']:>6.1f} "
              f"{r.get('pct_of_stream', float('nan')):>8.1f} {r['speedup_vs_bf16']:>7.2f}")


if __name__ == "__main__":
    main()
