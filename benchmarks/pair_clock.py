"""How long a pass pair runs on the device against its step's wall time (config pass_pair): CUDA events around the
pair's graph launch, host timestamps around the step, in the replay benchmark's setup (synthetic skewed trace,
preloaded 4 GiB arena, bf16, CUDA graphs, token folded). Per step that launched a pair:

    wall      the step's host time (runtime.step)
    device    the pair graph's device time (an event before its launch, one after)
    launch    the step's start -> the pair's launch returned (host: arming, the graph launch)
    bound, arm_start, arm_end, record   host marks from the step's start: the routing bound to the graphs, the
              spares' arming begun and done, the pair's first event recorded (just before its graph launch)
    after     the wall minus `launch` minus `device` (host time not overlapped by the pair: the pass-log read's
              wake-up, its parse, the host's bookkeeping, and any fetch and replay when the pair fell short)

Medians, and the same for the steps whose pair needed no host fetch (one replay).

`--hold-us N`: every other pair step first queues a device sleep of about N us before its first event, so the whole
graph is submitted before the device reaches it: that step's `device` is the graph's execution alone, and its
difference from the other steps' `device` is the time the device waited for the launch (`median_held`). Also the
host time of launching the single-pass graph alone (`single_launch_us`, device idle before each launch), against the
pair's (`launch - record`).

`--profile-steps N`: N more pair steps (then 8 single passes of the same kind of graph, `single_pass_timelines`: span
and busy time, for scale) under torch.profiler (CUPTI), each pair step cut from the device's own timestamps
(`pair_timelines`, microseconds): `span` (the step's first device activity to its last), `pass1` (to the end of the
last plan kernel, the first pass's last work) and `pass1_busy` (the time some kernel other than a row copy ran in it:
the compute stream's, and the plans' where they have their own stream), `replay` (from there to the end) and
`replay_busy` / `replay_wait` (the same busy time in it, and the rest: a layer waiting for its rows),
`pass1:<kernel>` / `replay:<kernel>` (device time by kernel name in each pass), `copy_busy` (the row-copy kernels'
busy time on the side stream), `copies_end` (the last copy's end from the span's start) and `tail` (the last copy's
end to the span's end); `copy_gbps` = the profiled steps' mean gathered bytes / the median copy_busy. A diagnostic:
the profiler lengthens the step (its span against the unprofiled `device`).

    python3 benchmarks/pair_clock.py --preset ds-v2-lite --layers 8 --coverage 0.5 [--copies engine] [--hold-us 1000] \
        [--profile-steps 20] --json out.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _timeline_medians(timelines: list[dict]) -> dict:
    fields = sorted({k for t in timelines for k in t})
    return {k: statistics.median(t[k] for t in timelines if k in t) for k in fields}


PLAN, COPY = "plan_pass_gather", "gather_pass_rows"  # the pair's kernels, by name
SINGLE = "pair_clock.single_pass"  # a profiled single pass's host range


def single_pass_timelines(events: list[dict]) -> list[dict]:
    """{"span", "busy", "single:<kernel name>": device time by name} (microseconds) of each profiled single pass (a
    `SINGLE` host range ending with a sync)."""
    from miss_step_timeline import DEVICE_CATS, _interval, _union

    device = [e for e in events if e.get("cat") in DEVICE_CATS and e.get("ph") == "X"]
    out = []
    for s0, s1 in sorted(_interval(e) for e in events if e.get("cat") == "user_annotation" and e.get("name") == SINGLE):
        inside = [e for e in device if s0 <= e["ts"] <= s1]
        acts = [_interval(e) for e in inside]
        if acts:
            t = {"span": max(b for _, b in acts) - min(a for a, _ in acts), "busy": _union(acts)}
            for e in inside:
                key = f"single:{kernel_name(e)}"
                t[key] = t.get(key, 0.0) + float(e.get("dur", 0.0))
            out.append(t)
    return out


def kernel_name(event: dict) -> str:
    """A device activity's name up to its argument list or template, at most 48 characters."""
    name = event.get("name", "")
    for mark in ("(", "<"):
        name = name.split(mark)[0]
    return name.strip()[:48]


