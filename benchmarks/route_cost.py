"""What the fused op's two weightless launches cost: `moe_route` and `moe_combine` (kernels/moe_mm.py) timed alone,
together, and an empty Triton launch (a captured graph's floor per kernel node), per preset and T, by CUDA-graph
replay over rotated routings (benchmarks/kernels.py's timer). Every expert resident in the W2 table; misses are
what `--missing` experts give (0 by default: the decode step's usual case).

    python3 benchmarks/route_cost.py --presets deepseek-v3,ds-v2-lite --tokens 1,8,32 --json route_cost.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parents[1]
ROTATIONS = 16  # routings per graph (one launch each)


@triton.jit
def _empty_kernel(x_ptr):
    pass


def _bench_kernels():
    spec = importlib.util.spec_from_file_location("bench_kernels_for_route_cost", ROOT / "benchmarks" / "kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def case(kb, geo, tokens: int, block_tokens: int, missing: int, reps: int) -> dict:
    """Microseconds per launch of each variant at one (preset, T, block_tokens)."""
    from tierstore.kernels import MissLog, MoeWorkspace, moe_combine, moe_route, w2_tier, fp4_tier

    device = "cuda"
    w2 = w2_tier(geo.hidden, geo.expert_inter, 1, 1, geo.num_experts, device)  # one slot: the launches read tables
    f4 = fp4_tier(geo.hidden, geo.expert_inter, 1, 1, geo.num_experts, device)
    w2.table[0] = 0
    if missing:
        w2.table[0, :missing] = -1
    gen = torch.Generator(device=device).manual_seed(tokens)
    routings = kb._routings(tokens, geo.top_k, geo.num_experts, ROTATIONS, gen, device)
    misses = MissLog.allocate(64, device)
    spaces = [MoeWorkspace.allocate(tokens, geo.top_k, geo.num_experts, geo.hidden, geo.expert_inter, torch.bfloat16,
                                    device, block_tokens=block_tokens) for _ in routings]
    outs = [torch.empty(tokens, geo.hidden, device=device, dtype=torch.bfloat16) for _ in routings]
    for ws in spaces:
        ws.y.copy_(torch.randn_like(ws.y))
    flag = torch.zeros(1, device=device)
    variants = {
        "empty_launch": [lambda: _empty_kernel[(1,)](flag) for _ in routings],
        "route": [lambda r=r, ws=ws: moe_route(r[0], w2, f4, 0, misses, ws) for r, ws in zip(routings, spaces)],
        "combine": [lambda r=r, ws=ws, o=o: moe_combine(r[0], r[1], w2, f4, 0, ws, o)
                    for r, ws, o in zip(routings, spaces, outs)],
        "route_combine": [lambda r=r, ws=ws, o=o: (moe_route(r[0], w2, f4, 0, misses, ws),
                                                   moe_combine(r[0], r[1], w2, f4, 0, ws, o))
                          for r, ws, o in zip(routings, spaces, outs)],
    }
    return {name: round(kb._graph_time_us(fns, reps), 2) for name, fns in variants.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="deepseek-v3,ds-v2-lite,qwen3-30b-a3b")
    parser.add_argument("--tokens", default="1,8,32")
    parser.add_argument("--missing", type=int, default=0, help="experts 0 .. N-1 not resident")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", required=True)
    parser.add_argument("--commit", help="commit of the tree being measured (the device copy may have no .git)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("route_cost: no CUDA device; this benchmark times GPU launches only, nothing was run", file=sys.stderr)
        return 2
    from tierstore.geometry import get_preset

    kb = _bench_kernels()
    cw2_spec = importlib.util.spec_from_file_location("bench_cuda_w2_for_route_cost", ROOT / "benchmarks" / "cuda_w2.py")
    cw2 = importlib.util.module_from_spec(cw2_spec)
    cw2_spec.loader.exec_module(cw2)
    result = dict(provenance=cw2._provenance(args.commit), missing=args.missing, rotations=ROTATIONS, cases=[])
    print(f"{'preset':15s} {'T':>3s} {'BT':>3s}  " + "  ".join(f"{n:>13s}" for n in
                                                              ("empty_launch", "route", "combine", "route_combine")))
    for preset in args.presets.split(","):
        geo = get_preset(preset)
        for tokens in (int(t) for t in args.tokens.split(",")):
            for block_tokens in ((1,) if tokens == 1 else (1, 16)):
                row = case(kb, geo, tokens, block_tokens, args.missing, args.reps)
                result["cases"].append(dict(preset=preset, tokens=tokens, block_tokens=block_tokens, us=row))
                print(f"{preset:15s} {tokens:3d} {block_tokens:3d}  " + "  ".join(f"{v:13.2f}" for v in row.values()),
                      flush=True)
                Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    result["status"] = "complete"
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
