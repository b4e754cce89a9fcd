"""Precision-tier cost benchmark (issue 6, section 5): steps/s with W2 only and with the FP4 pool at
several sizes, the cost of arming the confidence gate when it does not fire (target <= 5%), and
the cost per fire, on synthetic skewed routing with a synthetic per-step confidence. The base
pool holds every expert. Writes benchmarks/results/gate_cost.json with provenance.

The armed cost is measured at held FP4 residency (`--repetitions` > 0, the default): FP4 pool
preloaded with the trace's hottest experts, manager paused, armed and unarmed blocks alternating
in one runtime (`tierstore/runtime/replay_gate.py`); the live-manager runs' ratio is reported too
(`armed_cost_live`, confounded by the residency the manager reached in each run).

    python benchmarks/gate_cost.py [--presets ds-v2-lite] [--layers 8] [--steps 80] [--warmup 20]
        [--fp4-fractions 0.1,0.25,0.5,1] [--gate-fraction 0.25] [--fire-every 4] [--repetitions 6]
        [--device cuda|cpu] [--hidden H --inter I] [--commit HASH]

`--split` runs only the diagnostic of where an FP4-pool step's time goes (`runtime/fp4_split.py`):
W2 forward, the same forward with the FP4 pool held, the held step, the live-manager step, in one
run (pool of `--gate-fraction` of the experts; `--steps` per block, `--rounds` ABBA rounds, one run
per `--split-dtypes` activation dtype); writes benchmarks/results/gate_split.json by default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
from replay import floats, provenance, skewed_steps

from tierstore.geometry import get_preset
from tierstore.runtime.fp4_split import fp4_step_split
from tierstore.runtime.gate import GRAPH_AFTER, ConfidenceGate, SignalGraphs, aggregate_tensor, row_signals
from tierstore.runtime.replay_gate import confidence_logits, fire_schedule, gate_cost
from tierstore.runtime.synthetic import tiled_rows


FORWARD_CYCLES = 200_000  # a device sleep of about 0.1 ms stands for the forward in `_step_like`


def _throughput(signal, logits: torch.Tensor, host: torch.Tensor, calls: int) -> dict:
    """Host enqueue and device time per call, `calls` calls queued behind a long sleep kernel (the
    events then time the device alone; `covered`: the sleep outlasted the enqueueing)."""
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    marks[0].record()
    torch.cuda._sleep(200_000_000)
    marks[1].record()
    started = time.perf_counter()
    for _ in range(calls):
        host.copy_(signal(logits), non_blocking=True)
    host_s = time.perf_counter() - started
    marks[2].record()
    torch.cuda.synchronize()
    return {"host_us": 1e6 * host_s / calls, "device_us": 1e3 * marks[1].elapsed_time(marks[2]) / calls,
            "covered": 1e3 * host_s < marks[0].elapsed_time(marks[1])}


def _step_like(signal, logits: torch.Tensor, host: torch.Tensor, trials: int) -> float:
    """Median seconds of: a short sleep kernel (the forward), the signal and its copy (None: none),
    a 4-byte copy to pinned memory (the pass log's read) and a stream sync."""
    word = torch.zeros(1, dtype=torch.int32, device="cuda")
    word_host = torch.empty(1, dtype=torch.int32, pin_memory=True)
    stream, times = torch.cuda.current_stream(), []
    for _ in range(trials):
        started = time.perf_counter()
        torch.cuda._sleep(FORWARD_CYCLES)
        if signal is not None:
            host.copy_(signal(logits), non_blocking=True)
        word_host.copy_(word, non_blocking=True)
        stream.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def signal_timing(tokens: int, vocab: int, calls: int = 100, trials: int = 300) -> dict:
    """Per step, the armed gate's signal work after the forward (signal + its copy into pinned host
    memory), max_prob / min on logits [tokens, vocab] at a fixed address: `_throughput`'s host and
    device microseconds, and `added_us`: what it adds to a step-like sequence (`_step_like`, median,
    minus the same without it). Variants: `graph` (signal_tensor: a captured graph of the gate's
    kernels, on CUDA the Triton signal), `eager` (the same kernels launched one by one), `softmax_graph`
    / `softmax_eager` (the torch definition the gate ran before the Triton signal: softmax().amax(),
    captured / op by op), `eager_min` (softmax_eager plus the min over one row that it ran before)."""
    gate = ConfidenceGate("max_prob")
    logits = confidence_logits(fire_schedule(1, 0), tokens, vocab, "cuda")[0]  # [T, V]
    host = torch.empty(1, pin_memory=True)
    def softmax(x: torch.Tensor) -> torch.Tensor:
        return aggregate_tensor(row_signals(x, "max_prob"), None)
    softmax_graph = SignalGraphs(softmax)
    variants = {"graph": gate.signal_tensor, "eager": gate.eager_signal, "softmax_graph": softmax_graph,
                "softmax_eager": softmax, "eager_min": lambda x: row_signals(x, "max_prob").min().reshape(1)}
    out, bare = {}, None
    for name, signal in variants.items():
        for _ in range(GRAPH_AFTER + 2):  # warm-up; the graph is captured here
            host.copy_(signal(logits), non_blocking=True)
        torch.cuda.synchronize()
        bare = _step_like(None, logits, host, trials)
        out[name] = {**_throughput(signal, logits, host, calls),
                     "added_us": 1e6 * (_step_like(signal, logits, host, trials) - bare)}
    out["graph"]["captured"] = gate.signal_graphed(logits)
    out["softmax_graph"]["captured"] = softmax_graph.graphed(logits)
    out["bare_step_us"] = 1e6 * bare
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="ds-v2-lite")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=80, help="steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--fp4-fractions", default="0.1,0.25,0.5,1")
    parser.add_argument("--gate-fraction", type=float, default=0.25)
    parser.add_argument("--fire-every", type=int, default=4, help="the firing run fires on every N-th step")
    parser.add_argument("--repetitions", type=int, default=6, help="ABBA repetitions at held residency (0: skip)")
    parser.add_argument("--device", help="cuda (default when available) or cpu")
    parser.add_argument("--hidden", type=int, help="override the preset's hidden size (small CPU runs)")
    parser.add_argument("--inter", type=int, help="override the preset's expert intermediate size")
    parser.add_argument("--eager", action="store_true", help="no CUDA graphs of the forward")
    parser.add_argument("--dtype", default="float32", help="activation dtype of the runs (earlier runs: float32)")
    parser.add_argument("--commit", help="commit of the tree (when it runs without .git)")
    parser.add_argument("--split", action="store_true", help="only the step-time split (see the module doc)")
    parser.add_argument("--rounds", type=int, default=4, help="--split: ABBA rounds")
    parser.add_argument("--split-dtypes", default="float32", help="--split: activation dtypes, e.g. float32,bfloat16")
    parser.add_argument("--out", help="default benchmarks/results/gate_cost.json (gate_split.json with --split)")
    args = parser.parse_args()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.split:
        split_main(args, device)
        return
    results = []
    for preset in args.presets.split(","):
        geometry = _geometry(args, preset)
        steps = skewed_steps(geometry, args.steps)
        result = gate_cost(geometry, steps, fp4_fractions=tuple(floats(args.fp4_fractions)),
                           gate_fraction=args.gate_fraction, fire_every=args.fire_every, device=device,
                           warmup=args.warmup, graph=not args.eager, repetitions=args.repetitions,
                           dtype=getattr(torch, args.dtype))
        result.update(preset=preset, hidden=geometry.hidden, expert_inter=geometry.expert_inter)
        if device.type == "cuda":
            result["signal_timing"] = signal_timing(steps[0].shape[0], result["vocab"])
        results.append(result)
        for name, run in result["runs"].items():
            s = run["steady"]
            print(f"{preset} {name:>9}: {s['steps_per_s']:8.1f} steps/s  {s['step_ms']:.3f} ms (p50 {s['p50_ms']:.3f} "
                  f"p99 {s['p99_ms']:.3f})  fp4 pairs {100 * run['fp4_pair_share']:.1f}%  fires {s['gate_fired']}", flush=True)
        held = result["held"]
        if held:
            for r in held["repetitions"]:
                print(f"{preset} held {'/'.join(r['order'])}: unarmed {r['unarmed']['step_ms']:.3f} ms  armed "
                      f"{r['armed']['step_ms']:.3f} ms  cost {100 * r['armed_cost']:+.1f}% (p50 {100 * r['armed_cost_p50']:+.1f}%)",
                      flush=True)
            print(f"{preset}: armed-silent cost at held residency {100 * held['armed_cost_median']:+.1f}% median "
                  f"[{100 * held['armed_cost_min']:+.1f}%, {100 * held['armed_cost_max']:+.1f}%] over "
                  f"{len(held['repetitions'])} repetitions, FP4 share {100 * held['residency']['fp4_pair_share']:.1f}% "
                  f"(residency unchanged: {held['residency']['unchanged']})", flush=True)
        for name, t in result.get("signal_timing", {}).items():
            if isinstance(t, dict):
                print(f"{preset} gate signal {name:>13}: adds {t['added_us']:.1f} us to a step-like sequence; host "
                      f"{t['host_us']:.1f} us  device {t['device_us']:.1f} us per call (covered {t['covered']}"
                      f"{', captured %s' % t['captured'] if 'captured' in t else ''})", flush=True)
        print(f"{preset}: armed-silent cost {100 * result['armed_cost']:+.1f}% (target <= 5%; live-manager runs "
              f"{100 * result['armed_cost_live']:+.1f}%, confounded), "
              f"{result['ms_per_fire']:.3f} ms per fire over {result['fires']} fires", flush=True)
    out = Path(args.out or Path(__file__).parent / "results" / "gate_cost.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"provenance": provenance(args.commit), "method": {
        "steps": args.steps, "warmup": args.warmup, "layers": args.layers, "graph": not args.eager, "dtype": args.dtype,
        "armed_cost": "median over --repetitions ABBA repetitions of (block step time, gate armed, confidence 0.99, "
                      "never fires) / (same block unarmed) - 1, one runtime, FP4 pool preloaded with the trace's "
                      "hottest experts and the manager paused (residency held; see results[].held.residency)",
        "armed_cost_live": "steady step time of the live-manager armed run / unarmed run - 1 (residency differs)",
        "repetitions": args.repetitions, "device": str(device),
        "ms_per_fire": "(steady seconds firing run - armed run) / steady fires",
        "signal_timing": "the gate signal + its host copy, max_prob / min, per call: host enqueue and device time "
                         "(queued behind a sleep kernel), and added_us: median added to sleep 0.1 ms + 4-byte copy + "
                         "sync (graph: signal_tensor, a captured graph of the Triton signal; eager: the same launches one by "
                         "one; softmax_graph / softmax_eager: the earlier torch softmax().amax() signal captured / op "
                         "by op; eager_min: softmax_eager with the min of the signal before, one kernel more for one "
                         "row); CUDA only"},
        "results": results}, indent=2))
    print(f"wrote {out}")


