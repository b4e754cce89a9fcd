"""Host cost of the miss path, old tree vs new tree in one run (CPU, or CUDA with the step time too).

The replay benchmark's tiered run at ds-v2-lite's routing shape by default (8 MoE layers x 64 experts, top-6;
`--preset` / `--layers` for another,
one token per step, Zipf 1.1 routing from `benchmarks/replay.py`), pool at 25% (128 slots) by default,
arena preloaded with every row (each miss is an arena hit, as in `--arena-preload`), driven through
`replay_drive.drive` (step protocol, token folded into the pass-log read). On the CPU device with
tiny rows (hidden and expert width 128: 16 KiB slots) so that the copies (memcpys there) do not
hide the Python around them; with `--device cuda` at the preset's real rows, bf16, CUDA graphs (the
replay benchmark's warm case), where the steady step time is reported too. Timed by wrapping, in
both trees alike, under whichever names a tree has: the step's fetch (`TieredRuntime._fetch_for_step` since
the located fetch of 879dcab, `_fetch` after e8b7b7f, `fetch` before), its arena part (`Arena.locate` and
`Arena.fetch`) and its install (`DevicePool.install_located` and `install`), one fetch per steady step; and
`to_first_copy`, from the end of the pass-log read (on CUDA: its sync, the wait for the forward, plus the
read of the log) to the install's first row copy (`DevicePool._issue` or `_copy_rows`), the host latency the
copies wait for. Both trees run single passes (`pass_pair` off where the tree has it). The deferred policy hits
are applied before the read, as on CUDA with a pool that can evict (`_early_hits`), so they do not count in the
fetch.

The parent process alternates rounds between the trees (`--baseline REV`, checked out as a git
worktree, and the working tree), each round a fresh subprocess importing that tree's tierstore.

    python benchmarks/fetch_overhead.py --out X.json     # the working tree against its HEAD (the default)
    python benchmarks/fetch_overhead.py --baseline e8b7b7f --out X.json   # trees from e8b7b7f on have its hooks
    python3 benchmarks/fetch_overhead.py --device cuda --baseline e8b7b7f --rounds 3 --steps 300 --out X.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import time
from pathlib import Path

from _cpu_bench import add_tree_options, emit, git_out, old_tree, run_rounds, wrap_timed

PARTS = ("fetch", "arena", "install", "to_first_copy")


def timed(owner, name: str, part: str, calls: dict, runtime) -> None:
    """Replace owner.name by a wrapper recording (step index, seconds) of every call in calls[part]."""
    wrap_timed(owner, name, lambda started: calls[part].append((runtime._stats.steps, time.perf_counter() - started)))


def worker(steps: int, warmup: int, device: str, coverage: float, preset: str, layers: int) -> dict:
    import torch
    from replay import skewed_steps

    from tierstore.geometry import get_preset
    from tierstore.runtime import MemoryRowSource, RuntimeConfig, TieredRuntime
    from tierstore.runtime.replay import preload_arena
    from tierstore.runtime.replay_drive import drive
    from tierstore.runtime.synthetic import tiled_rows

    torch.set_num_threads(1)
    g = get_preset(preset).with_layers(layers)
    if device == "cpu":  # tiny rows: the memcpys must not hide the Python around them
        g = dataclasses.replace(g, hidden=128, expert_inter=128)
    # both trees: Triton; single passes that fetch (a tree with pass_pair would pair on CUDA, one with stream_arena
    # would stream its misses: not the path timed here); each knob only where the tree's config has it
    wanted = dict(kpi_every=0, force_pool=True, cuda_w2=False, pass_pair=False, stream_arena=False)
    fields = {field.name for field in dataclasses.fields(RuntimeConfig)}
    knobs = {name: value for name, value in wanted.items() if name in fields}
    runtime = TieredRuntime(g, MemoryRowSource(tiled_rows(g, False)), pool_slots=round(coverage * g.total_routed_experts),
                            arena_slots=g.total_routed_experts, device=device, config=RuntimeConfig(**knobs),
                            output_words=1)
    with runtime:
        runtime._early_hits = True  # as on CUDA with a pool that can evict: the last step's hits before the read
        preload_arena(runtime)
        calls: dict[str, list] = {part: [] for part in PARTS}
        # the step's fetch and its parts under each tree's names: the located fetch (arena.locate,
        # pool.install_located) since 879dcab, the general one (arena.fetch, pool.install) before and beside it
        fetch = next(name for name in ("_fetch_for_step", "_fetch", "fetch") if hasattr(runtime, name))
        hooks = [(runtime, fetch, "fetch")] + [(owner, name, part) for owner, names, part in (
            (runtime.arena, ("locate", "fetch"), "arena"), (runtime.pool, ("install_located", "install"), "install"))
            for name in names if hasattr(owner, name)]
        for owner, name, part in hooks:
            timed(owner, name, part, calls, runtime)
        read_ended = []
        wrap_timed(runtime.log, "read", lambda started: read_ended.append(time.perf_counter()))

        def first_copy(issue):
            def issue_noting_first(*args):
                if read_ended:
                    calls["to_first_copy"].append((runtime._stats.steps, time.perf_counter() - read_ended.pop()))
                    read_ended.clear()
                return issue(*args)
            return issue_noting_first

        for name in ("_copy_rows", "_issue"):  # the general path's copies, the located path's (and, on CUDA, both)
            if hasattr(runtime.pool, name):
                setattr(runtime.pool, name, first_copy(getattr(runtime.pool, name)))
        out = drive(runtime, skewed_steps(g, steps), warmup=warmup, readback="folded", graph=device == "cuda",
                    dtype=torch.bfloat16 if device == "cuda" else torch.float32)
        rows = runtime.stats().fetched_rows
    steady = {part: [s for step, s in values if step >= warmup] for part, values in calls.items()}
    if not all(steady.values()):
        raise RuntimeError("no steady fetch reached these hooks: "
                           + ", ".join(part for part, values in steady.items() if not values))
    return {"steps": steps, "warmup": warmup, "fetches": len(steady["fetch"]),
            "rows_per_fetch_call": rows / len(calls["fetch"]), "step_ms": out["steady"].as_dict()["step_ms"],
            **{f"{part}_p50_us": 1e6 * statistics.median(values) for part, values in steady.items()},
            **{f"{part}_mean_us": 1e6 * statistics.fmean(values) for part, values in steady.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true")
    add_tree_options(parser, baseline="HEAD")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--coverage", type=float, default=0.25, help="pool slots over the routed experts")
    parser.add_argument("--preset", default="ds-v2-lite")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--commit", help="commit of the new tree (when .git there is stale)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.steps, args.warmup, args.device, args.coverage, args.preset, args.layers)))
        return
    repo = Path(__file__).resolve().parent.parent
    head = args.commit or git_out(repo, "rev-parse", "HEAD").strip()
    dirty = bool(git_out(repo, "status", "--porcelain", "tierstore").strip())
    with old_tree(repo, args) as old:
        results = run_rounds(__file__, {"old": old, "new": repo}, args.rounds,
                             ["--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
                              "--coverage", str(args.coverage), "--preset", args.preset, "--layers", str(args.layers)])
    medians = {f"{part}_p50_us": {name: statistics.median(r[f"{part}_p50_us"] for r in rows)
                                  for name, rows in results.items()} for part in PARTS}
    medians["step_ms"] = {name: statistics.median(r["step_ms"] for r in rows) for name, rows in results.items()}
    medians["rows_per_fetch_call"] = {name: rows[0]["rows_per_fetch_call"] for name, rows in results.items()}
    report = dict(provenance=dict(old=args.baseline, new=head, new_tree_dirty=dirty, python=platform.python_version(),
                                  machine=platform.machine(), cpus=os.cpu_count(), rounds=args.rounds,
                                  device=args.device, coverage=args.coverage, preset=args.preset, layers=args.layers,
                                  gpu=gpu_name(args.device),
                                  note=("CPU: copies are memcpys of 16 KiB rows" if args.device == "cpu" else
                                        "CUDA: ds-v2-lite rows, bf16, CUDA graphs, arena preloaded")),
                  results=results, medians=medians)
    emit(medians, report, args.out)


def gpu_name(device: str) -> str | None:
    if device != "cuda":
        return None
    import torch

    return torch.cuda.get_device_name()


if __name__ == "__main__":
    main()
