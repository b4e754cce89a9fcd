"""The stream builds alone (config stream_arena): one decode token's MoE layer (route, gate_up, down, combine) at a
preset's shapes with `n` of its top-k experts computed from pinned arena rows over the bus, against the same layer
with every expert in a pool slot, and against the copy engine moving those n rows (the floor's bus time).

Variants, side by side in one process: `resident` (W2MoeCuda(), every expert in a slot), `resident_max_carveout`
(that build with both single-token kernels asking the largest shared-memory carveout, as the stage build does),
`stream` (the W2_STREAM builds, n experts without a slot), `stream_prefetch` (W2_STREAM_PREFETCH: a streamed pair's
block first asks its rows into L2 with bulk prefetches), `stream_stage` (W2_STREAM_STAGE with the prefetch: a
streamed pair's block first copies its rows into shared memory in contiguous runs, where the stage fits; the largest
carveout, the default), `resident_stage_build` (that build with every expert in a slot: what it costs the blocks that
stream nothing), and both of those with the carveout that just fits 4 blocks (`*_fit`). Before timing, every variant's outputs of every layer are checked equal bit for
bit to the resident ones (outputs poisoned first). Timing: a CUDA graph of `--layers` such layers (each its own
experts), L2 flushed (a 256 MiB write) before each replay, events around the replay only; the rounds rotate the
variants; per layer, the median of the rounds. `h2d_us`: n rows by cudaMemcpyAsync from pinned memory, timed the same
way.

    python3 benchmarks/stream_kernels.py --presets ds-v2-lite,qwen3-30b-a3b --streamed 0,1,2,4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tierstore.geometry import get_preset  # noqa: E402
from tierstore.kernels import MissLog, MoeWorkspace, TierPool, fp4_tier, moe_mm  # noqa: E402
from tierstore.kernels.cuda import w2_down  # noqa: E402
from tierstore.kernels.cuda.w2_moe import W2MoeCuda  # noqa: E402
from tierstore.kernels.layout import w2_slot_layout  # noqa: E402
from tierstore.runtime.synthetic import random_experts  # noqa: E402

# variant -> (W2MoeCuda stream options; None: the plain build; "max_carveout": the plain build asking the largest
# carveout), whether every expert has a slot)
STAGE = dict(stream_prefetch=True, stream_stage=True)
VARIANTS = {"resident": (None, True), "resident_max_carveout": ("max_carveout", True),
            "stream": (dict(stream_prefetch=False), False), "stream_prefetch": (dict(stream_prefetch=True), False),
            "stream_stage": (STAGE, False), "resident_stage_build": (STAGE, True),
            "stream_stage_fit": (STAGE | dict(stream_stage_carveout="fit"), False),
            "resident_stage_fit": (STAGE | dict(stream_stage_carveout="fit"), True)}
STREAMING = [v for v, (_, resident) in VARIANTS.items() if not resident]
FLUSH_BYTES = 256 << 20


class Layers:
    """`layers` MoE layers of one decode token, layer l routing experts 0..k-1 of its own rows (rows l * k + j),
    the first `streamed` of them without a slot (their arena rows named in stream_at) unless `resident`."""

    def __init__(self, geometry, layers: int, streamed: int, resident: bool, slots, arena, seed: int):
        k, experts = geometry.top_k, geometry.num_experts
        self.layout = w2_slot_layout(geometry.hidden, geometry.expert_inter)
        table = torch.full((layers, experts), -1, dtype=torch.int32)
        at = torch.zeros(layers * experts, dtype=torch.int64)
        for layer in range(layers):
            for j in range(k):
                row = layer * k + j
                if resident or j >= streamed:
                    table[layer, j] = row
                else:
                    at[layer * experts + j] = arena[row].data_ptr() - slots.data_ptr()
        self.w2 = TierPool(slots, table.cuda(), self.layout, stream_at=at.cuda())  # all zero where resident
        self.fp4 = fp4_tier(geometry.hidden, geometry.expert_inter, 1, layers, experts, "cuda")
        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.arange(k, dtype=torch.int32).view(1, k).cuda()
        self.weights = torch.softmax(torch.randn(1, k, generator=gen), -1).cuda()
        self.x = (torch.randn(1, geometry.hidden, generator=gen) * 2).to(torch.bfloat16).cuda()
        self.ws = MoeWorkspace.allocate(1, k, experts, geometry.hidden, geometry.expert_inter, torch.bfloat16, "cuda",
                                        block_tokens=1)
        self.misses = MissLog.allocate(layers * experts, "cuda")
        self.outs = torch.empty(layers, geometry.hidden, dtype=torch.bfloat16, device="cuda")  # [L, H]
        self.layers = layers

    def run(self, op) -> None:
        self.misses.reset()
        for layer in range(self.layers):
            moe_mm(self.x, self.ids, self.weights, self.w2, self.fp4, layer, self.misses, self.ws,
                   out=self.outs[layer:layer + 1], cuda_w2=op)


def _graph(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _time(launch, flush: torch.Tensor, reps: int) -> float:
    """Median us of `launch()` over `reps` launches, L2 flushed before each."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        flush.zero_()
        start.record()
        launch()
        end.record()
        end.synchronize()
        samples.append(1e3 * start.elapsed_time(end))
    return statistics.median(samples)


