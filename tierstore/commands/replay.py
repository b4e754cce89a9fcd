"""`tierstore replay --trace T --preset P`: a recorded or synthetic routing trace through the real
runtime (pool, arena, pack; on CUDA the Triton kernels, and the CUDA C++ ones where config cuda_w2 finds
them usable: Hopper, nvcc, bfloat16) at a preset's real shapes with synthetic weights, beside an
all-resident run, a naive on-demand baseline and the physical floor. Every run uses the same kernels and
activation dtype, so the floor is measured on them."""

from __future__ import annotations

import argparse
import json
import sys

from tierstore.commands.flags import add_cuda_w2_flag

DTYPES = ("float32", "bfloat16", "float16")


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
    parser.add_argument("--trace-layers", choices=("first", "tile"), default="first",
                        help="run layer l replays trace layer l (first; the trace needs enough layers) or "
                             "l %% trace layers (tile)")
    parser.add_argument("--trace-top-k", choices=("trace", "refuse"), default="trace",
                        help="a trace top-k below the preset's: run the preset's shapes at the trace's top-k "
                             "(trace, default) or refuse; a larger one is always refused")
    parser.add_argument("--steps", type=int, help="replay at most this many steps")
    parser.add_argument("--warmup", type=int, default=0,
                        help="the first N steps are the cold window, timed apart from the steady rest (default 0)")
    parser.add_argument("--eager", action="store_true", help="no CUDA graph of the forward (graphs are used on CUDA)")
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when available")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="activations (default float32; a decoder's are bfloat16, which the CUDA C++ kernels need)")
    parser.add_argument("--arena-preload", action="store_true",
                        help="fill the tiered and naive arenas before the clock starts (no compulsory pack reads)")
    add_cuda_w2_flag(parser, "every run's")
    parser.add_argument("--json", help="also write the result as JSON to this path")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from tierstore.errors import ConfigError, TraceFormatError
    from tierstore.geometry import get_preset
    from tierstore.kernels.layout import w2_slot_layout
    from tierstore.runtime.config import RuntimeConfig
    from tierstore.runtime.engine import slots_for
    from tierstore.runtime.replay import ensure_synthetic_pack, map_trace, open_synthetic_rows, run_replay, trace_steps
    from tierstore.sim import load_trace

    if args.cuda_w2 is True and args.dtype != "bfloat16":
        raise ConfigError(f"--cuda-w2 runs the CUDA C++ kernels, which take bfloat16 activations: add --dtype bfloat16 "
                          f"(got {args.dtype})")
    geometry = get_preset(args.preset)
    if args.layers:
        geometry = geometry.with_layers(args.layers)
    trace = load_trace(args.trace)
    try:
        run_geometry, experts, mapping = map_trace(trace, geometry, layers=args.trace_layers, top_k=args.trace_top_k)
    except TraceFormatError as exc:
        print(f"tierstore replay: refused: {exc}", file=sys.stderr)
        return 2
    print(f"trace mapping: layers {mapping['layers']['rule']}; experts {mapping['experts']['rule']}; "
          f"top-k {mapping['top_k']['rule']}")
    steps = trace_steps(experts, trace.step, geometry.num_moe_layers, args.steps)
    slot_bytes = w2_slot_layout(geometry.hidden, geometry.expert_inter).slot_bytes
    pool_slots = slots_for(run_geometry, slot_bytes, gib=args.gpu_pool_gb, fraction=args.gpu_pool_frac)
    spec = ensure_synthetic_pack(geometry, args.pack_dir)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    result = run_replay(run_geometry, lambda: open_synthetic_rows(spec, args.pack_dir), steps, pool_slots=pool_slots,
                        arena_slots=int(args.arena_gb * 2**30) // spec.stride, device=device, warmup=args.warmup,
                        graph=not args.eager, arena_preload=args.arena_preload, dtype=getattr(torch, args.dtype),
                        config=RuntimeConfig(kpi_every=0, force_pool=True, cuda_w2=args.cuda_w2))
    result["trace_mapping"] = mapping
    cuda = result["runs"]["tiered"]["cuda_w2_kernels"] and args.dtype == "bfloat16"
    print(f"kernels: {'CUDA C++ gate_up and down (config cuda_w2)' if cuda else 'Triton'}, activations {args.dtype}")
    for name, r in result["runs"].items():
        for window in ("cold", "steady"):
            w = r[window]
            if w["steps"]:
                print(f"{name:>9} {window:>6}: {w['steps_per_s']:8.1f} steps/s  {w['step_ms']:8.3f} ms/step (p50 "
                      f"{w['p50_ms']:.3f} p99 {w['p99_ms']:.3f})  replay {100 * w['replay_rate']:5.1f}%  misses/step "
                      f"{w['missing_pairs_per_step']:6.2f}  fetch {w['fetch_gbps']:6.2f} GB/s")
    print(f"floor (steady): {result['floor_step_ms']:.3f} ms/step (plain all-resident + arena hits at "
          f"{result['h2d_gbps']:.1f} GB/s host->device + arena misses at {result['source_read_gbps']:.2f} GB/s source "
          f"read, the faster of the probe's {result['source_read_probe_gbps']:.2f} and the run's own "
          f"{result['source_read_run_gbps']:.2f}); tiered / floor {result['tiered_over_floor']:.2f}x, "
          f"naive / tiered {result['naive_over_tiered']:.2f}x, "
          f"tiered / resident {result['tiered_over_resident']:.2f}x; pool {pool_slots} slots = "
          f"{100 * result['coverage']:.1f}% of experts, {result['pool_over_touched']:.2f}x the "
          f"{result['touched_keys']} keys the replay routes")
    if any(result["runs"]["tiered"]["steady"]["per_step"]["arena_miss_rows"]):
        probed = ", ".join(f"{rows} {ms:.2f}" for rows, ms in result["source_read_ms_by_batch"].items())
        print(f"floor at the steps' own batch sizes: {result['floor_batched_step_ms']:.3f} ms/step (each step's source "
              f"reads at the probe's time for that many rows; rows: ms {probed}); tiered / it "
              f"{result['tiered_over_floor_batched']:.2f}x")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=2)
    return 0
