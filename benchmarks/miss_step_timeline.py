"""Where a tiered step's wall time goes on the device: torch.profiler (CUPTI) around warm steps of the replay
benchmark's setup (synthetic skewed trace, preloaded 4 GiB arena, bf16, CUDA graphs, pass-log readback folded), then
each step cut into its phases from the device's own timestamps:

    launch     step start (host) -> the first device activity of the step
    pass1      the first forward on the device (first activity -> last activity before the first pass-log read ends)
    to_copy    pass1's end -> the first row copy (host: read, parse, victims, arena lookups, install up to the copy)
    copies     first row copy -> last row copy (span), `copy_busy` the time some row copy ran, GB/s over the span
    replay     pass1's end -> the replay's first kernel; `tail`: last row copy -> the replay's last activity
    end        the step's last device activity -> step end (host: sync wake-up, parse, bookkeeping)
    gpu_idle   wall minus the union of the step's device activities

With `--gather-in-pass` (config gather_in_pass: the pass fetches for itself) a step that gathered has one pass and
no row copies; the profiler clock adds `gather_kernels` / `plan_kernels` (device time of the pass's row-copy and
plan kernels) and the report the rows' MB per step (`gathered_mb_per_step`), so their rate is MB / gather_kernels.

Medians over the profiled steps that replayed (and, separately, those that did not). A diagnostic, not a timing:
the profiler adds host time per launch and per copy (it doubles the step here).

A second clock needs no profiler (`EventClock`, run first): CUDA events recorded by the benchmark around each
pass's graph launch, the install's own start / end events on the copy stream (`DevicePool`'s marks), and host
timestamps of the pass-log reads, their synchronize, the first row copy issued and the fetch path's entries. Device
times run from the first pass's start event, host marks from the moment the host recorded it (`prologue`: the step's
host time before that), taken as the same instant: the device is idle when a step starts, so the event lands a few
microseconds after the host records it. (The runs of h200_session.sh timeline2 to timeline4 and hostcut took host
marks from the step's start, so their host marks and `end` carry the prologue.)

With `--recorded TRACE.npz` the steps come from a recorded trace (`runtime.replay.map_trace`, layers by
`--trace-layers`, the trace's top-k) instead of the skewed one: there most steps miss nothing, and the no-miss rows
are where a pool that can miss spends more than a full one. `--full-pool-reads` (config full_pool_reads) makes a
full pool read every pass, so coverage 1 gives the same clock on a pool that cannot miss.

    python3 benchmarks/miss_step_timeline.py --preset ds-v2-lite --layers 8 --coverage 0.5 --json out.json
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROW_COPY_MIN_BYTES = 64 * 1024  # HtoD copies at least this large are expert rows (slot tables are smaller)
STEP, READ, FETCH = "tierstore.step", "tierstore.read_pass", "tierstore.fetch"
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _interval(event: dict) -> tuple[float, float]:
    return float(event["ts"]), float(event["ts"]) + float(event.get("dur", 0.0))


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _is_row_copy(event: dict) -> bool:
    """Kineto names a host-to-device copy "Memcpy HtoD (Pinned -> Device)"; its size is args["bytes"]."""
    return (event["cat"] == "gpu_memcpy" and "HtoD" in event.get("name", "")
            and int(event.get("args", {}).get("bytes", 0)) >= ROW_COPY_MIN_BYTES)


def step_timelines(events: list[dict]) -> list[dict]:
    """One dict of phase times (microseconds) per `tierstore.step` range of a Chrome trace's events.
    A device activity belongs to the step whose host range holds its start (a step ends with a sync, so none of
    its work runs past it); it belongs to pass i when it starts before the i-th pass-log read of the step ends."""
    host = [e for e in events if e.get("cat") == "user_annotation" and e.get("ph") == "X"]
    device = sorted((e for e in events if e.get("cat") in DEVICE_CATS and e.get("ph") == "X"), key=lambda e: e["ts"])
    steps = sorted((_interval(e) for e in host if e["name"] == STEP))
    reads = sorted(_interval(e) for e in host if e["name"] == READ)
    out = []
    for s0, s1 in steps:
        acts = [e for e in device if s0 <= e["ts"] <= s1]
        step_reads = [r for r in reads if s0 <= r[0] and r[1] <= s1]
        if not acts or not step_reads:
            continue
        first_read_end = step_reads[0][1]
        pass1 = [e for e in acts if e["ts"] < first_read_end]
        later = [e for e in acts if e["ts"] >= first_read_end]
        rows = [e for e in later if _is_row_copy(e)]
        replay = [e for e in later if e["cat"] == "kernel"]
        busy = _union([_interval(e) for e in acts])
        pass1_start = min(_interval(e)[0] for e in pass1) if pass1 else None
        pass1_end = max(_interval(e)[1] for e in pass1) if pass1 else None
        last_end = max(_interval(e)[1] for e in acts)
        t = dict(wall=s1 - s0, launch=float(acts[0]["ts"]) - s0, end=s1 - last_end, gpu_idle=(s1 - s0) - busy,
                 passes=len(step_reads), replayed=len(step_reads) > 1)
        if pass1_start is not None:
            t["pass1"] = pass1_end - pass1_start
            t["read1_after_pass1"] = first_read_end - pass1_end
        if rows and pass1_end is not None:
            c0 = min(_interval(e)[0] for e in rows)
            c1 = max(_interval(e)[1] for e in rows)
            nbytes = sum(int(e["args"]["bytes"]) for e in rows)
            t.update(to_copy=c0 - pass1_end, copies=c1 - c0, copy_busy=_union([_interval(e) for e in rows]),
                     row_copies=len(rows), copy_mb=nbytes / 1e6, copy_gbps=nbytes / (c1 - c0) / 1e3 if c1 > c0 else 0.0)
            if replay:
                t["tail"] = max(_interval(e)[1] for e in replay) - c1
        if replay and pass1_end is not None:
            t["replay_start"] = min(_interval(e)[0] for e in replay) - pass1_end
            t["replay_kernels"] = sum(_interval(e)[1] - _interval(e)[0] for e in replay)
        if pass1:
            t["pass1_kernels"] = sum(_interval(e)[1] - _interval(e)[0] for e in pass1 if e["cat"] == "kernel")
        for field, name in (("gather_kernels", "gather_pass_rows"), ("plan_kernels", "plan_pass_gather")):
            named = [e for e in acts if e["cat"] == "kernel" and name in e.get("name", "")]
            if named:
                t[field] = sum(_interval(e)[1] - _interval(e)[0] for e in named)
        out.append(t)
    return out


def medians(timelines: list[dict]) -> dict:
    """Per field, the median over the steps that have it, and how many steps had it."""
    fields = sorted({k for t in timelines for k, v in t.items() if isinstance(v, float | int) and not isinstance(v, bool)})
    return {k: {"median_us": statistics.median(t[k] for t in timelines if k in t),
                "steps": sum(1 for t in timelines if k in t)} for k in fields}


def summarize(timelines: list[dict]) -> dict:
    replayed = [t for t in timelines if t["replayed"]]
    clean = [t for t in timelines if not t["replayed"]]
    return {"steps": len(timelines), "replayed_steps": len(replayed),
            "replayed": medians(replayed) if replayed else {}, "no_miss": medians(clean) if clean else {}}


class EventClock:
    """Wraps a runtime's step, reads, fetches and installs to time each step's phases with CUDA events (see the
    module doc). `timelines` gets one dict per step, in microseconds."""

    def __init__(self, runtime):
        import torch
        self.torch, self.runtime, self.timelines = torch, runtime, []
        self._step, self._read, self._fetch = runtime.step, runtime._read_pass, runtime._fetch_for_step
        self._take_buffers, self._sync = runtime.pool._take_install_buffers, torch.cuda.Stream.synchronize
        runtime.step, runtime._read_pass, runtime._fetch_for_step = self.step, self.read, self.fetch
        runtime.pool._take_install_buffers = self.take_buffers  # wrapped again by its entry mark below
        # a host mark as each of these is entered: the pass log's read, the first row copy, the fetch path
        self._entry_marks = [(runtime.log, "read", "log_read_start"), (runtime.pool, "_issue", "row_copy_issue")]
        self._entry_marks += [(owner, name, f"enter_{name.strip('_')}") for owner, name in (
            (runtime.pool, "missing"), (runtime, "_victims"), (runtime.arena, "fetch"), (runtime.pool, "install"),
            (runtime.pool, "_take_install_buffers"), (runtime.pool, "_copy_by_layer"), (runtime.pool, "_map"),
            (runtime.pool, "plan_victims"), (runtime, "_fetch_located"), (runtime.arena, "locate"),
            (runtime.pool, "planned_victims"), (runtime.pool, "install_located"), (runtime.pool, "_issue_by_layer"))]
        for owner, name, mark in self._entry_marks:
            setattr(owner, name, self._marked(mark, getattr(owner, name)))

        def synchronize(stream):  # a plain function: the class attribute binds the stream as its argument
            self._sync(stream)
            self._mark("synced")
        torch.cuda.Stream.synchronize = synchronize
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(16)]  # made once, recorded per pass

    def _marked(self, mark: str, fn):
        def run(*args, **kwargs):
            self._mark(mark)
            return fn(*args, **kwargs)
        return run

    def detach(self) -> None:
        for owner, name, _ in self._entry_marks:
            delattr(owner, name)
        runtime = self.runtime
        del runtime.step, runtime._read_pass, runtime._fetch_for_step  # (_take_install_buffers: an entry mark)
        self.torch.cuda.Stream.synchronize = self._sync

    def step(self, forward, rewind, **kwargs):
        self._t0, self._passes, self._copies, self._host = time.perf_counter(), [], [], {}

        def timed(launch):
            def run():
                before, after = self._events[2 * len(self._passes)], self._events[2 * len(self._passes) + 1]
                launched = self._since()
                before.record()
                result = launch()
                after.record()
                self._passes.append((before, after, launched))
                return result
            return run
        # a step's first launch may be its first pass (unwaited_first_pass) or a pair: timed like any pass
        kwargs = {name: timed(launch) if name in ("forward_first", "forward_pair") and launch is not None else launch
                  for name, launch in kwargs.items()}
        out = self._step(timed(forward), rewind, **kwargs)
        wall = self._since()
        self.torch.cuda.synchronize()
        self.timelines.append(self._timeline(wall))
        return out

    def _since(self) -> float:
        return (time.perf_counter() - self._t0) * 1e6

    def _mark(self, name: str) -> None:
        if hasattr(self, "_host"):
            self._host.setdefault(name, []).append(self._since())

    def read(self):
        report = self._read()
        self._mark("read_done")
        return report

    def fetch(self, *args, **kwargs):
        self._mark("fetch_start")
        try:
            return self._fetch(*args, **kwargs)
        finally:
            self._mark("fetch_done")

    def take_buffers(self):
        """An install's staging set, whose start / end events it records around its copies (both install paths)."""
        buffers = self._take_buffers()
        if buffers.marks is not None:
            self._copies.append(tuple(buffers.marks))  # read at the step's end, before the next install reuses them
        return buffers

    def _timeline(self, wall: float) -> dict:
        origin = self._passes[0][0]

        def at(event) -> float:
            return origin.elapsed_time(event) * 1e3

        passes = [(at(b), at(a), launched) for b, a, launched in self._passes]
        host = self._host
        lead = passes[0][2]  # host us from the step's start to the first launch, where the device origin is recorded
        t = dict(wall=wall, prologue=lead, passes=len(passes), replayed=len(passes) > 1, pass1=passes[0][1],
                 end=wall - lead - passes[-1][1])
        # host marks against the device's pass ends, both from the first launch: negative = the host got there first
        for name, mark, which in (("read1_start", "log_read_start", 0), ("read1_synced", "synced", 0),
                                  ("read1_done", "read_done", 0), ("first_copy_issue", "row_copy_issue", 0),
                                  ("last_synced", "synced", -1), ("last_read_done", "read_done", -1)):
            if mark in host:
                t[name] = host[mark][which] - lead - passes[which][1]
        for name, marks in host.items():  # the fetch path's entry marks, the first of each in the step
            if name.startswith("enter_"):
                t[name] = marks[0] - lead - passes[0][1]
        if self._copies:
            c0, c1 = at(self._copies[0][0]), at(self._copies[-1][1])
            t.update(to_copy=c0 - passes[0][1], copies=c1 - c0, installs=len(self._copies))
            if len(passes) > 1:
                t["tail"] = passes[-1][1] - c1
        if len(passes) > 1:
            t.update(replay_launch=passes[1][2] - lead - passes[0][1], replay_pass=passes[1][1] - passes[1][0],
                     fetch_host=self._host["fetch_done"][0] - self._host["fetch_start"][0],
                     read_to_fetch_done=self._host["fetch_done"][0] - self._host["read_done"][0])
        return t


