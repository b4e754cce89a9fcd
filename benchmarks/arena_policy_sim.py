"""Which policy should the host arena evict by? Pack rows read per step in the simulator with the arena at `lru` (the
runtime's), `freq-dense` (counting the keys the arena is asked for: the GPU pool's misses) and `belady` (the
trace's future, a reference), under a `freq-dense` GPU pool (the runtime's default), on the replay benchmark's
synthetic skewed steps and the recorded trace, GPU pool and arena at fractions of all experts.

    python3 benchmarks/arena_policy_sim.py --json benchmarks/results/arena_policy_sim.json
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from tierstore.bench.provenance import provenance
from tierstore.geometry import get_preset
from tierstore.sim import load_trace, simulate
from tierstore.sim.trace import Trace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))  # for replay.py's routing (python -P leaves this folder off)
from replay import skewed_steps  # noqa: E402

ARENA_POLICIES = ("lru", "freq-dense", "belady")
HALF_LIFE_STEPS = 4096.0  # the runtime's 60 s at 5-15 ms a step is thousands of steps


def disk_rows_per_step(result, warmup: int) -> float:
    c = result.counters
    return float((c["miss_keys"][warmup:] - c["arena_rows"][warmup:]).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000, help="synthetic steps")
    parser.add_argument("--recorded", type=Path, default=ROOT / "benchmarks/traces/generate-quality-checkpoint.npz")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    workloads = []
    for preset, layers in (("ds-v2-lite", 8), ("qwen3-30b-a3b", 16)):
        g = get_preset(preset).with_layers(layers)
        workloads.append((f"{preset} synthetic", Trace(experts=np.concatenate(skewed_steps(g, args.steps), 0),
                                                       num_experts=g.num_experts)))
    workloads.append(("recorded (8 layers x 32 experts)", load_trace(args.recorded)))
    rows = []
    print(f"{'workload':>34s} {'gpu':>5s} {'arena':>5s}  pack rows per step: " + " / ".join(ARENA_POLICIES))
    for name, trace in workloads:
        keys = trace.num_layers * trace.num_experts
        warmup = trace.num_tokens // 10
        for gpu in (0.1, 0.25):
            for arena in (0.25, 0.5):
                disk = {}
                for policy in ARENA_POLICIES:
                    result = simulate(trace, int(gpu * keys), "freq-dense",
                                      policy_params={"half_life": HALF_LIFE_STEPS}, arena_slots=int(arena * keys),
                                      arena_policy=policy)
                    disk[policy] = disk_rows_per_step(result, warmup)
                rows.append({"workload": name, "keys": keys, "steps": trace.num_tokens, "gpu": gpu, "arena": arena,
                             "disk_rows_per_step": disk})
                ratio = f"  (freq-dense / lru {disk['freq-dense'] / disk['lru']:.2f}x)" if disk["lru"] else ""
                print(f"{name:>34s} {gpu:5.2f} {arena:5.2f}  " + " / ".join(f"{disk[p]:.2f}" for p in ARENA_POLICIES)
                      + ratio, flush=True)
    if args.json:
        args.json.write_text(json.dumps({"provenance": provenance(None), "half_life_steps": HALF_LIFE_STEPS,
                                         "gpu_policy": "freq-dense", "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
