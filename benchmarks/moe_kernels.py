"""Side-by-side MoE kernel benchmark on one GPU (CUDA-graph replay, L2 defeated by rotating routings).

Per (preset, T): fused W2 (all experts in the W2 pool; for BT = 1 also the plain-Triton decode
beside the default inline-PTX one, the tensor-core BT = 16 path, and the stages alone: gate_up,
down, route + combine), fused FP4 (all in the FP4 pool; for BT = 1 also its gate_up alone),
torch._grouped_mm in bf16 on the same routing (GEMM + SwiGLU + GEMM, the routing sort precomputed),
dequantize-then-_grouped_mm on the same W2 codes, and a streaming-read kernel over the same number
of bytes (the ceiling). Bytes = the unique routed experts' packed codes + scales (bf16: their bf16
weights; route + combine: none). New variants: MoeWorkspace options (CANDIDATES), each timed as the whole op,
W2 and FP4, with a check of its bytes against the default. Correctness against moe_mm_ref is checked at T = 1 and 8.

Order and failures: the current kernels' checks, then every T's current kernels and baselines
(BASELINE_VARIANTS, with the streaming ceilings), then the checks of the alternatives (FP4 "off"
decode and plain twin, CANDIDATES), then every T's new variants (NEW_VARIANTS). Each check and timed variant runs isolated (Runner): an exception goes into its row
(`error`: type, message, traceback lines) and `errors`, and the run goes on; after a CUDA error (or
any error after which a probe of the context fails) later GPU work is skipped (`error.type` Skipped)
and `status` says why. A variant whose check failed (rel. error > REL_TOL, NaN, repeat or bytes not
identical where they must be, check raised or not run) gets `invalid` (reasons) and `us` None; the
time is kept as `invalid_us`. The JSON is rewritten (atomically) after every stage and on SIGTERM.

    python benchmarks/moe_kernels.py --preset deepseek-v3 --tokens 1,8,32 --config 64,8 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import traceback

import torch
import triton
import triton.language as tl

from tierstore.geometry import get_preset
from tierstore.kernels._triton.decode import decode_w2_slot_scaled
from tierstore.kernels import (ABI_TAG, MissLog, MoeWorkspace, fp4_tier, moe_combine, moe_down, moe_gate_up, moe_mm,
                               moe_mm_ref, moe_route, w2_tier)

HBM_BYTES_PER_S = 4.8e12


INT32_MAX = 2**31 - 1
STREAM_CONFIGS = ((2048, 4), (4096, 8), (8192, 4))  # (BLOCK, ITERS) of the streaming read; the best one counts


@triton.jit
def _stream_block_start(pid, i, BLOCK: tl.constexpr, ITERS: tl.constexpr, WIDE: tl.constexpr):
    """First word index of iteration i of program pid (int32, as tl.program_id). WIDE: in int64, which a read
    of more than 2^31 words (8 GiB) needs; in int32 the index wraps negative there and the load faults (kimi-k2
    T = 512, fp4_fused: 2.25e9 words). The int32 form is the code that measured every earlier ceiling."""
    if WIDE:
        pid = pid.to(tl.int64)
    return (pid * ITERS + i) * BLOCK


@triton.jit
def _stream_read_kernel(src_ptr, partial_ptr, n_words, BLOCK: tl.constexpr, ITERS: tl.constexpr,
                        WIDE: tl.constexpr = False):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(ITERS):
        idx = _stream_block_start(pid, i, BLOCK, ITERS, WIDE) + offs
        acc += tl.load(src_ptr + idx, mask=idx < n_words, other=0)
    tl.store(partial_ptr + pid, tl.sum(acc, axis=0))


def _stream_wide(words: int, block: int, iters: int) -> bool:
    """Whether the streaming read of `words` int32 words needs int64 word indices: its largest index is
    programs * iters * block - 1 (programs = cdiv(words, block * iters))."""
    return triton.cdiv(words, block * iters) * iters * block - 1 > INT32_MAX


def _stream_launch(src, partial, words: int, block: int, iters: int):
    """One streaming read of src[:words] (int32) by cdiv(words, block * iters) programs into partial."""
    programs = triton.cdiv(words, block * iters)
    return _stream_read_kernel[(programs,)](src, partial, words, BLOCK=block, ITERS=iters,
                                           WIDE=_stream_wide(words, block, iters), num_warps=8)


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


def _stream_us(nbytes: int, copies: int, reps: int, device: str = "cuda") -> float:
    words = nbytes // 4
    src = torch.randint(0, 1 << 20, (copies * words,), dtype=torch.int32, device=device)
    best = float("inf")
    for block, iters in STREAM_CONFIGS:
        partial = torch.empty(triton.cdiv(words, block * iters), dtype=torch.int32, device=device)
        fns = [lambda c=c: _stream_launch(src[c * words:], partial, words, block, iters) for c in range(copies)]
        best = min(best, _graph_time_us(fns, reps))
    return best


def _routings(tokens, top_k, experts, count, gen, device="cuda"):
    out = []
    for _ in range(count):
        scores = torch.rand(tokens, experts, generator=gen, device=device)
        ids = scores.topk(top_k, dim=1).indices.to(torch.int32)
        weights = torch.rand(tokens, top_k, generator=gen, device=device) + 0.05
        out.append((ids.contiguous(), weights))
    return out


REL_TOL = 1e-2  # relative error vs moe_mm_ref above which a path's timing rows are marked invalid


def _rel_err(out, ref) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def _default_check(geo, w2, f4, tier, tokens, gen, device):
    """The default path against moe_mm_ref: (check row, inputs for the variant checks)."""
    f4.table[0] = torch.arange(geo.num_experts, dtype=torch.int32) if tier == "fp4" else -1
    ids, weights = _routings(tokens, geo.top_k, geo.num_experts, 1, gen, device)[0]
    x = torch.randn(tokens, geo.hidden, generator=gen, device=device).to(torch.bfloat16)
    ws = MoeWorkspace.allocate(tokens, geo.top_k, geo.num_experts, geo.hidden, geo.expert_inter, x.dtype, device)
    ws.act.fill_(float("nan"))
    ws.y.fill_(float("nan"))
    out = torch.full_like(x, float("nan"))
    moe_mm(x, ids, weights, w2, f4, 0, MissLog.allocate(4, device), ws, out=out)
    ref, _, _ = moe_mm_ref(x, ids, weights, w2, f4, 0, act_dtype=torch.bfloat16)
    again = moe_mm(x, ids, weights, w2, f4, 0, MissLog.allocate(4, device), ws, out=torch.empty_like(x))
    row = dict(rel_err=_rel_err(out, ref), nan=bool(out.isnan().any()), repeat_identical=bool(torch.equal(out, again)))
    return row, dict(tier=tier, tokens=tokens, ids=ids, weights=weights, x=x, out=out, ref=ref)


def _fp4_mode_check(geo, w2, f4, inp, mode, device) -> dict:
    """The FP4 decodes beside the default ("ptx", v8): "off" (float16 nibble decode) and "triton" (the
    plain twin of the bf16x2 construction; its bytes equal "off"'s). Returns the check columns and `out`."""
    x, ids, weights = inp["x"], inp["ids"], inp["weights"]
    wsm = MoeWorkspace.allocate(inp["tokens"], geo.top_k, geo.num_experts, geo.hidden, geo.expert_inter, x.dtype,
                                device, block_tokens=1, fp4_bf16x2=mode)
    wsm.act.fill_(float("nan"))
    wsm.y.fill_(float("nan"))
    o = moe_mm(x, ids, weights, w2, f4, 0, MissLog.allocate(4, device), wsm, out=torch.full_like(x, float("nan")))
    o2 = moe_mm(x, ids, weights, w2, f4, 0, MissLog.allocate(4, device), wsm, out=torch.empty_like(x))
    return {f"fp4_{mode}_rel_err": _rel_err(o, inp["ref"]), f"fp4_{mode}_nan": bool(o.isnan().any()),
            f"fp4_{mode}_repeat_identical": bool(torch.equal(o, o2)), "out": o}


# MoeWorkspace.allocate options timed beside the default (BT = 1 only); `exact`: designed to give the default's
# bytes, so `<name>_equals_default` must be True. down64w8: the down launch before v9's adoption (64 rows / 8 warps
# at every T; the default is 32 rows / 4 warps from 64 pairs up): equal to the default at T = 1 (a repeat of the
# same launch), the pre-adoption launch at T = 8 / 32, and the GPU check that the choice leaves the bytes alone.
CANDIDATES = {
    "down64w8": (dict(down_block_n=64, down_num_warps=8), True),
}


def _candidate_check(geo, w2, f4, inp, options, device) -> dict:
    """A candidate through the whole op on the default check's inputs: rel. error, NaN, repeat, bytes equal to
    the default."""
    x, ids, weights = inp["x"], inp["ids"], inp["weights"]
    ws = MoeWorkspace.allocate(inp["tokens"], geo.top_k, geo.num_experts, geo.hidden, geo.expert_inter, x.dtype,
                               device, **options)
    ws.act.fill_(float("nan"))
    ws.y.fill_(float("nan"))
    o = moe_mm(x, ids, weights, w2, f4, 0, MissLog.allocate(4, device), ws, out=torch.full_like(x, float("nan")))
    o2 = moe_mm(x, ids, weights, w2, f4, 0, MissLog.allocate(4, device), ws, out=torch.empty_like(x))
    return dict(rel_err=_rel_err(o, inp["ref"]), nan=bool(o.isnan().any()), repeat_identical=bool(torch.equal(o, o2)),
                equals_default=bool(torch.equal(o, inp["out"])))


def _check_group(variant: str) -> str | None:
    """Which correctness check covers a timed variant (None: not checked here, e.g. plain, MMA, baselines)."""
    for name in CANDIDATES:
        if variant.endswith("_" + name):
            return f"{variant.split('_')[0]}_{name}"
    return {"w2_fused": "w2_default", "w2_gate_up": "w2_default", "w2_down": "w2_default",
            "w2_route_combine": "w2_default", "fp4_fused": "fp4_default", "fp4_gate_up": "fp4_default"}.get(variant)


def _invalid_reasons(checks: list[dict]) -> dict[str, list[str]]:
    """Check group -> why its timings must not be read (a failed, errored or missing check). Groups absent:
    checked and passed. `fp4_off_*` / `fp4_triton_*` (not timed) are reported in the check rows only."""
    reasons: dict[str, list[str]] = {}

    def bad(group, row, why):
        reasons.setdefault(group, []).append(f"{row['tier']} T={row['tokens']}: {why}")

    for row in checks:
        tier = row["tier"]
        groups = [(f"{tier}_default", "error", "rel_err", "nan", "repeat_identical", None)]
        groups += [(f"{tier}_{name}", f"{name}_error", f"{name}_rel_err", f"{name}_nan", f"{name}_repeat_identical",
                    f"{name}_equals_default" if exact else None) for name, (_, exact) in CANDIDATES.items()]
        for group, err_key, rel_key, nan_key, rep_key, eq_key in groups:
            if err_key in row:
                bad(group, row, f"check raised {row[err_key]['type']}: {row[err_key]['message'][:200]}")
            elif rel_key not in row:
                bad(group, row, "check not run")
            else:
                if not row[rel_key] <= REL_TOL:  # NaN fails too
                    bad(group, row, f"{rel_key} {row[rel_key]:.3g} > {REL_TOL:g}")
                if nan_key and row.get(nan_key):
                    bad(group, row, "NaN in output")
                if rep_key and row.get(rep_key) is False:
                    bad(group, row, "repeat run not bit-identical")
                if eq_key and row.get(eq_key) is False:
                    bad(group, row, f"{eq_key} is False (must be bit-identical)")
    return reasons


def _check_defaults(geo, w2, f4, gen, runner, device) -> tuple[list[dict], list[dict]]:
    """The current kernels' check rows (one per tier and T), each check isolated."""
    rows, inputs = [], []
    for tier in ("w2", "fp4"):
        for tokens in (1, 8):
            row = dict(tier=tier, tokens=tokens)
            got, err = runner.attempt(f"check {tier} T={tokens}", lambda: _default_check(geo, w2, f4, tier, tokens, gen,
                                                                                         device))
            if err:
                row["error"] = err
            else:
                row.update(got[0])
                inputs.append(got[1])
                print(f"check {tier} T={tokens}: rel_err {row['rel_err']:.2e} nan={row['nan']} "
                      f"repeat_identical={row['repeat_identical']}", flush=True)
            rows.append(row)
    runner.attempt("fp4 table reset", lambda: f4.table.__setitem__(0, -1))
    return rows, inputs


def _check_variants(geo, w2, f4, rows, inputs, runner, device) -> None:
    """Checks of the alternatives on the default checks' inputs, each isolated; results go into the matching check row."""
    by_key = {(r["tier"], r["tokens"]): r for r in rows}
    for inp in inputs:
        row = by_key[(inp["tier"], inp["tokens"])]
        fp4 = inp["tier"] == "fp4"

        def resident(fn):
            def go():
                f4.table[0] = torch.arange(geo.num_experts, dtype=torch.int32) if fp4 else -1
                try:
                    return fn()
                finally:
                    f4.table[0] = -1
            return go

        label = f"check {inp['tier']} T={inp['tokens']}"
        for name, (options, _) in CANDIDATES.items():
            got, err = runner.attempt(f"{label} {name}", resident(lambda: _candidate_check(geo, w2, f4, inp, options,
                                                                                           device)))
            row.update({f"{name}_{k}": v for k, v in got.items()} if got else {f"{name}_error": err})
        if fp4:
            outs = {}
            for mode in ("off", "triton"):
                got, err = runner.attempt(f"{label} fp4_bf16x2={mode}",
                                          resident(lambda: _fp4_mode_check(geo, w2, f4, inp, mode, device)))
                if got:
                    outs[mode] = got.pop("out")
                row.update(got or {f"fp4_{mode}_error": err})
            if len(outs) == 2:
                row["fp4_triton_equals_off"] = bool(torch.equal(outs["triton"], outs["off"]))
        print(f"check {label[6:]} variants: " + json.dumps(
            {k: v for k, v in row.items() if k.startswith(("fp4_",) + tuple(CANDIDATES))}, default=str), flush=True)


def _grouped_swiglu(x, w13, w2d, offs):
    """bf16 experts on rows sorted by expert (`offs`: cumulative rows per expert): [P, H] -> [P, H]."""
    gate, up = torch._grouped_mm(x, w13.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
    return torch._grouped_mm(torch.nn.functional.silu(gate) * up, w2d.transpose(-2, -1), offs=offs)


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
            return _grouped_swiglu(x, w13, w2d, offs)
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
            return _grouped_swiglu(x, w13_out, w2_out, offs)
        fns.append(fn)
    return _graph_time_us(fns, reps)


STAGES = ("all", "gate_up", "down", "route_combine")


def _stage_fn(stage, geo, w2, f4, x, ids, weights, ws, misses, out):
    """The launches timed for `stage` ("all": moe_mm; else that stage alone, its inputs made by one full run)."""
    if stage == "all":
        return lambda: moe_mm(x, ids, weights, w2, f4, 0, misses, ws, out=out)
    moe_mm(x, ids, weights, w2, f4, 0, misses, ws, out=out)  # blocks, act and y in place for a stage alone
    if stage == "gate_up":
        return lambda: moe_gate_up(x, geo.top_k, w2, f4, 0, ws)
    if stage == "down":
        return lambda: moe_down(geo.top_k, w2, f4, 0, ws)
    if stage == "route_combine":
        return lambda: (moe_route(ids, w2, f4, 0, misses, ws), moe_combine(ids, weights, w2, f4, 0, ws, out))
    raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")


def _fused_case(geo, w2, f4, routings, reps, stage: str = "all", config: tuple[int, int] = (64, 4), **ws_kw):
    """Graph-replay time (us) of the fused op or one stage; ws_kw go to MoeWorkspace.allocate."""
    fns = []
    for ids, weights in routings:
        tokens = ids.shape[0]
        x = torch.randn(tokens, geo.hidden, device="cuda", dtype=torch.bfloat16)
        ws = MoeWorkspace.allocate(tokens, geo.top_k, geo.num_experts, geo.hidden, geo.expert_inter, x.dtype, "cuda",
                                   block_n=config[0], num_warps=config[1], **ws_kw)
        misses = MissLog.allocate(16, "cuda")
        fns.append(_stage_fn(stage, geo, w2, f4, x, ids, weights, ws, misses, torch.empty_like(x)))
    return _graph_time_us(fns, reps)


def _unique_experts(routings) -> float:
    return sum(torch.unique(ids).numel() for ids, _ in routings) / len(routings)


SWEEP_CONFIGS = [(16, 2), (32, 2), (32, 4), (64, 2), (64, 4), (64, 8), (128, 4), (128, 8), (256, 8)]


_CUDA_ERROR_MARKERS = ("illegal memory access", "illegal address", "illegal instruction", "misaligned address",
                       "unspecified launch failure", "device-side assert", "CUDA error", "Triton Error [CUDA]",
                       "CUDA_ERROR", "cudaError", "launch timed out", "operation not permitted when stream is capturing")


def _is_cuda_error(exc: BaseException) -> bool:
    """An error after which the CUDA context may be unusable (not: compile errors, out of memory)."""
    if isinstance(exc, getattr(torch, "OutOfMemoryError", ())) or "out of memory" in str(exc):
        return False
    accel = getattr(torch, "AcceleratorError", None)
    return (accel is not None and isinstance(exc, accel)) or any(m in str(exc) for m in _CUDA_ERROR_MARKERS)


def _error_dict(exc: BaseException) -> dict:
    """type, message (first 20 lines), traceback (first 8 and last 12 lines)."""
    message = "\n".join(str(exc).splitlines()[:20])[:3000]
    lines = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).splitlines()
    if len(lines) > 20:
        lines = lines[:8] + ["  ..."] + lines[-12:]
    return dict(type=type(exc).__name__, message=message, traceback=lines)


def _cuda_probe() -> None:
    torch.cuda.synchronize()
    torch.ones(1, device="cuda").add_(1).item()


class Runner:
    """Runs each timed variant / check in isolation: an exception is recorded (and returned), not raised.
    After an error that may have poisoned the CUDA context (or when `probe` fails after any error), later
    GPU work is skipped and `poisoned` says why."""

    def __init__(self, probe=None):
        self.probe = probe
        self.poisoned: str | None = None
        self.errors: list[dict] = []

    def attempt(self, label: str, fn, gpu: bool = True):
        """(value, None) or (None, error dict); skipped without running while poisoned (gpu work)."""
        if gpu and self.poisoned:
            return None, dict(type="Skipped", message=f"not run: {self.poisoned}", skipped=True)
        try:
            return fn(), None
        except Exception as exc:  # noqa: BLE001: isolating the variant is the point
            err = _error_dict(exc)
            cause = None
            if _is_cuda_error(exc):
                cause = "raised a CUDA error"
            elif gpu and self.probe is not None:
                try:
                    self.probe()
                except Exception as probe_exc:  # noqa: BLE001
                    cause = f"left the CUDA context unusable ({type(probe_exc).__name__}: {str(probe_exc)[:200]})"
            if cause:
                err["cuda_context_lost"] = True
                self.poisoned = (f"{label} {cause}: {err['type']}: {err['message'].splitlines()[0][:300] if err['message'] else ''}"
                                 "; later GPU variants were not run")
            self.errors.append(dict(label=label, **err))
            print(f"FAILED {label}: {err['type']}: {err['message'][:500]}" + (f"\n  -> {self.poisoned}" if cause else ""),
                  flush=True)
            return None, err


# Timed first, for every T, so their rows exist even if a new variant breaks the process.
BASELINE_VARIANTS = ("bf16_grouped_mm", "w2_fused", "w2_gate_up", "w2_down", "w2_route_combine", "w2_fused_plain",
                     "w2_gate_up_plain", "w2_fused_mma16", "w2_fused_bt1", "dequant_grouped_mm", "fp4_fused",
                     "fp4_gate_up", "fp4_fused_mma16", "fp4_fused_bt1")
# The candidates' rows: their checks and timings come after every baseline.
NEW_VARIANTS = tuple(f"{tier}_fused_{name}" for name in CANDIDATES for tier in ("w2", "fp4"))
STREAMED = ("w2_fused", "w2_gate_up", "w2_down", "fp4_fused", "fp4_gate_up")  # the rest: the ceiling of the same bytes


def _variant_thunks(geo, state, routings, tokens, config) -> dict:
    """Variant name -> zero-argument function that times it (us), for the variants that apply at this T."""
    w2, f4 = state["w2"], state["f4"]
    from tierstore.kernels.moe_mm import default_block_tokens

    pairs = tokens * geo.top_k
    bt1 = pairs <= geo.num_experts  # the stages alone and the candidates: decode batches
    default_bt1 = default_block_tokens(pairs, geo.num_experts) == 1  # the default routes one pair per program

    def fused(stage, fp4=False, **kw):
        kw.setdefault("config", config)

        def go():
            if fp4:
                f4.table[0] = torch.arange(geo.num_experts, dtype=torch.int32)
            try:
                return _fused_case(geo, w2, f4, routings, state["reps"], stage=stage, **kw)
            finally:
                if fp4:
                    f4.table[0] = -1
        return go

    out = {"bf16_grouped_mm": lambda: _bf16_case(geo, state["w13_bf16"], state["w2_bf16"], routings, state["reps"]),
           "w2_fused": fused("all"), "w2_gate_up": fused("gate_up")}
    if bt1:  # the stages alone; the plain-Triton decode beside the inline-PTX one
        out["w2_down"] = fused("down")
        out["w2_route_combine"] = fused("route_combine")
        out["w2_fused_plain"] = fused("all", ptx_w2=False)
        out["w2_gate_up_plain"] = fused("gate_up", ptx_w2=False)
    if default_bt1:  # the default is BT = 1 (FMA); compare the MMA path
        out["w2_fused_mma16"] = fused("all", block_tokens=16)
        out["fp4_fused_mma16"] = fused("all", fp4=True, block_tokens=16)
    if not default_bt1:  # the default is a tensor-core path; compare one pair per program
        out["w2_fused_bt1"] = fused("all", block_tokens=1)
        out["fp4_fused_bt1"] = fused("all", fp4=True, block_tokens=1)
    out["dequant_grouped_mm"] = lambda: _dequant_case(geo, w2, state["w13_bf16"], state["w2_bf16"], routings,
                                                      state["reps"])
    out["fp4_fused"] = fused("all", fp4=True)
    if bt1:
        out["fp4_gate_up"] = fused("gate_up", fp4=True)
        for name, (options, _) in CANDIDATES.items():
            out[f"w2_fused_{name}"] = fused("all", **options)
            out[f"fp4_fused_{name}"] = fused("all", fp4=True, **options)
    return out


def _case_row(preset, tokens, name, us, err, case, stream, bf16_us, invalid) -> dict:
    nbytes, unique = case["nbytes"][name], case["unique"]
    row = dict(preset=preset, tokens=tokens, variant=name, us=us, unique_experts=unique, bytes=nbytes,
               rotations=case["count"])
    if err is not None:
        row["error"] = err
        row["us"] = None
        return row
    if invalid:
        row["invalid"] = invalid  # the check of this path failed: the time is kept aside, not as `us`
        row["invalid_us"], row["us"] = us, None
        return row
    if not nbytes:  # route + combine: no weights read
        return row
    row.update(gb_per_s=nbytes / us / 1e3, pct_hbm=100 * nbytes / (us * 1e-6) / HBM_BYTES_PER_S,
               speedup_vs_bf16=bf16_us / us if bf16_us else None)
    same_bytes = ("fp4_gate_up" if name.startswith("fp4_gate_up") else "w2_gate_up" if "gate_up" in name
                  else "w2_down" if name.startswith("w2_down") else "fp4_fused" if name.startswith("fp4") else "w2_fused")
    ceiling = None if name == "bf16_grouped_mm" else stream.get(name, stream.get(same_bytes))
    if ceiling is not None:
        row["stream_us"] = ceiling
        row["pct_of_stream"] = 100 * ceiling / us
    return row


def _setup(geo, device) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    w2 = w2_tier(geo.hidden, geo.expert_inter, geo.num_experts, 1, geo.num_experts, device)
    f4 = fp4_tier(geo.hidden, geo.expert_inter, geo.num_experts, 1, geo.num_experts, device)
    _randomize_pool(w2)
    _randomize_pool(f4)
    w2.table[0] = torch.arange(geo.num_experts, dtype=torch.int32)
    return dict(gen=gen, w2=w2, f4=f4)


def run(preset: str, token_counts: list[int], reps: int, sweep: bool, config: tuple[int, int] = (64, 8),
        result: dict | None = None, emit=lambda result: None, device: str = "cuda", skip: tuple[str, ...] = ()) -> dict:
    """Fills `result` (checks, sweep, config, cases, errors, status) and calls emit(result) after each stage,
    so a kill leaves what was measured. Each variant and check runs isolated (Runner)."""
    result = {} if result is None else result
    runner = Runner(probe=_cuda_probe if device == "cuda" else None)
    result.update(status="running: setup", checks=[], sweep=[], config=dict(block_n=config[0], num_warps=config[1]),
                  cases=[], errors=runner.errors, skipped_variants=list(skip))
    geo = get_preset(preset)
    state = _setup(geo, device)
    state["reps"] = reps
    w2, f4, gen = state["w2"], state["f4"], state["gen"]
    result["status"] = "running: checks of the current kernels"
    checks, inputs = _check_defaults(geo, w2, f4, gen, runner, device)
    result["checks"] = checks
    emit(result)
    if sweep:
        result["status"] = "running: sweep"
        routings = {t: _routings(t, geo.top_k, geo.num_experts, 6 if t == 1 else 4, gen, device) for t in (1, 8)}
        for cfg in SWEEP_CONFIGS:
            for tokens, rts in routings.items():
                us, err = runner.attempt(f"sweep T={tokens} {cfg}", lambda: _fused_case(
                    geo, w2, f4, rts, reps, stage="gate_up", config=cfg))
                result["sweep"].append(dict(tokens=tokens, block_n=cfg[0], num_warps=cfg[1], us=us,
                                            **({"error": err} if err else {})))
                if us is not None:
                    print(f"sweep gate_up T={tokens} BN={cfg[0]} warps={cfg[1]}: {us:.1f} us", flush=True)
        timed = [r for r in result["sweep"] if r["tokens"] == 1 and r["us"] is not None]
        if timed:
            best = min(timed, key=lambda r: r["us"])
            config = (best["block_n"], best["num_warps"])
            result["config"] = dict(block_n=config[0], num_warps=config[1])
        emit(result)
    state["w13_bf16"] = torch.randn(geo.num_experts, 2 * geo.expert_inter, geo.hidden, device=device,
                                    dtype=torch.bfloat16)
    state["w2_bf16"] = torch.randn(geo.num_experts, geo.hidden, geo.expert_inter, device=device, dtype=torch.bfloat16)
    lay2, lay4 = w2.layout, f4.layout
    w2_expert = lay2.w13.word_bytes + lay2.w13.scale_bytes + lay2.w2.word_bytes + lay2.w2.scale_bytes
    w2_gate_up = lay2.w13.word_bytes + lay2.w13.scale_bytes
    w2_down = lay2.w2.word_bytes + lay2.w2.scale_bytes
    f4_expert = lay4.w13.word_bytes + lay4.w13.scale_bytes + lay4.w2.word_bytes + lay4.w2.scale_bytes
    f4_gate_up = lay4.w13.word_bytes + lay4.w13.scale_bytes
    per_expert = {"bf16_grouped_mm": 2 * 3 * geo.hidden * geo.expert_inter, "dequant_grouped_mm": w2_expert,
                  "w2_route_combine": 0}
    for name in BASELINE_VARIANTS + NEW_VARIANTS:
        if name not in per_expert:
            gate_up = "gate_up" in name
            per_expert[name] = ((f4_gate_up if gate_up else f4_expert) if name.startswith("fp4")
                                else w2_gate_up if gate_up else w2_down if name.startswith("w2_down") else w2_expert)
    invalid = {}
    cases = {}

    def time_variants(names, tokens):
        case = cases[tokens]
        thunks = _variant_thunks(geo, state, case["routings"], tokens, config)
        for name in names:
            if name not in thunks or name in skip:
                continue
            us, err = runner.attempt(f"T={tokens} {name}", thunks[name])
            case["times"][name] = us
            if name == "bf16_grouped_mm":
                case["bf16_us"] = us
            if name in STREAMED and err is None:
                b = case["nbytes"][name]
                ceiling, _ = runner.attempt(f"T={tokens} stream ceiling for {name}", lambda: _stream_us(
                    int(b), 4 if b > 256e6 else max(4, int(4 * 64e6 / b) + 1), reps, device))
                if ceiling is not None:
                    case["stream"][name] = ceiling
            group = _check_group(name)
            row = _case_row(preset, tokens, name, us, err, case, case["stream"], case.get("bf16_us"),
                            invalid.get(group) if group else None)
            result["cases"].append(row)
            print(json.dumps(row, default=str), flush=True)

    for tokens in token_counts:  # 1: the current kernels and the baselines, every T
        result["status"] = f"running: current kernels and baselines, T={tokens}"
        count = max(4, min(32, int(8 * 2**20 * 60 / (tokens * geo.top_k * w2_expert) + 1)))
        routings, err = runner.attempt(f"T={tokens} routings",
                                       lambda: _routings(tokens, geo.top_k, geo.num_experts, count, gen, device))
        if err is not None:
            continue
        unique = _unique_experts(routings)
        cases[tokens] = dict(routings=routings, count=count, unique=unique, times={}, stream={}, bf16_us=None,
                             nbytes={name: unique * b for name, b in per_expert.items()})
        invalid = _invalid_reasons(checks)
        time_variants(BASELINE_VARIANTS, tokens)
        emit(result)
    result["status"] = "running: checks of the alternatives (FP4 off / twin) and new variants"
    _check_variants(geo, w2, f4, checks, inputs, runner, device)
    invalid = _invalid_reasons(checks)
    result["invalid_checks"] = invalid
    emit(result)
    for tokens in cases:  # 2: the new variants
        result["status"] = f"running: new variants, T={tokens}"
        time_variants(NEW_VARIANTS, tokens)
        emit(result)
    result["status"] = (f"stopped early: {runner.poisoned}" if runner.poisoned else
                        f"complete, {len(runner.errors)} failure(s) recorded in `errors`" if runner.errors else "complete")
    emit(result)
    return result


def _provenance(commit_hint: str | None) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "kernels", "benchmarks/moe_kernels.py"],
                                    capture_output=True, text=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        commit, dirty = commit_hint or "unknown", None  # the GPU machine's copy has no .git
    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                commit=commit, dirty=dirty, date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                abi_tag=ABI_TAG, python=sys.version.split()[0])