def _build(options, wps: int) -> W2MoeCuda:
    if isinstance(options, dict):
        return W2MoeCuda(wps=wps, stream=True, **options)
    op = W2MoeCuda(wps=wps)
    if options == "max_carveout":
        op.gate_up.kernel.prefer_max_shared()
        op.down.kernel.prefer_max_shared()
    return op


def bench_preset(name: str, layers: int, counts: list[int], rounds: int, reps: int) -> list[dict]:
    g = get_preset(name)
    k = g.top_k
    layout = w2_slot_layout(g.hidden, g.expert_inter)
    rows = random_experts(g, False, layers * k, seed=3)  # [L * k, slot_bytes]
    slots, arena = rows.cuda(), rows.pin_memory()
    wps = w2_down.wps_of(layout)
    ops = {v: _build(options, wps) for v, (options, _) in VARIANTS.items()}
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    results = []
    for n in counts:
        n = min(n, k)
        cases = {v: Layers(g, layers, n, resident, slots, arena, seed=n) for v, (_, resident) in VARIANTS.items()}
        for case in cases.values():  # the same inputs in every variant
            case.x.copy_(cases["resident"].x)
            case.weights.copy_(cases["resident"].weights)
        checks = {}
        for variant, case in cases.items():
            case.outs.fill_(float("nan"))
            case.run(ops[variant])
            torch.cuda.synchronize()
            checks[variant] = case.outs.clone()
        counts_ok = all(cases[v].misses.counts.tolist() == [0, n * layers] for v in STREAMING) if n else True
        exact = {v: bool(torch.equal(checks[v], checks["resident"]) and not checks[v].isnan().any()) for v in VARIANTS}
        graphs = {v: _graph(lambda c=cases[v], op=ops[v]: c.run(op)) for v in VARIANTS}
        copy_dst = torch.empty(max(n, 1), layout.slot_bytes, dtype=torch.uint8, device="cuda")
        times = {v: [] for v in (*VARIANTS, "h2d")}
        for r in range(rounds):
            names = list(VARIANTS)
            order = names[r % len(names):] + names[:r % len(names)]
            for v in order:
                times[v].append(_time(graphs[v].replay, flush, reps) / layers)
            times["h2d"].append(_time(lambda: copy_dst[:n].copy_(arena[:n], non_blocking=True), flush, reps)
                                if n else 0.0)
        us = {v: statistics.median(t) for v, t in times.items()}
        row_bytes = layout.slot_bytes
        result = {"preset": name, "streamed": n, "top_k": k, "row_bytes": row_bytes, "layers": layers,
                  "exact": exact, "logged_ok": counts_ok, "us_per_layer": us,
                  "extra_us": {v: us[v] - us["resident"] for v in list(VARIANTS)[1:]}}
        result["stream_gbps"] = {v: n * row_bytes / (result["extra_us"][v] * 1e3) if n and result["extra_us"][v] > 0
                                 else None for v in STREAMING}
        result["h2d_gbps"] = n * row_bytes / (us["h2d"] * 1e3) if n else None
        results.append(result)
        extra = ", ".join(f"{v} +{result['extra_us'][v]:.1f}" for v in list(VARIANTS)[1:])
        print(f"{name} n={n}: resident {us['resident']:.1f} us/layer, {extra}, h2d of the rows {us['h2d']:.1f} us; "
              f"exact {exact}, logged {counts_ok}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="ds-v2-lite,qwen3-30b-a3b")
    parser.add_argument("--streamed", default="0,1,2,4", help="experts per layer without a slot")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--commit", default="")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("stream_kernels.py needs CUDA")
    counts = [int(c) for c in args.streamed.split(",")]
    results = [r for p in args.presets.split(",") for r in bench_preset(p, args.layers, counts, args.rounds, args.reps)]
    provenance = {"commit": args.commit or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True,
                                                          text=True, cwd=ROOT).stdout.strip(),
                  "device": torch.cuda.get_device_name(), "torch": torch.__version__, "argv": sys.argv[1:]}
    if args.json:
        args.json.write_text(json.dumps({"provenance": provenance, "method": __doc__, "results": results}, indent=1))
    print(f"{'preset':<15} {'n':>2} {'resident us':>11} {'+res.max':>8} {'+stream':>8} {'+prefetch':>9} {'+stage':>7} "
          f"{'+res.stage':>10} {'+st.fit':>7} {'+res.fit':>8} {'h2d us':>7} {'GB/s s/p/st/h2d':>22} exact")
    for r in results:
        gb, extra = r["stream_gbps"], r["extra_us"]
        fmt = lambda v: f"{v:.1f}" if v else "-"  # noqa: E731
        print(f"{r['preset']:<15} {r['streamed']:>2} {r['us_per_layer']['resident']:>11.1f} "
              f"{extra['resident_max_carveout']:>8.1f} {extra['stream']:>8.1f} {extra['stream_prefetch']:>9.1f} "
              f"{extra['stream_stage']:>7.1f} {extra['resident_stage_build']:>10.1f} {extra['stream_stage_fit']:>7.1f} "
              f"{extra['resident_stage_fit']:>8.1f} {r['us_per_layer']['h2d']:>7.1f} "
              f"{fmt(gb['stream'])}/{fmt(gb['stream_prefetch'])}/{fmt(gb['stream_stage'])}/{fmt(r['h2d_gbps'])} "
              f"{all(r['exact'].values())}")


if __name__ == "__main__":
    main()
