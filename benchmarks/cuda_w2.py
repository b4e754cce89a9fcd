"""CUDA C++ W2 gate_up (kernels/cuda) against the Triton gate_up and the streaming-read ceiling (issue #9 s. 4).

DeepSeek-V3 shapes, pools, routings, CUDA-graph timing with rotating routings (L2 defeated) and the
streaming-read ceiling all come from benchmarks/kernels.py. Order: build (nvcc -> fatbin, driver API
load), checks at T = 1 and 8 (outputs poisoned with NaN: CUDA vs the plain-torch reference, vs Triton,
repeat launches byte-identical), then for each T: CUDA, Triton, CUDA, Triton (two rounds, to see drift)
and the ceiling. Each step is isolated (benchmarks/kernels.py Runner): a build, launch or check failure is
recorded in the JSON and the rest runs; a failed check marks the CUDA rows invalid (time kept aside).

    python3 benchmarks/cuda_w2.py --commit <sha> --json cuda_w2.json
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
REL_TOL = 1e-2
ROUNDS = 2
AHEAD = {"cuda_mma": 1, "cuda_mma_ahead2": 2}  # variant -> W2_AHEAD (K tiles of loads in flight per lane)
DEVICE = "cuda"  # the CPU test of this script's bookkeeping sets "cpu"


def _bench_kernels():
    """benchmarks/kernels.py as a module (its name clashes with the `kernels` folder, so by path)."""
    spec = importlib.util.spec_from_file_location("bench_kernels_for_cuda_w2", ROOT / "benchmarks" / "kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _provenance(commit: str | None) -> dict:
    import triton

    from tierstore.kernels import ABI_TAG
    from tierstore.kernels.cuda import loader

    try:
        seen = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    except OSError:
        seen = ""
    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                nvcc=loader.nvcc_version(), commit=commit or seen or "unknown", commit_seen=seen or None,
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), abi_tag=ABI_TAG,
                python=sys.version.split()[0])


def _build(ahead: int) -> tuple[object, dict]:
    from tierstore.kernels.cuda.w2_gate_up import W2GateUpCuda

    started = time.perf_counter()
    cuda = W2GateUpCuda(ahead=ahead)
    return cuda, dict(ahead=ahead, seconds=round(time.perf_counter() - started, 2), **cuda.attributes())


def _workspace(geo, tokens, routing, w2, f4, dtype=torch.bfloat16):
    """x [T, H], a BT = 1 workspace routed for `routing` (outside any timing, as benchmarks/kernels.py does)."""
    from tierstore.kernels import MissLog, MoeWorkspace, moe_route

    ids, _ = routing
    x = torch.randn(tokens, geo.hidden, device=DEVICE, dtype=dtype)
    ws = MoeWorkspace.allocate(tokens, geo.top_k, geo.num_experts, geo.hidden, geo.expert_inter, dtype, DEVICE,
                               block_tokens=1)
    moe_route(ids, w2, f4, 0, MissLog.allocate(16, DEVICE), ws)
    return x, ws


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(torch.equal(a.view(torch.int16), b.view(torch.int16)))


def _check(kb, geo, state, kernels: dict, tokens) -> dict:
    """Every built CUDA variant against the reference and Triton, on NaN-poisoned outputs, launched twice."""
    from tierstore.kernels import moe_gate_up
    from tierstore.kernels.cuda.w2_gate_up import w2_gate_up_ref

    w2, f4 = state["w2"], state["f4"]
    routing = kb._routings(tokens, geo.top_k, geo.num_experts, 1, state["gen"], DEVICE)[0]
    x, ws = _workspace(geo, tokens, routing, w2, f4)
    ws.act.fill_(float("nan"))
    moe_gate_up(x, geo.top_k, w2, f4, 0, ws)
    outs = {}
    for name, cuda in kernels.items():
        outs[name] = [torch.full_like(ws.act, float("nan")) for _ in range(2)]
        for out in outs[name]:
            cuda(x, geo.top_k, w2, f4, 0, ws, out=out)
    ref = w2_gate_up_ref(x, routing[0], w2, f4, 0)
    tri = ws.act.float()
    row = dict(tokens=tokens, pairs=ref.shape[0], rel_err_triton=kb._rel_err(tri, ref), variants={})
    for name, (first, second) in outs.items():
        cu = first.float()
        row["variants"][name] = dict(rel_err=kb._rel_err(cu, ref), rel_err_vs_triton=float((cu - tri).norm() / tri.norm()),
                                     max_abs_err=float((cu - ref).abs().max()), nan=bool(cu.isnan().any()),
                                     repeat_identical=_same_bytes(first, second),
                                     equals_cuda_mma=_same_bytes(first, outs["cuda_mma"][0]) if "cuda_mma" in outs else None)
    return row


def _invalid(check: dict | None, name: str) -> list[str]:
    v = (check or {}).get("variants", {}).get(name)
    if v is None:
        return ["check did not run or raised"]
    why = []
    if not v["rel_err"] <= REL_TOL:
        why.append(f"rel_err {v['rel_err']:.3g} > {REL_TOL:g}")
    if v["nan"]:
        why.append("NaN in the output (a row not written)")
    if not v["repeat_identical"]:
        why.append("repeat launches not byte-identical")
    if v["equals_cuda_mma"] is False:
        why.append("bytes differ from cuda_mma (the prefetch depth must not change arithmetic)")
    return why


def _time_case(kb, geo, state, kernels: dict, tokens, runner) -> list[dict]:
    """Rows for one T: each CUDA variant and Triton (ROUNDS each, alternating), the streaming ceiling."""
    from tierstore.kernels import moe_gate_up

    w2, f4, reps = state["w2"], state["f4"], state["reps"]
    lay = w2.layout
    m = lay.w13
    expert_bytes = m.word_bytes + m.scale_bytes + lay.w2.word_bytes + lay.w2.scale_bytes
    count = max(4, min(32, int(8 * 2**20 * 60 / (tokens * geo.top_k * expert_bytes) + 1)))  # as benchmarks/kernels.py
    routings = kb._routings(tokens, geo.top_k, geo.num_experts, count, state["gen"], DEVICE)
    unique = kb._unique_experts(routings)
    nbytes = unique * (m.word_bytes + m.scale_bytes)
    cases = [_workspace(geo, tokens, r, w2, f4) for r in routings]
    outs = [torch.empty_like(ws.act) for _, ws in cases]
    fns = {name: [lambda x=x, ws=ws, o=o, k=cuda: k(x, geo.top_k, w2, f4, 0, ws, out=o) for (x, ws), o in zip(cases, outs)]
           for name, cuda in kernels.items()}
    fns["triton_gate_up"] = [lambda x=x, ws=ws: moe_gate_up(x, geo.top_k, w2, f4, 0, ws) for x, ws in cases]
    rows = []
    for rnd in range(ROUNDS):
        for name, calls in fns.items():
            us, err = runner.attempt(f"T={tokens} {name} round {rnd}", lambda: kb._graph_time_us(calls, reps))
            rows.append(dict(tokens=tokens, variant=name, round=rnd, us=us, bytes=nbytes, unique_experts=unique,
                             rotations=count, **({"error": err} if err else {})))
    copies = 4 if nbytes > 256e6 else max(4, int(4 * 64e6 / nbytes) + 1)
    us, err = runner.attempt(f"T={tokens} stream", lambda: kb._stream_us(int(nbytes), copies, reps, DEVICE))
    rows.append(dict(tokens=tokens, variant="stream_read", round=0, us=us, bytes=nbytes, unique_experts=unique,
                     rotations=copies, **({"error": err} if err else {})))
    return rows


def _derive(rows: list[dict], invalid: dict[str, list[str]], hbm: float) -> None:
    """One T's rows: a CUDA row whose check failed keeps its time as `invalid_us`; every timed row gets GB/s,
    %HBM, % of the ceiling and Triton's best round over this row's time."""
    best = {}
    for r in rows:
        if invalid.get(r["variant"]) and r.get("us") is not None:
            r["invalid"], r["invalid_us"], r["us"] = invalid[r["variant"]], r["us"], None
        if r.get("us") is not None:
            best[r["variant"]] = min(best.get(r["variant"], float("inf")), r["us"])
    for r in rows:
        if r.get("us") is None:
            continue
        r.update(gb_per_s=r["bytes"] / r["us"] / 1e3, pct_hbm=100 * r["bytes"] / (r["us"] * 1e-6) / hbm)
        if "stream_read" in best:
            r["pct_of_stream"] = 100 * best["stream_read"] / r["us"]
        if "triton_gate_up" in best:
            r["triton_over_this"] = best["triton_gate_up"] / r["us"]


def _print(result: dict) -> None:
    fmt = lambda d: " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in d.items())
    for name, b in result.get("build", {}).items():
        print(f"build {name}: " + (fmt(b) if "error" not in b else f"ERROR {b['error']['type']}: {b['error']['message'][:300]}"))
    for c in result.get("checks", []):
        print(f"check T={c['tokens']}: " + fmt({k: v for k, v in c.items() if k not in ("tokens", "variants")}))
        for name, v in c.get("variants", {}).items():
            print(f"  {name}: {fmt(v)}")
    print(f"\n{'T':>3} {'variant':<16} {'rnd':>3} {'us':>8} {'GB/s':>6} {'%HBM':>5} {'%strm':>6} {'triton/x':>8}")
    for r in result.get("cases", []):
        head = f"{r['tokens']:>3} {r['variant']:<16} {r['round']:>3} "
        if r.get("error"):
            print(head + f"ERROR {r['error']['type']}: {(r['error']['message'].splitlines() or [''])[0][:100]}")
        elif r.get("invalid"):
            print(head + f"INVALID ({r['invalid_us']:.1f} us not to be read): {'; '.join(r['invalid'])}")
        else:
            print(head + f"{r['us']:>8.1f} {r['gb_per_s']:>6.0f} {r['pct_hbm']:>5.1f} {r.get('pct_of_stream', 0):>6.1f} "
                  f"{r.get('triton_over_this', 0):>8.2f}")
    print(f"\nstatus: {result['status']}")


def run(kb, args, result: dict, emit) -> None:
    from tierstore.geometry import get_preset

    runner = kb.Runner(probe=kb._cuda_probe if DEVICE == "cuda" else None)
    result.update(status="running: build", errors=runner.errors, checks=[], cases=[], build={})
    kernels = {}
    for name, ahead in AHEAD.items():
        built, err = runner.attempt(f"build and load {name}", lambda: _build(ahead))
        result["build"][name] = built[1] if built else {"error": err}
        if built:
            kernels[name] = built[0]
    emit(result)
    geo = get_preset(args.preset)
    state = kb._setup(geo, DEVICE)
    state["reps"] = args.reps
    tokens_list = [int(t) for t in args.tokens.split(",")]
    invalid = {}
    for tokens in tokens_list:
        result["status"] = f"running: check T={tokens}"
        check, err = (runner.attempt(f"check T={tokens}", lambda: _check(kb, geo, state, kernels, tokens)) if kernels
                      else (None, None))
        result["checks"].append(check or dict(tokens=tokens, error=err or "no CUDA variant built"))
        invalid[tokens] = {name: _invalid(check, name) for name in kernels}
        emit(result)
    for tokens in tokens_list:
        result["status"] = f"running: timing T={tokens}"
        rows, err = runner.attempt(f"timing T={tokens}", lambda: _time_case(kb, geo, state, kernels, tokens, runner))
        rows = rows or [dict(tokens=tokens, variant="all", round=0, us=None, error=err)]
        _derive(rows, invalid[tokens], kb.HBM_BYTES_PER_S)
        result["cases"] += rows
        emit(result)
    result["status"] = (f"stopped early: {runner.poisoned}" if runner.poisoned else
                        f"complete, {len(runner.errors)} failure(s) recorded in `errors`" if runner.errors else "complete")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="deepseek-v3")
    parser.add_argument("--tokens", default="1,8")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--json", required=True)
    parser.add_argument("--commit", help="commit of the tree being measured (the device copy may have no .git)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_w2: no CUDA device; this benchmark measures GPU kernels only, nothing was run", file=sys.stderr)
        return 2
    kb = _bench_kernels()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    result: dict = dict(provenance=_provenance(args.commit), preset=args.preset, rel_tol=REL_TOL)
    emit = lambda r: kb._write_json(args.json, r)
    previous = signal.signal(signal.SIGTERM, kb._on_sigterm)
    code = 0
    try:
        run(kb, args, result, emit)
    except kb._Terminated:
        result["status"] = f"terminated by SIGTERM ({result.get('status')}); rows so far are kept"
        code = 124
    except Exception as exc:  # noqa: BLE001: outside any isolated step (setup): record, keep what was measured
        result["fatal"] = kb._error_dict(exc)
        result["status"] = f"fatal {type(exc).__name__} ({result.get('status')}): {str(exc)[:300]}"
        code = 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    emit(result)
    _print(result)
    return code


if __name__ == "__main__":
    sys.exit(main())
