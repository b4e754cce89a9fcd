"""Host cost of publishing a filling arena's row addresses to the passes, old tree vs new tree in one run (CPU).

While an arena that holds every expert fills (`tierstore generate`'s auto arena is not preloaded), every step
that read a new row moves the arena's `version`, and the next step's `StreamRows.refresh` (config
`stream_arena`) rebuilds the stream table; `PassGather.arm_staged` does the same for the pass's own fetch. Here,
at a preset's full routed shape (every MoE layer x E), an arena over tiny in-memory rows is half filled, then
each timed round fetches one new row and refreshes the table: the two calls a filling step adds. CPU device, so
the refresh also rebuilds the CPU runtime's row views (on CUDA it copies the table to the device instead).

The parent process alternates rounds between the trees (`--baseline REV`, checked out as a git worktree, and the
working tree), each round a fresh subprocess importing that tree's tierstore:

    python benchmarks/address_tables.py --baseline 2dbc214 --out benchmarks/results/address_tables_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

from _cpu_bench import add_tree_options, emit, git_out, old_tree, run_rounds

ROW_BYTES = 64  # one page of arena per row: the table's size, not the bytes, is what is timed


def worker(preset: str, fills: int, seed: int) -> dict:
    import torch

    from tierstore.cache.arena import Arena
    from tierstore.geometry import get_preset
    from tierstore.runtime.rows import MemoryRowSource
    from tierstore.runtime.stream_rows import StreamRows

    geometry = get_preset(preset)
    layers, experts = geometry.num_moe_layers, geometry.num_experts
    source = MemoryRowSource(torch.zeros(layers, experts, ROW_BYTES, dtype=torch.uint8))
    arena = Arena(source, layers * experts, pin=False)
    keys = [(layer, expert) for layer in range(layers) for expert in range(experts)]
    random.Random(seed).shuffle(keys)
    half = len(keys) // 2
    arena.fetch(keys[:half], scan=True)
    table = StreamRows(torch.empty(1, arena.stride, dtype=torch.uint8), layers, experts)
    table.refresh(arena)
    fetch_s, refresh_s = [], []
    for key in keys[half:half + fills]:
        started = time.perf_counter()
        arena.fetch([key], scan=True)
        fetched = time.perf_counter()
        table.refresh(arena)
        fetch_s.append(fetched - started)
        refresh_s.append(time.perf_counter() - fetched)
    arena.close()
    return {"entries": layers * experts, "fills": len(refresh_s),
            "fetch_p50_us": 1e6 * statistics.median(fetch_s), "refresh_p50_us": 1e6 * statistics.median(refresh_s)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    add_tree_options(parser, baseline="2dbc214")
    parser.add_argument("--presets", default="ds-v2-lite,qwen3-30b-a3b,deepseek-v3")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fills", type=int, default=200, help="timed fetch + refresh pairs per round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", help=argparse.SUPPRESS)  # a worker's preset
    parser.add_argument("--commit", help="commit of the new tree (when .git there is stale)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.preset, args.fills, args.seed)))
        return
    repo = Path(__file__).resolve().parent.parent
    head = args.commit or git_out(repo, "rev-parse", "HEAD").strip()
    dirty = bool(git_out(repo, "status", "--porcelain", "tierstore").strip())
    presets = args.presets.split(",")
    results, medians = {}, {}
    with old_tree(repo, args) as old:
        for preset in presets:
            rows = run_rounds(__file__, {"old": old, "new": repo}, args.rounds,
                              ["--preset", preset, "--fills", str(args.fills), "--seed", str(args.seed)])
            results[preset] = rows
            cell = {part: {name: statistics.median(r[part] for r in runs) for name, runs in rows.items()}
                    for part in ("fetch_p50_us", "refresh_p50_us")}
            cell["entries"] = rows["new"][0]["entries"]
            cell["refresh_old_over_new"] = cell["refresh_p50_us"]["old"] / cell["refresh_p50_us"]["new"]
            medians[preset] = cell
    report = dict(provenance=dict(old=args.baseline, new=head, new_tree_dirty=dirty, python=platform.python_version(),
                                  machine=platform.machine(), cpus=os.cpu_count(), rounds=args.rounds,
                                  fills=args.fills, seed=args.seed,
                                  note="CPU device: the refresh rebuilds the CPU runtime's row views too"),
                  results=results, medians=medians)
    emit(medians, report, args.out)


if __name__ == "__main__":
    main()
