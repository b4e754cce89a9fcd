"""Tiered decode benchmark (issue 5, section 4): `tierstore replay` at ds-v2-lite and qwen3-30b-a3b
shapes, GPU pool at 10/25/50/100% coverage, with and without an arena, on a synthetic skewed trace
(and any traces given with --trace, e.g. one recorded by `tierstore generate --record-trace` or the quality
lab; mapped onto the preset by `runtime.replay.map_trace`, the mapping in each result's `trace_mapping`,
a mismatch it cannot map refused before anything runs; --no-synthetic: the traces only). The first
`--warmup` steps of every run are its cold window, timed apart; targets are judged on the steady
window. Writes benchmarks/results/replay.json with provenance.

    python benchmarks/replay.py --pack-dir /path/on/the/disk [--layers 8] [--steps 200] [--warmup 40]
        [--presets ds-v2-lite] [--coverages 0.25,1] [--arena-gb 0,4] [--arena-preload] [--trace extra.npz ...]
        [--trace-layers first|tile] [--trace-top-k trace|refuse] [--no-synthetic]
        [--commit HASH]

Every configuration also times the all-resident run with the decoder's token readback
(`resident_readback`), folds the tiered run's token into its pass-log read, keeps per-step counters
(replays, arena hit / miss rows, fetch ms split into arena, pool install and copy wait, the copies'
device time, the pass-log reads; `breakdown` per window, with the medians of the steps that fetched),
and at 100% coverage times the no-miss variants interleaved on one runtime (`nomiss_overhead`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np
import torch

from tierstore.errors import ConfigError, TraceFormatError
from tierstore.geometry import get_preset
from tierstore.runtime.config import RuntimeConfig
from tierstore.runtime.replay import (LAYER_MAPPINGS, TOP_K_MAPPINGS, ensure_synthetic_pack, map_trace,
                                      open_synthetic_rows, run_replay, trace_steps)
from tierstore.sim import load_trace

PRESETS = "ds-v2-lite,qwen3-30b-a3b"
COVERAGES = "0.10,0.25,0.50,1.00"
ARENA_GB = "0,4"


def skewed_steps(geometry, steps: int, seed: int = 0, alpha: float = 1.1) -> list[np.ndarray]:
    """Zipf-like routing per layer with a per-layer random expert order, one token per step."""
    rng = np.random.default_rng(seed)
    probs = 1.0 / np.arange(1, geometry.num_experts + 1) ** alpha
    probs /= probs.sum()
    orders = [rng.permutation(geometry.num_experts) for _ in range(geometry.num_moe_layers)]
    out = []
    for _ in range(steps):
        ids = [orders[l][rng.choice(geometry.num_experts, geometry.top_k, replace=False, p=probs)]
               for l in range(geometry.num_moe_layers)]
        out.append(np.asarray(ids, np.int64)[None])  # [1, L, k]
    return out


def diagnostic_steps(geometry, wanted: int, recorded: Path | None, trace_layers: str = "first"):
    """(geometry, the first `wanted` steps) for a diagnostic run: a recorded trace's (`map_trace`, layers by
    `trace_layers`, the trace's top-k, so the geometry may change) or the skewed trace's; exits when the recorded
    trace is shorter."""
    if recorded is None:
        return geometry, skewed_steps(geometry, wanted)
    trace = load_trace(recorded)
    geometry, ids, _ = map_trace(trace, geometry, layers=trace_layers)
    steps = trace_steps(ids, trace.step, geometry.num_moe_layers, None)
    if len(steps) < wanted:
        sys.exit(f"{recorded} has {len(steps)} steps; the run needs {wanted}")
    return geometry, steps[:wanted]


def provenance(commit: str | None = None) -> dict:
    """Where and with what this ran; `commit` names the tree when it ran outside a git checkout."""
    if commit is None:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    info = {"commit": commit, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "torch": torch.__version__, "host": platform.node()}
    if torch.cuda.is_available():
        import triton

        info.update(gpu=torch.cuda.get_device_name(), triton=triton.__version__)
    return info


def floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def _config_fields(items: list[str], option: str, environ: dict | None = None) -> dict | None:
    """FIELD=VALUE items of `option` as runtime config fields (values parsed as the environment's TIERSTORE_<FIELD>
    would be), or None when there are none."""
    environ = dict(environ or {})
    for item in items:
        field, sep, value = item.partition("=")
        if not sep or not field:
            raise SystemExit(f"{option} takes FIELD=VALUE, got {item!r}")
        environ["TIERSTORE_" + field.upper()] = value
    if not environ:
        return None
    try:
        changed = RuntimeConfig.from_env(environ)
    except ConfigError as error:
        raise SystemExit(f"{option}: {error}") from None
    names = {key.removeprefix("TIERSTORE_").lower() for key in environ}
    unknown = names - {f.name for f in fields(RuntimeConfig)}
    if unknown:
        raise SystemExit(f"{option}: no runtime config field {', '.join(sorted(unknown))}")
    return {name: getattr(changed, name) for name in sorted(names)}


def _compare_config(args) -> dict | None:
    """--compare-layer-waits / --compare-config FIELD=VALUE as config overrides, or None."""
    return _config_fields(args.compare_config, "--compare-config",
                          {"TIERSTORE_LAYER_WAITS": "0"} if args.compare_layer_waits else None)


def _base_config(args) -> RuntimeConfig:
    """The runtime config of every run: the benchmark's (no KPI lines, forced pool sizes) with --config's fields."""
    return RuntimeConfig(kpi_every=0, force_pool=True, **(_config_fields(args.config, "--config") or {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pack-dir", required=True)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=200, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=40, help="cold window: the first N steps of every run")
    parser.add_argument("--presets", default=PRESETS)
    parser.add_argument("--coverages", default=COVERAGES)
    parser.add_argument("--arena-gb", default=ARENA_GB)
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs of the forward")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="activation dtype (a decoder's: bfloat16; earlier runs: float32)")
    parser.add_argument("--arena-preload", action="store_true",
                        help="fill the tiered and naive arenas before the clock starts (no compulsory pack reads)")
    parser.add_argument("--trace", action="append", default=[], help="a recorded trace to replay too (repeatable)")
    parser.add_argument("--trace-layers", choices=LAYER_MAPPINGS, default="first",
                        help="run layer l replays trace layer l (first: the trace needs --layers layers) or "
                             "l %% trace layers (tile)")
    parser.add_argument("--trace-top-k", choices=TOP_K_MAPPINGS, default="trace",
                        help="a trace top-k below the preset's: the preset's shapes at the trace's top-k (trace) "
                             "or refuse; a larger one is always refused")
    parser.add_argument("--no-synthetic", action="store_true", help="replay the --trace files only")
    parser.add_argument("--compare-layer-waits", action="store_true",
                        help="also run the tiered steps with config layer_waits off (whole-fetch waits), side by side")
    parser.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE",
                        help="runtime config field of every run, resident and naive included (repeatable; e.g. "
                             "cuda_w2=0: the Triton kernels only; the default, auto, runs the CUDA C++ ones where "
                             "usable: Hopper, nvcc, bfloat16)")
    parser.add_argument("--compare-config", action="append", default=[], metavar="FIELD=VALUE",
                        help="also run the tiered steps with this runtime config field changed (repeatable; "
                             "e.g. copy_streams=2), side by side")
    parser.add_argument("--compare-first", action="store_true",
                        help="run the compared config before the default one (by default it runs last; alternate "
                             "the order between calls: the later run of a process was often the faster on the H200)")
    parser.add_argument("--interleave", action="store_true",
                        help="the resident runs, the tiered one and the compared one (--compare-config) open together, "
                             "taking turns step by step (the host's drift falls on all alike, the floor's resident "
                             "step included; every pool and arena at once); the naive run stays separate")
    parser.add_argument("--commit", help="commit of the tree (when it runs without .git)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "replay.json"))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    results: list[dict] = []
    head = {"provenance": provenance(args.commit), "method": {
        "steps": args.steps, "warmup": args.warmup, "layers": args.layers, "graph": not args.eager, "dtype": args.dtype,
        "arena_preload": args.arena_preload, "compare_layer_waits": args.compare_layer_waits,
        "config": args.config, "compare_config": args.compare_config, "compare_first": args.compare_first,
        "interleave": args.interleave, "traces": args.trace, "trace_layers": args.trace_layers,
        "trace_top_k": args.trace_top_k, "synthetic": not args.no_synthetic,
        "floor": "plain all-resident steady step + steady pinned bytes (arena hits less streamed installs, plus "
                 "streamed rows) / pinned H2D + arena-miss bytes / source read (the faster of the best of 4 warm "
                 "64-row probe batches and the tiered run's own steady reads); floor_batched: the same with each "
                 "step's arena-miss rows charged at the best of 3 probe batches of that many rows (1 / 2 / 4 / ... 64, "
                 "linear between)"}}
    compare = _compare_config(args)
    config = _base_config(args)
    if args.no_synthetic and not args.trace:
        parser.error("--no-synthetic needs at least one --trace")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    plans = []  # (preset, geometry, {workload: (run geometry, steps, mapping or None)}), all mapped before any run
    traces = [(Path(path).name, load_trace(path)) for path in args.trace]
    for preset in args.presets.split(","):
        geometry = get_preset(preset).with_layers(args.layers)
        workloads = {} if args.no_synthetic else {"synthetic-skewed": (geometry, skewed_steps(geometry, args.steps), None)}
        for name, trace in traces:
            try:
                run_geometry, experts, mapping = map_trace(trace, geometry, layers=args.trace_layers,
                                                           top_k=args.trace_top_k)
            except TraceFormatError as exc:
                raise SystemExit(f"refused: {name}: {exc}") from None
            print(f"{preset} {name}: layers {mapping['layers']['rule']}; experts {mapping['experts']['rule']}; "
                  f"top-k {mapping['top_k']['rule']}", flush=True)
            workloads[name] = (run_geometry, trace_steps(experts, trace.step, geometry.num_moe_layers, args.steps),
                               mapping)
        plans.append((preset, geometry, workloads))
    for preset, geometry, workloads in plans:
        spec = ensure_synthetic_pack(geometry, args.pack_dir)
        for name, (run_geometry, steps, mapping) in workloads.items():
            for coverage in floats(args.coverages):
                for arena_gb in floats(args.arena_gb):
                    pool = max(1, round(coverage * geometry.total_routed_experts))
                    result = run_replay(run_geometry, lambda: open_synthetic_rows(spec, args.pack_dir), steps,
                                        pool_slots=pool, arena_slots=int(arena_gb * 2**30) // spec.stride,
                                        device=device, config=config, warmup=args.warmup, graph=not args.eager,
                                        arena_preload=args.arena_preload, dtype=getattr(torch, args.dtype),
                                        compare=compare, compare_first=args.compare_first,
                                        interleave=args.interleave)
                    result.update(preset=preset, workload=name, arena_gb=arena_gb, trace_mapping=mapping)
                    results.append(result)
                    Path(args.out).write_text(json.dumps({**head, "results": results}, indent=2))  # after every run
                    runs = result["runs"]
                    t, r = runs["tiered"], runs["resident"]["steady"]
                    print(f"{preset} {name} cov {coverage:.0%} arena {arena_gb} GiB (graph {t['graph']}): steady tiered "
                          f"{t['steady']['step_ms']:.3f} ms (p50 {t['steady']['p50_ms']:.3f} p99 {t['steady']['p99_ms']:.3f}; "
                          f"cold {t['cold']['step_ms']:.3f}), floor {result['floor_step_ms']:.3f} ms "
                          f"({result['tiered_over_floor']:.2f}x), resident {r['step_ms']:.3f} ms, naive "
                          f"{runs['naive']['steady']['step_ms']:.3f} ms ({result['naive_over_tiered']:.2f}x), misses/step "
                          f"{t['steady']['missing_pairs_per_step']:.1f}; pool {result['pool_over_touched']:.2f}x the "
                          f"{result['touched_keys']} routed keys", flush=True)
                    b = t["steady"]["breakdown"]
                    print(f"  resident+readback {runs['resident_readback']['steady']['step_ms']:.3f} ms (tiered "
                          f"{result['tiered_over_resident_readback']:.2f}x of it); naive/floor "
                          f"{result['naive_over_floor']:.2f}x; floor at the steps' batch sizes "
                          f"{result['floor_batched_step_ms']:.3f} ms ({result['tiered_over_floor_batched']:.2f}x); "
                          f"tokens match resident: {result['tokens_match_resident']}; "
                          f"steady steps reading the pack {b.get('disk_steps', 0)} ({b.get('disk_step_ms', 0):.3f} ms "
                          f"vs {b.get('no_disk_step_ms', 0):.3f} ms), multi-replay steps {b.get('multi_replay_steps', 0)}",
                          flush=True)
                    if "tiered_flipped" in runs:
                        f = runs["tiered_flipped"]["steady"]
                        print(f"  layer_waits {result['layer_waits']}, copy_streams {result['copy_streams']}: "
                              f"{t['steady']['step_ms']:.3f} ms vs {result['compared_config']} "
                              f"{f['step_ms']:.3f} ms ({result['tiered_over_flipped']:.3f}x; flipped "
                              f"{result['flipped_over_floor']:.2f}x the floor, tokens match resident: "
                              f"{result['flipped_tokens_match_resident']}; steady rows fetched during their pass "
                              f"{t.get('steady_early_fetched_rows', 0)} vs "
                              f"{runs['tiered_flipped'].get('steady_early_fetched_rows', 0)}; gathered by their pass "
                              f"{t.get('steady_gathered_rows', 0)} vs {runs['tiered_flipped'].get('steady_gathered_rows', 0)}"
                              f"; steady bytes {t['steady']['fetched_bytes']} vs {f['fetched_bytes']})", flush=True)
                    for name, run in runs.items():
                        if run.get("steady_pair_steps"):
                            print(f"  {name}: steady steps launched as a pass pair {run['steady_pair_steps']} "
                                  f"({run.get('steady_wide_pairs', 0)} with the wide copy grid), "
                                  f"recent medians pair {run['pair_step_ms']:.3f} ms, single "
                                  f"{run['single_step_ms']:.3f} ms (0: not timed)", flush=True)
                        for kind, k in run["steady"]["breakdown"].get("by_kind", {}).items():
                            if name.startswith("tiered"):
                                print(f"    {name} {kind} steps {k['steps']}: means step {k['ms']:.3f} ms = forward "
                                      f"calls {k['forward_ms']:.3f} + read prep {k['prep_ms']:.3f} + reads "
                                      f"{k['read_ms']:.3f} + fetch {k['fetch_ms']:.3f} + rest; copies "
                                      f"{k['copy_ms']:.3f} ms on the device", flush=True)
                    split = b.get("fetch_step_median_ms")
                    if b.get("fetch_steps"):
                        print(f"  steady steps that fetched {b['fetch_steps']}, medians: step {split['ms']:.3f} ms, "
                              f"pass-log reads {split['read_ms']:.3f} ms (waiting for the forward and the copies), "
                              f"fetch host {split['fetch_ms']:.3f} ms (arena {split['arena_ms']:.3f}, pool install "
                              f"{split['install_ms']:.3f}, copy wait {split['copy_wait_ms']:.3f}), copies "
                              f"{split['copy_ms']:.3f} ms on the device (window: {t['steady']['copy_gbps']:.1f} GB/s vs "
                              f"pinned H2D {result['h2d_gbps']:.1f}); rows by the located fetch "
                              f"{t.get('steady_located_rows', 0)}, gathered by their pass "
                              f"{t.get('steady_gathered_rows', 0)}", flush=True)
                    if "nomiss_overhead" in result:
                        v = result["nomiss_overhead"]["variants"]
                        print("  no-miss interleaved: " + ", ".join(
                            f"{k} {x['mean_ms']:.3f} ms ({x['minus_plain_us']:+.1f} us)" for k, x in v.items()),
                            flush=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