def _geometry(args, preset: str):
    geometry = get_preset(preset).with_layers(args.layers)
    if args.hidden or args.inter:
        geometry = dataclasses.replace(geometry, hidden=args.hidden or geometry.hidden,
                                       expert_inter=args.inter or geometry.expert_inter)
    return geometry


def split_main(args, device: torch.device) -> None:
    results = []
    for preset in args.presets.split(","):
        geometry = _geometry(args, preset)
        steps = skewed_steps(geometry, args.steps)
        rows = (tiled_rows(geometry, fp4=False), tiled_rows(geometry, fp4=True))
        slots = max(1, int(args.gate_fraction * geometry.total_routed_experts))
        for name in args.split_dtypes.split(","):
            started = time.perf_counter()
            result = fp4_step_split(geometry, rows, steps, fp4_slots=slots, device=device, graph=not args.eager,
                                    dtype=getattr(torch, name), rounds=args.rounds, warmup=args.warmup)
            result.update(preset=preset, layers=args.layers, hidden=geometry.hidden, expert_inter=geometry.expert_inter,
                          seconds=time.perf_counter() - started)
            results.append(result)
            for variant, v in result["variants"].items():
                print(f"{preset} {name} {variant:>10}: mean {v['mean_ms']:.3f} ms  p50 {v['p50_ms']:.3f}  "
                      f"p99 {v['p99_ms']:.3f}  ({v['steps']} steps)", flush=True)
            for i, b in enumerate(result["live_blocks"]):
                print(f"{preset} {name} live block {i}: mean {b['mean_ms']:.3f} ms  runner lock wait "
                      f"{b['runner_lock_wait_ms']:.2f} ms  manager lock hold {b['manager_lock_hold_ms']:.2f} ms  "
                      f"promoted {b['promoted_lazy']}  FP4 copies {b['fp4_copy_device_ms']:.2f} ms (device)  "
                      f"FP4 share {100 * b['fp4_pair_share']:.1f}%  mapped {b['mapped']}", flush=True)
            split = "  ".join(f"{k} {1e3 * v:+.1f} us" for k, v in result["split_ms"].items())
            print(f"{preset} {name} split: {split}  (held FP4 share {100 * result['held']['fp4_pair_share']:.1f}%, "
                  f"unchanged {result['held']['unchanged']}, graph {result['graph']}, {result['seconds']:.1f} s)",
                  flush=True)
    out = Path(args.out or Path(__file__).parent / "results" / "gate_split.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"provenance": provenance(args.commit), "method": {
        "split": "runtime/fp4_split.py: w2_plain / w2_step / held_plain / held_step / live_plain interleaved step "
                 "by step (rotating order, live manager paused), live_step in blocks, ABBA over rounds",
        "steps_per_block": args.steps, "warmup": args.warmup, "rounds": args.rounds, "layers": args.layers,
        "gate_fraction": args.gate_fraction, "graph": not args.eager, "device": str(device)},
        "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
