"""What the fused op's two weightless launches cost: `moe_route` and `moe_combine` (kernels/moe_mm.py) timed alone,
together, and an empty Triton launch (a captured graph's floor per kernel node), per preset and T, by CUDA-graph
replay over rotated routings (benchmarks/moe_kernels.py's timer). Every expert resident in the W2 table except
`--missing` experts (0 by default: the decode step's usual case).

Routing kernels side by side: the current `route_kernel` with each chunk size and way of counting (`route_c{CHUNK}`,
`_hist`: tl.histogram); before timing, every variant's blocks and miss log are checked against `moe_route_ref` (a
mismatch marks the row invalid). The previous kernel (`route_v1` in the results of 4a0c5b4) was timed beside them
at that commit, where benchmarks/route_v1.py held it.

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


def _load(name: str):
    """benchmarks/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}_for_route_cost", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ROUTES = {"route_c32": (32, False), "route_c128": (128, False), "route_c32_hist": (32, True),
          "route_c128_hist": (128, True)}  # name -> (CHUNK, HISTOGRAM) of route_kernel


def _route_launch(name: str, ids, w2, f4, misses, ws):
    from tierstore.kernels._triton.route import route_kernel

    experts = w2.table.shape[1]
    args = (ids, ids.numel(), w2.table, f4.table, 0, experts, ws.block_expert, ws.block_fill, ws.block_pairs,
            ws.num_blocks, misses.counts, misses.entries, misses.entries.shape[0], w2.slots)
    common = dict(EP=triton.next_power_of_2(experts), BT=ws.block_tokens, STREAM=False, num_warps=4)
    chunk, histogram = ROUTES[name]
    return route_kernel[(1,)](*args, CHUNK=chunk, HISTOGRAM=histogram, **common)


def _route_matches(name: str, ids, w2, f4, ws, misses) -> bool:
    """One launch of `name` on a fresh miss log equals moe_route_ref (blocks, miss counts, logged experts)."""
    from tierstore.kernels import moe_route_ref, route_blocks

    misses.counts.zero_()
    _route_launch(name, ids, w2, f4, misses, ws)
    ref = moe_route_ref(ids, w2, f4, 0, ws.block_tokens)
    blocks = route_blocks(ws)
    logged = [e for _, e in misses.entries[: len(ref["missing_experts"])].tolist()]
    return (blocks == ref["blocks"] and misses.counts.tolist() == [ref["missing_pairs"], len(ref["missing_experts"])]
            and logged == ref["missing_experts"])


def case(kb, geo, tokens: int, block_tokens: int, missing: int, reps: int) -> dict:
    """Microseconds per launch of each variant at one (preset, T, block_tokens), and which routes checked out."""
    from tierstore.kernels import MissLog, MoeWorkspace, fp4_tier, moe_combine, moe_route, w2_tier

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
    valid = {name: all(_route_matches(name, r[0], w2, f4, ws, misses) for r, ws in zip(routings, spaces))
             for name in ROUTES}
    flag = torch.zeros(1, device=device)
    variants = {
        "empty_launch": [lambda: _empty_kernel[(1,)](flag) for _ in routings],
        "moe_route": [lambda r=r, ws=ws: moe_route(r[0], w2, f4, 0, misses, ws) for r, ws in zip(routings, spaces)],
        "combine": [lambda r=r, ws=ws, o=o: moe_combine(r[0], r[1], w2, f4, 0, ws, o)
                    for r, ws, o in zip(routings, spaces, outs)],
        "route_combine": [lambda r=r, ws=ws, o=o: (moe_route(r[0], w2, f4, 0, misses, ws),
                                                   moe_combine(r[0], r[1], w2, f4, 0, ws, o))
                          for r, ws, o in zip(routings, spaces, outs)],
    }
    variants |= {name: [lambda r=r, ws=ws, name=name: _route_launch(name, r[0], w2, f4, misses, ws)
                        for r, ws in zip(routings, spaces)] for name in ROUTES}
    return dict(us={name: round(kb._graph_time_us(fns, reps), 2) for name, fns in variants.items()}, valid=valid)


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

    kb, cw2 = _load("moe_kernels"), _load("cuda_w2")
    result = dict(provenance=cw2._provenance(args.commit), missing=args.missing, rotations=ROTATIONS, cases=[])
    names = ["empty_launch", "moe_route", "combine", "route_combine", *ROUTES]
    print(f"{'preset':15s} {'T':>3s} {'BT':>3s} " + " ".join(f"{n[:15]:>15s}" for n in names) + "  invalid")
    for preset in args.presets.split(","):
        geo = get_preset(preset)
        for tokens in (int(t) for t in args.tokens.split(",")):
            for block_tokens in ((1,) if tokens == 1 else (1, 16)):
                row = case(kb, geo, tokens, block_tokens, args.missing, args.reps)
                result["cases"].append(dict(preset=preset, tokens=tokens, block_tokens=block_tokens, **row))
                invalid = [n for n, ok in row["valid"].items() if not ok]
                print(f"{preset:15s} {tokens:3d} {block_tokens:3d} " + " ".join(f"{row['us'][n]:15.2f}" for n in names)
                      + f"  {','.join(invalid) or '-'}", flush=True)
                Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    result["status"] = "complete"
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
