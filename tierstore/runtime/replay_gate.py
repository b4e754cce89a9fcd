"""What the precision tier costs per step (issue 6, section 5): W2 only, an FP4 pool at several
sizes, the confidence gate armed but silent, and the gate firing, on the same forced routing.

The base pool holds every expert (preloaded), so base misses never mix into the numbers; the FP4
pool starts empty and is filled by its manager (and by the gate's forced promotions). Rows are
synthetic (a few random experts, tiled over the model: contents do not change timings) and live
in host RAM (`MemoryRowSource`), read through each tier's arena. The gate sees synthetic
logits whose top-1 probability is the step's confidence (`confidence_logits`).

The armed-silent cost is measured at held FP4 residency (`armed_cost_held`): one runtime, its FP4
pool preloaded with the trace's hottest experts and its manager paused, runs the same steps in
alternating blocks with the gate armed and unarmed (order ABBA per repetition); the cost is the
median over repetitions of armed / unarmed - 1. Runs with a live manager (`unarmed`, `armed`)
promote during the run, so their FP4 residency differs between them; their ratio is kept as
`armed_cost_live` for comparison only.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from tierstore.geometry import MoEGeometry
from tierstore.runtime.config import RuntimeConfig
from tierstore.runtime.engine import TieredRuntime
from tierstore.runtime.replay_drive import drive
from tierstore.runtime.rows import MemoryRowSource
from tierstore.runtime.synthetic import tiled_rows


def confidence_logits(confidence: np.ndarray, tokens: int, vocab: int, device) -> torch.Tensor:
    """float32 [steps, tokens, vocab] whose softmax puts exactly `confidence[s]` on token 0 in every row."""
    p = np.clip(np.asarray(confidence, np.float64), 1e-6, 1 - 1e-6)
    top = np.log(p * (vocab - 1) / (1 - p))  # softmax(top, 0, ..., 0)[0] == p
    out = torch.zeros(len(p), tokens, vocab, dtype=torch.float32)
    out[:, :, 0] = torch.as_tensor(top, dtype=torch.float32)[:, None]
    return out.to(device)


def fire_schedule(steps: int, every: int, low: float = 0.30, high: float = 0.99) -> np.ndarray:
    """Confidence per step: `low` on every `every`-th step (0 = never), `high` elsewhere."""
    out = np.full(steps, high)
    if every:
        out[every - 1::every] = low
    return out


def _timed(geometry, rows, steps, *, fp4_slots: int, gate: bool, confidence, device, warmup: int, graph: bool,
           vocab: int, tau: float, dtype: torch.dtype) -> dict:
    w2, fp4 = rows
    config = RuntimeConfig(kpi_every=0, force_pool=True, force_fp4_pool=True, gate=gate, gate_tau=tau if gate else None)
    everything = geometry.total_routed_experts
    extra = dict(fp4_source=MemoryRowSource(fp4), fp4_slots=fp4_slots, fp4_arena_slots=fp4_slots) if fp4_slots else {}
    with TieredRuntime(geometry, MemoryRowSource(w2), pool_slots=everything, device=device, config=config,
                       **extra) as runtime:
        runtime.preload()
        logits = (confidence_logits(confidence, steps[0].shape[0], vocab, runtime.device)
                  if confidence is not None else None)
        out = drive(runtime, steps, warmup=warmup, graph=graph, logits=logits, dtype=dtype)
        fp4_share = runtime.fp4_stats().fp4_pair_share if fp4_slots else 0.0
    return {"fp4_slots": fp4_slots, "gate": gate, "graph": out["graph"], "fp4_pair_share": fp4_share,
            "cold": out["cold"].as_dict(), "steady": out["steady"].as_dict()}


def hottest_keys(geometry: MoEGeometry, steps: list[np.ndarray], count: int) -> list[tuple[int, int]]:
    """The `count` (layer, expert) pairs routed most often over `steps` (ties: lower id first)."""
    counts = np.zeros(geometry.total_routed_experts, dtype=np.int64)
    for ids in steps:
        ids = np.asarray(ids)  # [T, L, k]
        layers = np.broadcast_to(np.arange(ids.shape[1])[None, :, None], ids.shape)
        np.add.at(counts, (layers * geometry.num_experts + ids).reshape(-1), 1)
    order = np.argsort(-counts, kind="stable")[:count]
    return [divmod(int(i), geometry.num_experts) for i in order]


def armed_cost_held(geometry: MoEGeometry, rows, steps: list[np.ndarray], *, fp4_slots: int, device, graph: bool,
                    vocab: int, tau: float, repetitions: int, warmup: int, dtype: torch.dtype = torch.float32) -> dict:
    """Armed vs unarmed at the same FP4 residency, in one runtime (see the module doc)."""
    w2, fp4 = rows
    config = RuntimeConfig(kpi_every=0, force_pool=True, force_fp4_pool=True, gate=True, gate_tau=tau)
    silent = fire_schedule(len(steps), 0)
    with TieredRuntime(geometry, MemoryRowSource(w2), pool_slots=geometry.total_routed_experts, device=device,
                       config=config, fp4_source=MemoryRowSource(fp4), fp4_slots=fp4_slots,
                       fp4_arena_slots=fp4_slots) as runtime:
        runtime.preload()
        resident = hottest_keys(geometry, steps, runtime.fp4.pool.num_slots)
        runtime.preload_fp4(resident)
        if not runtime.pause_fp4_manager(60):
            raise RuntimeError("the FP4 manager did not pause")
        table_before = runtime.fp4.pool.mirror.copy()
        logits = confidence_logits(silent, steps[0].shape[0], vocab, runtime.device)
        gate = runtime.gate
        drive(runtime, steps[:max(warmup, 1)], warmup=0, graph=graph, logits=logits, dtype=dtype)  # kernels, graphs, arena
        reps = []
        for rep in range(repetitions):
            order = ("unarmed", "armed") if rep % 2 == 0 else ("armed", "unarmed")
            times = {}
            for mode in order:
                runtime.gate = gate if mode == "armed" else None
                out = drive(runtime, steps, warmup=0, graph=graph, logits=logits, dtype=dtype)
                times[mode] = out["steady"].as_dict()
            runtime.gate = gate
            reps.append({"order": list(order), **{m: {k: times[m][k] for k in ("step_ms", "p50_ms", "p99_ms",
                                                                                 "gate_fired")} for m in order},
                         "armed_cost": times["armed"]["step_ms"] / times["unarmed"]["step_ms"] - 1,
                         "armed_cost_p50": times["armed"]["p50_ms"] / times["unarmed"]["p50_ms"] - 1})
        held = bool(np.array_equal(table_before, runtime.fp4.pool.mirror))
        routed = resident_pairs = 0
        resident_set = set(resident)
        for ids in steps:
            ids = np.asarray(ids)
            for layer in range(ids.shape[1]):
                for e in ids[:, layer].reshape(-1).tolist():
                    routed += 1
                    resident_pairs += (layer, int(e)) in resident_set
        gate_steps = runtime.gate_stats().steps
    costs = sorted(r["armed_cost"] for r in reps)
    return {
        "residency": {"how": "FP4 pool preloaded with the trace's hottest experts, manager paused for the whole "
                             "comparison; armed and unarmed blocks alternate (ABBA) over the same steps in one runtime",
                      "fp4_slots": fp4_slots, "mapped": len(resident), "unchanged": held,
                      "fp4_pair_share": resident_pairs / routed if routed else 0.0},
        "repetitions": reps, "steps_per_block": len(steps), "gate_steps": gate_steps,
        "armed_cost_median": float(np.median(costs)), "armed_cost_min": costs[0], "armed_cost_max": costs[-1],
        "armed_cost_p50_median": float(np.median([r["armed_cost_p50"] for r in reps])),
        "unarmed_step_ms_median": float(np.median([r["unarmed"]["step_ms"] for r in reps])),
        "armed_step_ms_median": float(np.median([r["armed"]["step_ms"] for r in reps])),
    }


def gate_cost(geometry: MoEGeometry, steps: list[np.ndarray], *, fp4_fractions: tuple[float, ...],
              gate_fraction: float, fire_every: int, device, warmup: int = 0, graph: bool = True,
              vocab: int = 32000, tau: float = 0.60, repetitions: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """Runs `w2`, `fp4@f` for each f, `armed` (gate on, never fires) and `firing` (fires on every
    `fire_every`-th step), the last two with an FP4 pool of `gate_fraction` of the experts; plus
    the derived costs on the steady windows. `repetitions` > 0 adds the armed cost at held
    residency (`armed_cost_held`), which then is `armed_cost`. `dtype`: the forward's activations
    (float32 by default, as every earlier run; the kernels' bf16 paths differ)."""
    device = torch.device(device)
    rows = (tiled_rows(geometry, fp4=False), tiled_rows(geometry, fp4=True))
    slots = {f: max(1, math.floor(f * geometry.total_routed_experts)) for f in (*fp4_fractions, gate_fraction)}
    common = dict(device=device, warmup=warmup, graph=graph, vocab=vocab, tau=tau, dtype=dtype)
    runs = {"w2": _timed(geometry, rows, steps, fp4_slots=0, gate=False, confidence=None, **common)}
    for f in fp4_fractions:
        runs[f"fp4@{f:g}"] = _timed(geometry, rows, steps, fp4_slots=slots[f], gate=False, confidence=None, **common)
    silent, firing = fire_schedule(len(steps), 0), fire_schedule(len(steps), fire_every)
    gate_slots = slots[gate_fraction]
    runs["unarmed"] = _timed(geometry, rows, steps, fp4_slots=gate_slots, gate=False, confidence=silent, **common)
    runs["armed"] = _timed(geometry, rows, steps, fp4_slots=gate_slots, gate=True, confidence=silent, **common)
    runs["firing"] = _timed(geometry, rows, steps, fp4_slots=gate_slots, gate=True, confidence=firing, **common)
    unarmed, armed, fired = (runs[k]["steady"] for k in ("unarmed", "armed", "firing"))
    fires = fired["gate_fired"]
    live_cost = armed["step_ms"] / unarmed["step_ms"] - 1 if unarmed["step_ms"] else 0.0
    held = (armed_cost_held(geometry, rows, steps[warmup:] or steps, fp4_slots=gate_slots, device=device, graph=graph,
                            vocab=vocab, tau=tau, repetitions=repetitions, warmup=warmup, dtype=dtype)
            if repetitions else None)
    return {
        "geometry": geometry.name, "layers": geometry.num_moe_layers, "steps": len(steps), "warmup": warmup,
        "device": str(device), "dtype": str(dtype).removeprefix("torch."), "vocab": vocab, "tau": tau,
        "gate_fraction": gate_fraction, "fire_every": fire_every,
        "armed_cost": held["armed_cost_median"] if held else live_cost,
        "armed_cost_live": live_cost,  # confounded: the live manager's residency differs between the two runs
        "held": held,
        "fires": fires,
        "ms_per_fire": (fired["seconds"] - armed["seconds"]) * 1e3 / fires if fires else 0.0,
        "runs": runs,
    }