def pair_timelines(events: list[dict]) -> list[dict]:
    """One dict per profiled pair step (a `tierstore.step` host range whose device work has plan kernels): see the
    module doc. A device activity belongs to the step whose host range holds its start (a step ends with a sync)."""
    from miss_step_timeline import DEVICE_CATS, STEP, _interval, _union

    device = sorted((e for e in events if e.get("cat") in DEVICE_CATS and e.get("ph") == "X"), key=lambda e: e["ts"])
    steps = sorted(_interval(e) for e in events if e.get("cat") == "user_annotation" and e.get("name") == STEP)
    out = []
    for s0, s1 in steps:
        acts = [e for e in device if s0 <= e["ts"] <= s1]
        plans = [e for e in acts if PLAN in e.get("name", "")]
        if not plans:
            continue
        copies = [e for e in acts if COPY in e.get("name", "")]
        compute = [e for e in acts if COPY not in e.get("name", "")]
        first, last = min(_interval(e)[0] for e in acts), max(_interval(e)[1] for e in acts)
        pass1_end = max(_interval(e)[1] for e in plans)
        t = {"span": last - first, "pass1": pass1_end - first, "replay": last - pass1_end,
             "pass1_busy": _union([_interval(e) for e in compute if e["ts"] < pass1_end]),
             "replay_busy": _union([_interval(e) for e in compute if e["ts"] >= pass1_end]),
             "copy_busy": _union([_interval(e) for e in copies]), "copy_kernels": len(copies)}
        t["replay_wait"] = t["replay"] - t["replay_busy"]
        for e in compute:  # device time by kernel name in each pass
            key = f"{'pass1' if e['ts'] < pass1_end else 'replay'}:{kernel_name(e)}"
            t[key] = t.get(key, 0.0) + float(e.get("dur", 0.0))
        if copies:
            copies_end = max(_interval(e)[1] for e in copies)
            t.update(copies_end=copies_end - first, tail=last - copies_end)
        out.append(t)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="ds-v2-lite")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--coverage", type=float, default=0.5)
    parser.add_argument("--copies", default="kernel", help="config pass_pair_copies")
    parser.add_argument("--warm-steps", type=int, default=60)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--pack-dir", default="/tmp/rp-timeline")
    parser.add_argument("--hold-us", type=float, default=0.0, help="every other pair step: a device sleep first")
    parser.add_argument("--profile-steps", type=int, default=0, help="pair steps profiled after the timed ones")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--commit", default="")
    args = parser.parse_args()

    import torch
    if not torch.cuda.is_available():
        sys.exit("pair_clock.py needs CUDA")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from miss_step_timeline import _annotate
    from replay import skewed_steps

    from tierstore.geometry import get_preset
    from tierstore.runtime import RuntimeConfig, TieredRuntime
    from tierstore.runtime.replay import ensure_synthetic_pack, open_synthetic_rows, preload_arena
    from tierstore.runtime.replay_drive import Graphs, drive, forward_fn, step_inputs

    g = get_preset(args.preset).with_layers(args.layers)
    spec = ensure_synthetic_pack(g, args.pack_dir)
    steps = skewed_steps(g, args.warm_steps + args.steps + args.profile_steps)
    slots = round(args.coverage * g.total_routed_experts)
    config = RuntimeConfig(kpi_every=0, force_pool=True, pass_pair=True, pass_pair_choice="always",
                           pass_pair_copies=args.copies)
    rows = []
    with TieredRuntime(g, open_synthetic_rows(spec, args.pack_dir), pool_slots=slots,
                       arena_slots=int(4 * 2**30) // spec.stride, device="cuda", config=config, output_words=1) as rt:
        preload_arena(rt)
        drive(rt, steps[:args.warm_steps], warmup=10, graph=True, readback="folded", dtype=torch.bfloat16)
        graphs = Graphs(forward_fn(rt, *step_inputs(rt, torch.bfloat16), naive=False, publish=True), rt.device,
                        lambda f: rt.pass_pair(f, lambda: None))
        routes = [torch.as_tensor(r, dtype=torch.int64).cuda() for r in steps[args.warm_steps:]]
        graphs.capture(routes[0])
        marks: dict[str, float] = {}
        arm = rt._gather.arm_staged

        def marked_arm():
            marks["arm_start"] = time.perf_counter()
            arm()
            marks["arm_end"] = time.perf_counter()
        rt._gather.arm_staged = marked_arm
        # cycles of the device's sleep: its clock rate in kHz x the hold in ms
        hold_cycles = int(torch.cuda.clock_rate() * args.hold_us / 1e3) if args.hold_us else 0

        def pair_step(ids: torch.Tensor, held: bool) -> None:
            """One step with its pair timed (a row in `rows` when it launched one)."""
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            marks.clear()
            started = time.perf_counter()
            run, pair, _ = graphs.bind(ids)
            marks["bound"] = time.perf_counter()

            def timed_pair():
                marks["record"] = time.perf_counter()
                if held:
                    torch.cuda._sleep(hold_cycles)
                before.record()
                out = pair()
                after.record()
                marks["launched"] = time.perf_counter()
                return out
            _, outcome = rt.step(run, lambda: None, forward_pair=timed_pair)
            wall = time.perf_counter() - started
            if "launched" in marks:  # the step launched its pair
                device = before.elapsed_time(after) * 1e3  # us
                launch = (marks["launched"] - started) * 1e6
                rows.append({"held": held, "wall": wall * 1e6, "device": device, "launch": launch,
                             "after": wall * 1e6 - launch - device, "replays": outcome.replays,
                             **{k: (marks[k] - started) * 1e6 for k in ("bound", "arm_start", "arm_end", "record")}})

        for index, ids in enumerate(routes[:args.steps]):
            pair_step(ids, held=bool(hold_cycles) and index % 2 == 1)
        timelines, singles, gathered_mb = [], [], 0.0
        if args.profile_steps:
            timed_rows = len(rows)
            gathered = rt.stats().gathered_rows
            _annotate(rt)
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=activities) as prof:
                for ids in routes[args.steps:]:
                    pair_step(ids, held=False)
                for ids in routes[args.steps:args.steps + 8]:  # single passes of the same graphs' kind, for scale
                    run, *_ = graphs.bind(ids)
                    torch.cuda.synchronize()
                    with torch.profiler.record_function(SINGLE):
                        run()
                        torch.cuda.synchronize()
            del rows[timed_rows:]  # profiled: not timed
            gathered_mb = (rt.stats().gathered_rows - gathered) * spec.row_bytes / 1e6 / args.profile_steps
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / "trace.json"
                prof.export_chrome_trace(str(path))
                trace = json.loads(path.read_text())
            events = trace["traceEvents"] if isinstance(trace, dict) else trace
            timelines, singles = pair_timelines(events), single_pass_timelines(events)

        single_launch = []
        for _ in range(30):  # the single-pass graph's launch alone, the device idle before each
            run, *_ = graphs.bind(routes[-1])
            torch.cuda.synchronize()
            started = time.perf_counter()
            run()
            single_launch.append((time.perf_counter() - started) * 1e6)
            torch.cuda.synchronize()

    def medians(selected):
        return {k: statistics.median(r[k] for r in selected)
                for k in ("wall", "device", "launch", "after", "bound", "arm_start", "arm_end", "record")} \
            if selected else {}
    report = {"provenance": {"commit": args.commit, "torch": torch.__version__, "device": torch.cuda.get_device_name()},
              "preset": args.preset, "layers": args.layers, "coverage": args.coverage, "copies": args.copies,
              "hold_us": args.hold_us, "pair_steps": len(rows), "median": medians([r for r in rows if not r["held"]]),
              "median_one_replay": medians([r for r in rows if r["replays"] == 1 and not r["held"]]),
              "median_held": medians([r for r in rows if r["held"]]),
              "single_launch_us": statistics.median(single_launch), "steps": rows,
              "profiled": {"steps": len(timelines), "gathered_mb_per_step": gathered_mb,
                           "median_us": _timeline_medians(timelines), "timelines": timelines,
                           "single_pass_median_us": _timeline_medians(singles), "single_passes": singles}}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(f"{args.preset} {args.layers} layers, coverage {args.coverage}, copies {args.copies}: {len(rows)} pair steps")
    for name in ("median", "median_one_replay", "median_held"):
        if report[name]:
            print(f"  {name} (us): " + ", ".join(f"{k} {v:.1f}" for k, v in report[name].items()))
    pair_launch = statistics.median(r["launch"] - r["record"] for r in rows) if rows else 0.0
    print(f"  launch (us, host): pair graph {pair_launch:.1f} (median), single-pass graph alone "
          f"{report['single_launch_us']:.1f}")
    profiled = report["profiled"]
    if timelines:
        busy = profiled["median_us"].get("copy_busy", 0.0)
        print(f"  profiled, {len(timelines)} pair steps, medians (us): " + ", ".join(
            f"{k} {v:.1f}" for k, v in profiled["median_us"].items()) + f"; rows {gathered_mb:.2f} MB per step "
            f"({gathered_mb * 1e3 / busy if busy else 0.0:.1f} GB/s over copy_busy)")
        single = profiled["single_pass_median_us"]
        if single:
            print(f"  profiled single passes ({len(singles)}), medians (us): span {single['span']:.1f}, busy "
                  f"{single['busy']:.1f}")
        by_name = {k: v for k, v in {**profiled["median_us"], **single}.items() if ":" in k}
        for key in sorted(by_name, key=lambda k: (k.split(":")[1], k)):
            print(f"    {key}: {by_name[key]:.1f} us")


if __name__ == "__main__":
    main()
