"""The armed-but-silent gate and the FP4 tier's step cost on CPU, old tree vs new tree in one run.

Each round runs a fresh subprocess per tree (`--baseline REV` as a git worktree, and the working
tree). The worker: ds-v2-lite routing (8 MoE layers x 64 experts, top-6, one token per step) at a
small expert size (hidden 256, inter 128, so the forward's CPU compute does not drown the host
work), base pool all-resident, FP4 pool of 25% preloaded with the trace's hottest experts under
policy `need` (no lazy promotion in either tree: residency is held without a manager pause, which
the old tree lacks; the manager still takes every window), synthetic logits of 32000 entries at
confidence 0.99 (gate tau 0.60 never fires). It times `drive` blocks in ABBA order with the gate
armed and unarmed (the same runtime, `runtime.gate` toggled), a W2-only runtime, and the live
manager (`live_ms`: policy `freq`, lazy promotion into a 25% FP4 pool, a fresh runtime per
repetition, one warm-up block then one timed block; `live_fp4_share`: FP4 share of routed pairs).

    python benchmarks/gate_step_cpu.py --baseline 7cdd7d5 --out benchmarks/results/gate_step_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

from _cpu_bench import baseline_worktree, emit, git_out, run_rounds


def worker(steps: int, reps: int) -> dict:
    import dataclasses

    import numpy as np

    from tierstore.geometry import get_preset
    from tierstore.runtime import MemoryRowSource, RuntimeConfig, TieredRuntime
    from tierstore.runtime.replay_drive import drive
    from tierstore.runtime.replay_gate import confidence_logits, fire_schedule
    from tierstore.runtime.synthetic import tiled_rows

    g = dataclasses.replace(get_preset("ds-v2-lite").with_layers(8), hidden=256, expert_inter=128)
    rng = np.random.default_rng(0)
    probs = 1.0 / np.arange(1, 65) ** 1.1
    probs /= probs.sum()
    route = [np.asarray([rng.choice(64, 6, replace=False, p=probs) for _ in range(8)], np.int64)[None]
             for _ in range(steps)]  # [1, L, k] each
    counts = np.zeros(g.total_routed_experts, np.int64)
    for ids in route:
        np.add.at(counts, (np.arange(8)[:, None] * 64 + ids[0]).reshape(-1), 1)
    hottest = [divmod(int(i), 64) for i in np.argsort(-counts, kind="stable")[:128]]
    w2, fp4 = tiled_rows(g, fp4=False), tiled_rows(g, fp4=True)
    logits = confidence_logits(fire_schedule(steps, 0), 1, 32000, "cpu")

    def block(runtime) -> float:
        started = time.perf_counter()
        drive(runtime, route, warmup=0, logits=logits)
        return 1e3 * (time.perf_counter() - started) / steps

    out: dict = {"unarmed_ms": [], "armed_ms": [], "w2_ms": []}
    config = RuntimeConfig(kpi_every=0, force_pool=True, force_fp4_pool=True, gate=True, gate_tau=0.6, fp4_policy="need")
    with TieredRuntime(g, MemoryRowSource(w2), pool_slots=g.total_routed_experts, config=config,
                       fp4_source=MemoryRowSource(fp4), fp4_slots=128, fp4_arena_slots=128) as runtime:
        runtime.preload()
        runtime.preload_fp4(hottest)
        gate = runtime.gate
        block(runtime)  # warm-up
        for rep in range(reps):
            for mode in (("unarmed", "armed") if rep % 2 == 0 else ("armed", "unarmed")):
                runtime.gate = gate if mode == "armed" else None
                out[f"{mode}_ms"].append(block(runtime))
        runtime.gate = gate
        out["fp4_mapped"] = runtime.fp4.pool.num_mapped
        out["gate_fired"] = runtime.gate_stats().fired
    with TieredRuntime(g, MemoryRowSource(w2), pool_slots=g.total_routed_experts,
                       config=RuntimeConfig(kpi_every=0, force_pool=True)) as runtime:
        runtime.preload()
        block(runtime)
        out["w2_ms"] = [block(runtime) for _ in range(reps)]
    # live manager: policy `freq`, lazy promotion into a 25% pool that starts empty (the manager's
    # promotion work competes with every step); one fresh runtime per repetition
    out["live_ms"], out["live_fp4_share"], out["live_promoted"] = [], [], []
    for _ in range(reps):
        with TieredRuntime(g, MemoryRowSource(w2), pool_slots=g.total_routed_experts,
                           config=RuntimeConfig(kpi_every=0, force_pool=True, force_fp4_pool=True),
                           fp4_source=MemoryRowSource(fp4), fp4_slots=128, fp4_arena_slots=128) as runtime:
            runtime.preload()
            block(runtime)  # warm-up: the pool fills
            out["live_ms"].append(block(runtime))
            stats = runtime.fp4_stats()
            out["live_fp4_share"].append(stats.fp4_pair_share)
            out["live_promoted"].append(stats.promoted_lazy)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--baseline", default="7cdd7d5")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--reps", type=int, default=4, help="ABBA repetitions per round")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.steps, args.reps)))
        return
    repo = Path(__file__).resolve().parent.parent
    head = git_out(repo, "rev-parse", "--short", "HEAD").strip()
    dirty = git_out(repo, "status", "--porcelain", "tierstore").split("\n")
    with baseline_worktree(repo, args.baseline) as old:
        results = run_rounds(Path(__file__).resolve(), {"old": old, "new": repo}, args.rounds,
                             ["--steps", str(args.steps), "--reps", str(args.reps)])
    medians = {}
    for name, rows in results.items():
        unarmed = statistics.median(v for r in rows for v in r["unarmed_ms"])
        armed = statistics.median(v for r in rows for v in r["armed_ms"])
        w2 = statistics.median(v for r in rows for v in r["w2_ms"])
        medians[name] = dict(w2_ms=w2, unarmed_ms=unarmed, armed_ms=armed, armed_cost=armed / unarmed - 1,
                             fp4_over_w2=unarmed / w2)
        live = [v for r in rows for v in r.get("live_ms", [])]
        if live:
            medians[name].update(live_ms=statistics.median(live), live_over_w2=statistics.median(live) / w2,
                                 live_over_held=statistics.median(live) / unarmed,
                                 live_fp4_share=statistics.median(v for r in rows for v in r["live_fp4_share"]))
    report = dict(provenance=dict(old=args.baseline, new=head, new_tree_dirty_paths=[p for p in dirty if p],
                                  python=platform.python_version(), machine=platform.machine(), cpus=os.cpu_count(),
                                  rounds=args.rounds, reps=args.reps, steps=args.steps,
                                  note="CPU only (no GPU): TorchExperts forward, no CUDA graphs, no device syncs"),
                  results=results, medians=medians)
    emit(medians, report, args.out)


if __name__ == "__main__":
    main()
