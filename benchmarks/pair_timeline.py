"""Where a pass pair's time goes on the device (config pass_pair): torch.profiler (CUPTI) around warm steps of the
replay benchmark's setup (synthetic skewed trace, preloaded 4 GiB arena, bf16, CUDA graphs, token folded), each
step's device activities cut into:

    span         the step's first device activity -> its last
    first_copy   span start -> the first row-copy kernel's start (`gather_pass_rows` on the side stream)
    copies       first row-copy start -> last row-copy end; `copy_busy` the time some row copy ran, and the rows'
                 MB over each (GB/s)
    tail         last row-copy end -> the step's last device activity
    compute_busy the time some other kernel ran (both passes), and how much of it overlapped a row copy

Medians over the profiled steps that launched a pair and gathered. A diagnostic: the profiler adds host time per
launch (the device-side intervals are what is read here).

    python3 benchmarks/pair_timeline.py --preset ds-v2-lite --layers 8 --coverage 0.5 --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

COPY_KERNEL = "gather_pass_rows"
STEP = "tierstore.step"


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _overlap(intervals: list[tuple[float, float]], others: list[tuple[float, float]]) -> float:
    """Time covered by both unions (us)."""
    return _union(intervals) + _union(others) - _union(intervals + others)


def step_phases(events: list[dict], row_mb: list[float]) -> list[dict]:
    """One dict of phases (us) per host step range, in order, with that step's gathered MB."""
    steps = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
                   if e.get("name") == STEP and e.get("ph") == "X")
    kernels = [e for e in events if e.get("cat") == "kernel"]
    out = []
    for (start, end), mb in zip(steps, row_mb):
        # a step's device work starts after its host range starts and may end a little after it
        mine = [e for e in kernels if start <= float(e["ts"]) <= end]
        copies = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in mine if COPY_KERNEL in e["name"]]
        others = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in mine if COPY_KERNEL not in e["name"]]
        busy = [c for c in copies if c[1] > c[0] + 1.0]  # copy kernels that moved rows (an empty plan exits at once)
        if not busy or not others:
            continue
        first = min(a for a, _ in copies + others)
        last = max(b for _, b in copies + others)
        copy_start, copy_end = min(a for a, _ in busy), max(b for _, b in busy)
        copy_busy = _union(busy)
        out.append({"span": last - first, "first_copy": copy_start - first, "copies": copy_end - copy_start,
                    "copy_busy": copy_busy, "tail": last - copy_end, "compute_busy": _union(others),
                    "compute_during_copies": _overlap(busy, others), "mb": mb,
                    "gbps_span": mb * 1e3 / (copy_end - copy_start), "gbps_busy": mb * 1e3 / copy_busy})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="ds-v2-lite")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--coverage", type=float, default=0.5)
    parser.add_argument("--copy-blocks", type=int, default=4, help="config pass_pair_copy_blocks")
    parser.add_argument("--warm-steps", type=int, default=60)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pack-dir", default="/tmp/rp-timeline")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--commit", default="")
    args = parser.parse_args()

    import torch
    if not torch.cuda.is_available():
        sys.exit("pair_timeline.py needs CUDA")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from replay import skewed_steps

    from tierstore.geometry import get_preset
    from tierstore.runtime import RuntimeConfig, TieredRuntime
    from tierstore.runtime.replay import ensure_synthetic_pack, open_synthetic_rows, preload_arena
    from tierstore.runtime.replay_drive import drive

    g = get_preset(args.preset).with_layers(args.layers)
    spec = ensure_synthetic_pack(g, args.pack_dir)
    steps = skewed_steps(g, args.warm_steps + args.steps)
    slots = round(args.coverage * g.total_routed_experts)
    config = RuntimeConfig(kpi_every=0, force_pool=True, pass_pair=True, pass_pair_copy_blocks=args.copy_blocks)
    with TieredRuntime(g, open_synthetic_rows(spec, args.pack_dir), pool_slots=slots,
                       arena_slots=int(4 * 2**30) // spec.stride, device="cuda", config=config, output_words=1) as rt:
        preload_arena(rt)
        warm = drive(rt, steps[:args.warm_steps], warmup=10, graph=True, readback="folded", dtype=torch.bfloat16)
        step, gathered = rt.step, []

        def ranged(*a, **k):
            before = rt.stats().gathered_rows  # settles the pair before (its rows are counted at the next read)
            gathered.append(before)
            with torch.profiler.record_function(STEP):
                return step(*a, **k)
        rt.step = ranged
        activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            drive(rt, steps[args.warm_steps:], warmup=0, graph=True, readback="folded", dtype=torch.bfloat16)
        gathered.append(rt.stats().gathered_rows)
        rt.step = step
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(path))
            trace = json.loads(path.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    # gathered[i]: rows counted when step i started (through step i - 1: a pair's rows reach the host at the next
    # settle); the last entry after the last step
    row_mb = [(b - a) * spec.row_bytes / 1e6 for a, b in zip(gathered, gathered[1:])]
    phases = step_phases(events, row_mb)
    summary = {k: statistics.median(p[k] for p in phases) for k in phases[0]} if phases else {}
    report = {"provenance": {"commit": args.commit, "torch": torch.__version__, "device": torch.cuda.get_device_name()},
              "preset": args.preset, "layers": args.layers, "coverage": args.coverage, "copy_blocks": args.copy_blocks,
              "unprofiled_step_ms": warm["steady"].as_dict()["step_ms"], "steps_read": len(phases),
              "median": summary, "steps": phases}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(f"{args.preset} {args.layers} layers, coverage {args.coverage}, copy blocks {args.copy_blocks}: step "
          f"{report['unprofiled_step_ms']:.3f} ms unprofiled; {len(phases)} pair steps read, medians (us, MB, GB/s):")
    print("  " + ", ".join(f"{k} {v:.1f}" for k, v in summary.items()))


if __name__ == "__main__":
    main()
