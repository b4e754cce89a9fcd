"""How much of a replay a "replay from the first missed layer" could skip (CPU; a design estimate, no timing).

A step that misses replays the whole forward. Layers before the first one that missed in the first pass
computed exactly what a replay would, so a replay could start there (not built). This drives the replay
harness on the CPU device with the preset's expert counts and top-k, tiny widths (the routing is forced, so
the misses do not depend on the weights), the 4 GiB-style arena holding every row, and records, per step
that fetched, the first MoE layer with a miss in its first pass. The mean of that layer over the layers is
the share of the replay's forward a replay from there would skip.

    python benchmarks/first_miss_layers.py --preset ds-v2-lite --layers 8 \
        --trace benchmarks/traces/generate-quality-checkpoint.npz --out first_miss.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import torch
from replay import skewed_steps

from tierstore.geometry import get_preset
from tierstore.runtime import MemoryRowSource, RuntimeConfig, TieredRuntime
from tierstore.runtime.replay import map_trace, preload_arena, trace_steps
from tierstore.runtime.replay_drive import drive
from tierstore.runtime.synthetic import tiled_rows
from tierstore.sim import load_trace


def first_miss_layers(geometry, steps: list[np.ndarray], coverage: float, warmup: int) -> list[int]:
    """Per fetching step after `warmup`: the lowest MoE layer that missed in the step's first pass."""
    g = dataclasses.replace(geometry, hidden=128, expert_inter=128)
    runtime = TieredRuntime(g, MemoryRowSource(tiled_rows(g, False)), pool_slots=max(1, round(coverage * g.total_routed_experts)),
                            arena_slots=g.total_routed_experts, config=RuntimeConfig(kpi_every=0, force_pool=True),
                            output_words=1)
    firsts: list[int] = []
    first_pass = [False]
    with runtime:
        preload_arena(runtime)
        read_pass, step = runtime._read_pass, runtime.step

        def recording_read():
            report = read_pass()
            if first_pass[0] and report.missing_keys and runtime.stats().steps >= warmup:
                firsts.append(min(layer for layer, _ in report.missing_keys))
            first_pass[0] = False
            return report

        def marking_step(*args, **kwargs):
            first_pass[0] = True
            return step(*args, **kwargs)

        runtime._read_pass, runtime.step = recording_read, marking_step
        drive(runtime, steps, warmup=warmup, readback="folded")
    return firsts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="ds-v2-lite")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--trace", help="a recorded trace to run beside the synthetic one")
    parser.add_argument("--trace-layers", choices=("first", "tile"), default="first")
    parser.add_argument("--coverages", default="0.5,0.25,0.1")
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out")
    args = parser.parse_args()
    torch.set_num_threads(1)
    geometry = get_preset(args.preset).with_layers(args.layers)
    workloads = {"synthetic-skewed": (geometry, skewed_steps(geometry, args.steps))}
    if args.trace:
        trace = load_trace(args.trace)
        run_geometry, experts, _ = map_trace(trace, geometry, layers=args.trace_layers, top_k="trace")
        workloads[Path(args.trace).name] = (run_geometry, trace_steps(experts, trace.step, args.layers, args.steps))
    rows = []
    for name, (run_geometry, steps) in workloads.items():
        for coverage in (float(c) for c in args.coverages.split(",")):
            firsts = first_miss_layers(run_geometry, steps, coverage, args.warmup)
            mean = float(np.mean(firsts)) if firsts else 0.0
            rows.append(dict(workload=name, coverage=coverage, fetching_steps=len(firsts), mean_first_miss_layer=mean,
                             skippable_replay_share=mean / args.layers))
            print(f"{args.preset} {name} {coverage:.0%}: {len(firsts)} fetching steps after warm-up, first missed layer "
                  f"{mean:.2f} of {args.layers} on average: a replay from there skips {mean / args.layers:.0%} of it")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(preset=args.preset, layers=args.layers, steps=args.steps,
                                                  warmup=args.warmup, rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()
