"""The pass pair's choice over a trace on the CPU, each step's time taken from a model instead of the clock.

A CPU runtime (toy shapes: `--layers` x `--experts`, hidden 64) replays the routing of a trace (the one recorded by
`tierstore generate` by default, layers tiled, or `--synthetic`: `replay.py`'s skewed trace) with config `pass_pair` on,
and the runtime's real `PairChoice` decides; only the wall time each step reports to the choice is replaced by a
model of the H200's (a pair, a single pass that missed nothing, a single pass that missed: `--times`, ms; by default
the recorded trace's at qwen3-30b-a3b 50 % in first21). Prints, over the steps after `--warmup`, how many ran as a
pair or a single pass and whether their first pass missed (P / s, m / -), and the modelled mean step. A model of the
choice's decisions, not a timing: the CPU's own times are not used, and the pool's state follows the real runs.

    python3 benchmarks/pair_choice_trace.py --coverage 0.5
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "benchmarks" / "traces" / "generate-quality-checkpoint.npz"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8, help="the geometry's top-k (the recorded trace's own is used)")
    parser.add_argument("--coverage", type=float, default=0.5)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--synthetic", type=int, default=0, help="that many steps of the skewed trace instead")
    parser.add_argument("--times", default="0.76,0.39,0.98", help="ms of a pair, a single no-miss, a single miss")
    args = parser.parse_args(argv)
    pair_ms, hit_ms, miss_ms = (float(v) for v in args.times.split(","))

    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT / "tests"))
    from replay import skewed_steps
    from test_runtime_fixtures import memory_source, toy_geometry

    from tierstore.runtime.config import RuntimeConfig
    from tierstore.runtime.engine import TieredRuntime
    from tierstore.runtime.replay import map_trace, trace_steps
    from tierstore.runtime.replay_drive import forward_fn, step_inputs
    from tierstore.sim import load_trace

    g = toy_geometry(args.layers, args.experts, args.top_k, hidden=64, inter=32)
    if args.synthetic:
        steps = skewed_steps(g, args.synthetic)
    else:
        trace = load_trace(TRACE)
        g, ids, _ = map_trace(trace, g, layers="tile")
        steps = trace_steps(ids, trace.step, g.num_moe_layers, None)
    total = g.total_routed_experts
    config = RuntimeConfig(kpi_every=0, force_pool=True, pass_pair=True)
    with TieredRuntime(g, memory_source(g), pool_slots=round(total * args.coverage), arena_slots=total, device="cpu",
                       config=config, output_words=1) as rt:
        rt.arena.fetch([(layer, e) for layer in range(g.num_moe_layers) for e in range(g.num_experts)], scan=True)
        choice, done = rt._pair_choice, rt._pair_choice.done

        def modelled(seconds, *shortfall, first_missed=True):  # a pair reports its shortfall, a single pass none
            ms = pair_ms if shortfall else miss_ms if first_missed else hit_ms
            done(ms / 1e3, *shortfall, first_missed=first_missed)
        choice.done = modelled
        forward = forward_fn(rt, *step_inputs(rt, torch.float32), False, publish=True)
        kinds, total_ms = [], 0.0
        for i, route in enumerate(steps):
            route = torch.as_tensor(route)
            run = lambda route=route: forward(route)  # noqa: E731
            pairs = rt.stats().pair_steps
            _, outcome = rt.step(run, lambda: None, forward_pair=rt.pass_pair(run, lambda: None))
            paired, missed = rt.stats().pair_steps > pairs, outcome.first_pass_missing_pairs > 0
            if i >= args.warmup:
                kinds.append(("P" if paired else "s") + ("m" if missed else "-"))
                total_ms += pair_ms if paired else miss_ms if missed else hit_ms
    print(f"coverage {args.coverage:.0%}: {dict(collections.Counter(kinds))}, modelled mean step "
          f"{total_ms / max(len(kinds), 1):.3f} ms")
    print(" ".join(kinds))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
