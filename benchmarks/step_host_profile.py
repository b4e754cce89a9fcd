"""Where a tiered step's host time goes, function by function, on the replay benchmark's setup (a recorded or the
skewed trace, preloaded 4 GiB arena or `--arena-gb` (0: none, every miss read from the pack), bf16, CUDA graphs, token
folded into the pass log, the default config).

Two clocks over warm steps:

- `wrapped`: perf_counter around each of a fixed list of the step protocol's functions (`WRAPPED`), summed per step;
  steps are split into kinds by what they did (`quiet`: read nothing but its own pass; `install`: installed rows a
  pass streamed; `stream`: its pass streamed rows; `fetch`: fetched and replayed). Medians per kind, microseconds,
  and how many calls a step made. The wrappers nest (a callee's time is inside its caller's).
- `cprofile`: as many steps again, each under its own cProfile profile, merged by kind: the top functions by their
  own time (per step, microseconds; cProfile roughly doubles a Python-heavy path, so read it as shares).

A diagnostic, not a timing: compare a function's time with the pass's device time (the host work before the
pass-log read is hidden while it is shorter than the pass) and with what the step does after the read's sync (all
of that is on the step's path).

    python3 benchmarks/step_host_profile.py --preset ds-v2-lite --layers 8 --coverage 0.5 \
        --recorded benchmarks/traces/generate-quality-checkpoint.npz --json out.json
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

# (owner attribute path from the runtime, function name); "" is the runtime itself
WRAPPED = (("", "step"), ("", "_read_pass"), ("", "_follow_streamed"), ("", "_defer_streamed"), ("", "settle"),
           ("", "_fetch_for_step"), ("", "_log_kpi"), ("log", "read"), ("pool", "plan_victims"),
           ("pool", "install_located"), ("pool", "before_unwaited_launch"), ("pool", "collect"),
           ("pool", "unmapped_ids"), ("arena", "locate"), ("arena", "hit_ids"), ("_stream_heat", "observe"),
           ("_stream_heat", "admit"), ("_stream_rows", "refresh"), ("_stats", "add_step"), ("_stats", "add_fetch"),
           ("pool", "_take_install_buffers"), ("pool", "_issue_streamed"), ("pool", "_stage_table"),
           ("pool", "_copy_table"), ("pool", "_issue"), ("pool", "_map"), ("arena", "fetch"),
           ("arena.source", "read_rows"), ("arena.source.reader", "read"), ("pool", "wait"), ("pool", "install"))


class HostClock:
    """Instance-attribute wrappers that add each call's time to the current step's totals."""

    def __init__(self, runtime):
        self.steps: list[dict] = []
        self._current: dict = {}
        self._wrapped = []
        for owner_name, name in WRAPPED:
            owner = runtime
            for part in owner_name.split(".") if owner_name else ():
                owner = getattr(owner, part, None)
            if owner is None or not hasattr(owner, name):
                continue
            label = f"{owner_name or 'runtime'}.{name}"
            setattr(owner, name, self._timed(label, getattr(owner, name)))
            self._wrapped.append((owner, name))

    def _timed(self, label: str, fn):
        def run(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent = (time.perf_counter() - started) * 1e6
                totals = self._current
                us, calls = totals.get(label, (0.0, 0))
                totals[label] = (us + spent, calls + 1)
        return run

    def end_step(self, kind: str) -> None:
        self.steps.append({"kind": kind, **{k: v for k, v in self._current.items()}})
        self._current = {}

    def detach(self) -> None:
        for owner, name in self._wrapped:
            delattr(owner, name)


def step_kind(before, after) -> str:
    """What a step did, from `TieredRuntime.stats()` before and after it."""
    if after.replayed_steps > before.replayed_steps:
        return "fetch"
    if after.streamed_installs > before.streamed_installs:
        return "install"
    if after.streamed_steps > before.streamed_steps:
        return "stream"
    return "quiet"


def summarize(steps: list[dict]) -> dict:
    out = {}
    for kind in sorted({s["kind"] for s in steps}):
        group = [s for s in steps if s["kind"] == kind]
        labels = sorted({k for s in group for k in s if k != "kind"})
        out[kind] = {"steps": len(group), **{label: {
            "median_us": statistics.median(s[label][0] if label in s else 0.0 for s in group),
            "calls_per_step": sum(s[label][1] for s in group if label in s) / len(group)} for label in labels}}
    return out


def _top_functions(profiles: list[cProfile.Profile], count: int = 40) -> dict:
    """The functions of merged per-step profiles by their own time: per step, microseconds."""
    stats = pstats.Stats(profiles[0])
    for profile in profiles[1:]:
        stats.add(profile)
    steps = len(profiles)
    rows = sorted(((fn, own, total, calls) for fn, (calls, _, own, total, _) in stats.stats.items()),
                  key=lambda r: -r[1])[:count]
    return {"steps": steps, "functions": [
        {"function": f"{Path(fn[0]).name}:{fn[1]} {fn[2]}", "own_us_per_step": own * 1e6 / steps,
         "total_us_per_step": total * 1e6 / steps, "calls_per_step": calls / steps} for fn, own, total, calls in rows]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="ds-v2-lite")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--coverage", type=float, default=0.5)
    parser.add_argument("--warm-steps", type=int, default=40)
    parser.add_argument("--steps", type=int, default=100, help="steps timed by each clock")
    parser.add_argument("--pack-dir", default="/tmp/rp-host")
    parser.add_argument("--recorded", type=Path, help="a recorded trace (.npz) instead of the skewed one")
    parser.add_argument("--arena-gb", type=float, default=4.0, help="the arena, preloaded (0: none)")
    parser.add_argument("--trace-layers", default="first")
    parser.add_argument("--config", action="append", default=[], metavar="KEY=VALUE", help="a RuntimeConfig field")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (eager, float32: the logic, slowly)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--commit", default="")
    args = parser.parse_args()

    import torch
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("step_host_profile.py --device cuda needs CUDA")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from replay import _config_fields, diagnostic_steps

    from tierstore.geometry import get_preset
    from tierstore.runtime import RuntimeConfig, TieredRuntime
    from tierstore.runtime.replay import ensure_synthetic_pack, open_synthetic_rows, preload_arena
    from tierstore.runtime.replay_drive import Driver

    wanted = args.warm_steps + 2 * args.steps
    g, steps = diagnostic_steps(get_preset(args.preset).with_layers(args.layers), wanted, args.recorded,
                                args.trace_layers)
    spec = ensure_synthetic_pack(g, args.pack_dir)
    slots = round(args.coverage * g.total_routed_experts)
    config = RuntimeConfig(kpi_every=0, force_pool=True, **(_config_fields(args.config, "--config") or {}))
    with TieredRuntime(g, open_synthetic_rows(spec, args.pack_dir), pool_slots=slots,
                       arena_slots=int(args.arena_gb * 2**30) // spec.stride, device=args.device, config=config,
                       output_words=1) as rt:
        if args.arena_gb:
            preload_arena(rt)
        if args.coverage >= 1.0:
            rt.preload()
        driver = Driver(rt, steps, warmup=args.warm_steps, graph=cuda, readback="folded",
                        dtype=torch.bfloat16 if cuda else torch.float32)
        for i in range(args.warm_steps):
            driver.step(i)
        clock = HostClock(rt)
        for i in range(args.warm_steps, args.warm_steps + args.steps):
            before = rt.stats()
            driver.step(i)
            clock.end_step(step_kind(before, rt.stats()))
        clock.detach()
        wrapped = summarize(clock.steps)
        step_ms = statistics.median(driver.times[args.warm_steps:]) * 1e3
        by_kind: dict[str, list[cProfile.Profile]] = {}
        for i in range(args.warm_steps + args.steps, wanted):  # one profile per step, merged by the step's kind
            before = rt.stats()
            profile = cProfile.Profile()
            profile.enable()
            driver.step(i)
            profile.disable()
            by_kind.setdefault(step_kind(before, rt.stats()), []).append(profile)
    profiled = {kind: _top_functions(profiles) for kind, profiles in sorted(by_kind.items())}
    report = {"provenance": {"commit": args.commit, "torch": torch.__version__, "device": torch.cuda.get_device_name() if cuda else "cpu"},
              "preset": args.preset, "layers": args.layers, "coverage": args.coverage, "pool_slots": slots,
              "recorded": str(args.recorded) if args.recorded else None, "arena_gb": args.arena_gb, "config": args.config,
              "streams": rt._stream_rows is not None,
              "median_step_ms": step_ms, "wrapped": wrapped, "cprofile": profiled}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(f"{args.preset} {args.layers} layers, coverage {args.coverage}: median step {step_ms:.3f} ms "
          f"({args.steps} steps per clock)")
    for kind, fields in wrapped.items():
        print(f"  wrapped, {kind} ({fields['steps']} steps): median us (calls / step)")
        for label, v in fields.items():
            if label != "steps":
                print(f"    {label:34s} {v['median_us']:8.1f}  ({v['calls_per_step']:.2f})")
    for kind, top in profiled.items():
        print(f"  cprofile, {kind} ({top['steps']} steps): own / total us per step, calls per step, top 30:")
        for row in top["functions"][:30]:
            print(f"    {row['own_us_per_step']:8.1f} {row['total_us_per_step']:8.1f} {row['calls_per_step']:6.2f}  "
                  f"{row['function']}")


if __name__ == "__main__":
    main()
