"""`tierstore replay --trace T --preset P`: a recorded or synthetic routing trace through the real
runtime (pool, arena, pack; Triton kernels on CUDA) at a preset's real shapes with synthetic
weights, beside an all-resident run, a naive on-demand baseline and the physical floor."""

from __future__ import annotations

import argparse
import json


def register(subparsers) -> None:
    parser = subparsers.add_parser("replay", help="replay a routing trace through the tiered runtime and time it")
    parser.add_argument("--trace", required=True, help="trace file (any format tierstore sim reads)")
    parser.add_argument("--preset", required=True, help="geometry preset, e.g. ds-v2-lite")
    parser.add_argument("--layers", type=int, help="use only the first N MoE layers")
    pool = parser.add_mutually_exclusive_group(required=True)
    pool.add_argument("--gpu-pool-gb", type=float)
    pool.add_argument("--gpu-pool-frac", type=float)
    parser.add_argument("--arena-gb", type=float, default=0.0, help="host arena in GiB (0 = none)")
    parser.add_argument("--pack-dir", required=True, help="where the synthetic pack is built (reused across runs)")
    parser.add_argument("--steps", type=int, help="replay at most this many steps")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    parser.add_argument("--json", help="also write the result as JSON to this path")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from tierstore.geometry import get_preset
    from tierstore.kernels.layout import w2_slot_layout
    from tierstore.runtime.engine import slots_for
    from tierstore.runtime.replay import ensure_synthetic_pack, open_synthetic_rows, run_replay, trace_steps
    from tierstore.sim import load_trace

    geometry = get_preset(args.preset)
    if args.layers:
        geometry = geometry.with_layers(args.layers)
    trace = load_trace(args.trace, num_experts=geometry.num_experts)
    steps = trace_steps(trace.experts, trace.step, geometry.num_moe_layers, args.steps)
    slot_bytes = w2_slot_layout(geometry.hidden, geometry.expert_inter).slot_bytes
    pool_slots = slots_for(geometry, slot_bytes, gib=args.gpu_pool_gb, fraction=args.gpu_pool_frac)
    spec = ensure_synthetic_pack(geometry, args.pack_dir)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    result = run_replay(geometry, lambda: open_synthetic_rows(spec, args.pack_dir), steps, pool_slots=pool_slots,
                        arena_slots=int(args.arena_gb * 2**30) // spec.stride, device=device)
    for name, r in result["runs"].items():
        print(f"{name:>12}: {r['steps_per_s']:8.1f} steps/s  {r['step_ms']:8.3f} ms/step  replay {100 * r['replay_rate']:5.1f}%"
              f"  misses/step {r['missing_pairs_per_step']:6.2f}  fetch {r['fetch_gbps']:6.2f} GB/s")
    print(f"floor: {result['floor_step_ms']:.3f} ms/step (all-resident + fetched bytes at {result['h2d_gbps']:.1f} GB/s "
          f"host->device); pool {pool_slots} slots = {100 * result['coverage']:.1f}% of experts")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0