def _annotate(runtime) -> None:
    """Mark the step, each pass-log read and each fetch as host ranges (instance attributes: `step` looks them up
    on every call)."""
    import torch

    def ranged(name, fn):
        def run(*args, **kwargs):
            with torch.profiler.record_function(name):
                return fn(*args, **kwargs)
        return run
    runtime.step = ranged(STEP, runtime.step)
    runtime._read_pass = ranged(READ, runtime._read_pass)
    runtime._fetch_for_step = ranged(FETCH, runtime._fetch_for_step)


def _profiled(runtime, steps, drive) -> tuple[list[dict], float]:
    """The steps under torch.profiler, host ranges marked: (the Chrome trace's events, ms per step)."""
    import torch
    _annotate(runtime)
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        started = time.perf_counter()
        drive(runtime, steps, warmup=0, graph=True, readback="folded", dtype=torch.bfloat16)
        profiled_ms = (time.perf_counter() - started) * 1e3 / len(steps)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return (trace["traceEvents"] if isinstance(trace, dict) else trace), profiled_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="ds-v2-lite")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--coverage", type=float, default=0.5, help="pool slots over the routed experts")
    parser.add_argument("--warm-steps", type=int, default=60)
    parser.add_argument("--steps", type=int, default=40, help="steps timed by each clock (events, then profiler)")
    parser.add_argument("--pack-dir", default="/tmp/rp-timeline")
    parser.add_argument("--trace", type=Path, help="also write the profiler's Chrome trace here (.json.gz)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--no-profiler", action="store_true", help="the event clock only")
    parser.add_argument("--gather-in-pass", action="store_true", help="config gather_in_pass (the pass's own fetch)")
    parser.add_argument("--recorded", type=Path, help="a recorded trace (.npz) instead of the skewed one")
    parser.add_argument("--trace-layers", default="first", help="layer mapping of --recorded: first or tile")
    parser.add_argument("--full-pool-reads", action="store_true", help="config full_pool_reads (a full pool reads)")
    parser.add_argument("--commit", default="")
    args = parser.parse_args()

    import torch
    if not torch.cuda.is_available():
        sys.exit("miss_step_timeline.py needs CUDA")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from replay import diagnostic_steps

    from tierstore.geometry import get_preset
    from tierstore.runtime import RuntimeConfig, TieredRuntime
    from tierstore.runtime.replay import ensure_synthetic_pack, open_synthetic_rows, preload_arena
    from tierstore.runtime.replay_drive import drive

    wanted = args.warm_steps + 2 * args.steps
    g, steps = diagnostic_steps(get_preset(args.preset).with_layers(args.layers), wanted, args.recorded,
                                args.trace_layers)
    spec = ensure_synthetic_pack(g, args.pack_dir)
    warm, timed, profiled = steps[:args.warm_steps], steps[args.warm_steps:-args.steps], steps[-args.steps:]
    slots = round(args.coverage * g.total_routed_experts)
    with TieredRuntime(g, open_synthetic_rows(spec, args.pack_dir), pool_slots=slots,
                       arena_slots=int(4 * 2**30) // spec.stride, device="cuda",
                       config=RuntimeConfig(kpi_every=0, force_pool=True, gather_in_pass=args.gather_in_pass,
                                            pass_pair=False,  # the single pass's miss step (pairs: pair_clock.py)
                                            full_pool_reads=args.full_pool_reads),
                       output_words=1) as rt:
        preload_arena(rt)
        if args.coverage >= 1.0:
            rt.preload()
        unprofiled = drive(rt, warm, warmup=10, graph=True, readback="folded",
                           dtype=torch.bfloat16)["steady"].as_dict()["step_ms"]
        clock = EventClock(rt)
        drive(rt, timed, warmup=0, graph=True, readback="folded", dtype=torch.bfloat16)
        event_steps = clock.timelines
        clock.detach()
        gathered_before = rt.stats().gathered_rows
        events, profiled_ms = ([], None) if args.no_profiler else _profiled(rt, profiled, drive)
        gathered_mb = (rt.stats().gathered_rows - gathered_before) * spec.row_bytes / 1e6 / len(profiled)
    if args.trace and events:
        with gzip.open(args.trace, "wt") as f:
            json.dump(events, f)
    timelines = step_timelines(events)
    report = {"provenance": {"commit": args.commit, "torch": torch.__version__, "device": torch.cuda.get_device_name()},
              "preset": args.preset, "layers": args.layers, "coverage": args.coverage, "pool_slots": slots,
              "gather_in_pass": args.gather_in_pass, "gathered_mb_per_step": gathered_mb,
              "recorded": str(args.recorded) if args.recorded else None, "trace_layers": args.trace_layers,
              "full_pool_reads": args.full_pool_reads,
              "unprofiled_step_ms": unprofiled, "profiled_step_ms": profiled_ms,
              "events": {"summary": summarize(event_steps), "timelines": event_steps},
              "summary": summarize(timelines), "timelines": timelines}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    profiled_note = f"{profiled_ms:.3f} ms profiled" if profiled_ms is not None else "not profiled"
    print(f"{args.preset} {args.layers} layers, coverage {args.coverage}: step {unprofiled:.3f} ms unprofiled, "
          f"{profiled_note}; {len(timelines)} steps read from the trace")
    for clock_name, summary in (("events", report["events"]["summary"]), ("profiler", report["summary"])):
        for kind in ("replayed", "no_miss"):
            fields = summary[kind]
            if fields:
                print(f"  {clock_name}, {kind} ({fields['wall']['steps']} steps), medians in us:")
                print("    " + ", ".join(f"{k} {v['median_us']:.1f}" for k, v in fields.items()))


if __name__ == "__main__":
    main()
