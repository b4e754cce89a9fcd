"""`tierstore sim`: replay a routing trace through the tiers; sweep capacities and policies."""

from __future__ import annotations

import argparse

from tierstore.errors import TierstoreError


def _list(kind):
    return lambda text: [kind(x) for x in text.split(",") if x]


def _param(text: str):
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"--param needs KEY=VALUE, got {text!r}")
    try:
        return key, float(value) if "." in value or "e" in value else int(value)
    except ValueError:
        return key, value


def register(subparsers) -> None:
    p = subparsers.add_parser("sim", help="simulate a routing trace through GPU / FP4 / RAM / disk tiers",
                              description=__doc__)
    p.add_argument("trace", nargs="?", help="trace file (.npz/.csv/.jsonl), directory or glob")
    p.add_argument("--synthetic", type=int, metavar="TOKENS", help="use a seeded synthetic trace shaped like --preset")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", help="geometry preset for byte sizes and GiB capacities")
    cap = p.add_mutually_exclusive_group()
    cap.add_argument("--gpu-slots", type=_list(int), help="GPU base-pool slots (comma list = sweep)")
    cap.add_argument("--gpu-gb", type=_list(float), help="GPU base-pool GiB (comma list = sweep)")
    cap.add_argument("--coverage", type=_list(float), help="GPU pool as fractions of all routed experts")
    p.add_argument("--policy", type=_list(str), default=["lru"], help="policy name(s), e.g. lru,s3fifo,belady")
    p.add_argument("--param", type=_param, action="append", default=[], help="policy parameter KEY=VALUE")
    p.add_argument("--tokens-per-step", default="1", help="tokens per step, or 'recorded'")
    p.add_argument("--pool", choices=("global", "per-layer"), default="global")
    p.add_argument("--fp4-slots", type=int, default=0)
    p.add_argument("--fp4-policy", default="freq")
    p.add_argument("--gate-tau", type=float)
    p.add_argument("--arena-slots", type=int)
    p.add_argument("--arena-policy", default="lru",
                   help="the host arena's policy (a frequency policy counts the keys the arena is asked for)")
    p.add_argument("--csv", help="write the rows as CSV")
    p.add_argument("--json", help="write the rows as JSON")
    p.add_argument("--plot", help="write a PNG of hit rate and zero-miss steps against coverage")
    p.set_defaults(func=run)


def run(args) -> int:
    from tierstore.geometry import get_preset
    from tierstore.sim.importers import load_trace
    from tierstore.sim.simulation import GIB, resolve_geometry
    from tierstore.sim.sweep import render_table, sweep, write_csv, write_json
    from tierstore.sim.synthetic import synthetic_for

    if (args.trace is None) == (args.synthetic is None):
        raise TierstoreError("give a trace path or --synthetic TOKENS (with --preset)")
    if args.synthetic is not None:
        if not args.preset:
            raise TierstoreError("--synthetic needs --preset")
        trace = synthetic_for(get_preset(args.preset), args.synthetic, skew=1.0, locality=0.3, seed=args.seed)
    else:
        trace = load_trace(args.trace)
    geometry = resolve_geometry(trace, args.preset)
    if args.gpu_slots:
        slots = args.gpu_slots
    elif args.gpu_gb:
        if geometry is None:
            raise TierstoreError("--gpu-gb needs --preset (or a trace whose meta names a preset)")
        slots = [int(gb * GIB // geometry.w2_expert_bytes) for gb in args.gpu_gb]
    else:
        slots = [max(1, round(f * trace.num_keys)) for f in (args.coverage or [0.1, 0.25, 0.5])]
    tps = args.tokens_per_step if args.tokens_per_step == "recorded" else int(args.tokens_per_step)
    options = {"geometry": geometry, "tokens_per_step": tps, "pool": args.pool, "fp4_slots": args.fp4_slots,
               "fp4_policy": args.fp4_policy, "gate_tau": args.gate_tau, "arena_slots": args.arena_slots,
               "arena_policy": args.arena_policy}
    if args.param:
        options["policy_params"] = dict(args.param)
    try:
        rows = sweep(trace, args.policy, slots, **options)
    except ValueError as exc:
        raise TierstoreError(str(exc)) from None
    print(render_table(rows, f"{trace!r}"), end="")
    if args.csv:
        write_csv(rows, args.csv)
    if args.json:
        write_json(rows, args.json)
    if args.plot:
        from tierstore.sim.plot import plot_sweep

        print(f"plot: {plot_sweep(rows, args.plot, title=repr(trace))}")
    return 0