def _write_json(path: str, result: dict) -> None:
    """Atomic (temp file + rename): a kill mid-write leaves the previous complete file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as fh:
        json.dump(result, fh, indent=1, default=str)
    os.replace(tmp, path)


class _Terminated(BaseException):
    """SIGTERM (the session's `timeout`): not an Exception, so no variant's isolation swallows it."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def _print_table(cases: list[dict]) -> None:
    print(f"\n{'T':>4} {'variant':<20} {'us':>9} {'GB/s':>7} {'%HBM':>6} {'%stream':>8} {'x bf16':>7}")
    num = lambda v, width, prec: f"{v:>{width}.{prec}f}" if isinstance(v, (int, float)) else f"{'-':>{width}}"
    for r in sorted(cases, key=lambda r: r["tokens"]):
        head = f"{r['tokens']:>4} {r['variant']:<20} "
        if "error" in r:
            e = r["error"]
            print(head + ("SKIPPED " if e.get("skipped") else "ERROR ") + f"{e['type']}: "
                  + (e["message"].splitlines() or [""])[0][:120])
        elif "invalid" in r:
            print(head + f"INVALID (check failed; {r['invalid_us']:.1f} us not to be read): " + "; ".join(r["invalid"])[:160])
        else:
            print(head + f"{r['us']:>9.1f} {num(r.get('gb_per_s'), 7, 0)} {num(r.get('pct_hbm'), 6, 1)} "
                  f"{num(r.get('pct_of_stream'), 8, 1)} {num(r.get('speedup_vs_bf16'), 7, 2)}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="deepseek-v3")
    parser.add_argument("--tokens", default="1,8,32,64,512")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", required=True)
    parser.add_argument("--sweep", action="store_true", help="pick block_n/num_warps by W2 gate_up time at T=1 first")
    parser.add_argument("--config", default="64,8", help="block_n,num_warps when not sweeping")
    parser.add_argument("--commit", help="commit of the tree being measured, where it has no .git")
    parser.add_argument("--skip", default="", help="comma-separated variants not to time (e.g. to shorten a run)")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: the isolation tests
    args = parser.parse_args(argv)
    result: dict = dict(provenance=_provenance(args.commit))
    emit = lambda r: _write_json(args.json, r)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    code = 0
    try:
        run(args.preset, [int(t) for t in args.tokens.split(",")], args.reps, args.sweep,
            tuple(int(v) for v in args.config.split(",")), result=result, emit=emit, device=args.device,
            skip=tuple(v for v in args.skip.split(",") if v))
    except _Terminated:
        result["status"] = f"terminated by SIGTERM ({result.get('status', 'before start')}); rows so far are kept"
        code = 124
    except Exception as exc:  # noqa: BLE001: outside any variant (setup): record, keep the rows so far
        result["fatal"] = _error_dict(exc)
        result["status"] = f"fatal {type(exc).__name__} ({result.get('status', 'before start')}): {str(exc)[:300]}"
        code = 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    _write_json(args.json, result)
    _print_table(result.get("cases", []))
    print(f"\nstatus: {result['status']}")
    for e in result.get("errors", []):
        print(f"error in {e['label']}: {e['type']}: {(e['message'].splitlines() or [''])[0][:200]}")
    return code


if __name__ == "__main__":
    sys.exit(main())
