"""`tierstore plan`: will this model run on this machine, with which pool sizes, and how fast?"""

from __future__ import annotations

from tierstore.errors import TierstoreError


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="size the GPU pool, FP4 pool and host arena for a model",
                              description=__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="geometry preset name")
    src.add_argument("--config", help="a Hugging Face config.json")
    p.add_argument("--gpu-gb", type=float, required=True)
    p.add_argument("--ram-gb", type=float, required=True)
    p.add_argument("--disk-gb", type=float)
    p.add_argument("--tokens-per-step", type=int, default=1)
    p.add_argument("--gpu-reserve-gb", type=float, default=4.0, help="GPU memory kept for dense weights, KV cache")
    p.add_argument("--ram-reserve-gb", type=float, default=8.0)
    p.add_argument("--trace", help="a routing trace: predicts replay rate and tokens/s with LRU")
    p.set_defaults(func=run)


def _geometry_from_config(path: str):
    import json

    from tierstore.geometry import MoEGeometry

    try:
        cfg = json.loads(open(path, encoding="utf-8").read())
        layers = cfg["num_hidden_layers"]
        experts = cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg["num_local_experts"]
        top_k = cfg.get("num_experts_per_tok") or cfg["num_experts_per_token"]
        inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
        first_dense = cfg.get("first_k_dense_replace", 0)
        return MoEGeometry(name=path, moe_layers=tuple(range(first_dense, layers)), num_experts=experts,
                           top_k=top_k, hidden=cfg["hidden_size"], expert_inter=inter)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise TierstoreError(f"config {path}: cannot read an MoE geometry ({type(exc).__name__}: {exc})") from None


def run(args) -> int:
    from tierstore.geometry import get_preset
    from tierstore.sim.planner import plan

    geometry = get_preset(args.preset) if args.preset else _geometry_from_config(args.config)
    p = plan(geometry, args.gpu_gb, args.ram_gb, args.disk_gb, args.tokens_per_step,
             args.gpu_reserve_gb, args.ram_reserve_gb)
    g = geometry
    print(f"model {g.name}: {g.num_moe_layers} MoE layers x {g.num_experts} experts, top-{g.top_k}")
    print(f"  2-bit store {p.w2_store_gib:8.2f} GiB ({g.w2_expert_bytes / 2**20:.2f} MiB/expert)")
    print(f"  FP4 store   {p.fp4_store_gib:8.2f} GiB ({g.fp4_expert_bytes / 2**20:.2f} MiB/expert)")
    print(f"recommended (GPU {args.gpu_gb} GiB - {args.gpu_reserve_gb} reserve, RAM {args.ram_gb} GiB):")
    print(f"  GPU base pool {p.gpu_pool_slots:6d} slots = {p.gpu_pool_gib:7.2f} GiB, coverage {100 * p.coverage:.1f}%")
    print(f"  FP4 pool      {p.fp4_pool_slots:6d} slots = {p.fp4_pool_gib:7.2f} GiB")
    arena = "whole 2-bit store pinned" if p.arena_slots is None else f"{p.arena_slots} rows"
    print(f"  host arena    {arena} = {p.arena_gib:.2f} GiB;  disk (pack) {p.disk_gib:.2f} GiB")
    print(f"  working set   {p.working_set_slots} slots per step -> verdict: {p.verdict}")
    for note in p.notes:
        print(f"  - {note}")
    if args.trace and p.verdict != "refused":
        from tierstore.sim.importers import load_trace
        from tierstore.sim.simulation import simulate

        trace = load_trace(args.trace)
        r = simulate(trace, gpu_slots=min(p.gpu_pool_slots, trace.num_keys), geometry=g,
                     tokens_per_step=args.tokens_per_step, arena_slots=p.arena_slots or None)
        print(f"predicted on {trace!r} (LRU): token hit rate {100 * r.token_hit_rate:.1f}%, "
              f"replay rate {100 * (1 - r.zero_miss_step_fraction):.1f}% of steps, ~{r.tokens_per_s:,.0f} tokens/s "
              f"(expert traffic only)")
    return 1 if p.verdict == "refused" else 0
