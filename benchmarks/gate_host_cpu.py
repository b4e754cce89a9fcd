"""Host cost of an armed confidence gate that does not fire, on CPU, per call (microseconds).

- `signal_us`: `gate.signal_tensor(logits)` and its copy into the runtime's host buffer (the
  work `_with_signal` adds after each forward), logits [1, --vocab];
- `run_gated_us`: `run_gated` on a step that does not fire (the decision on the host copy);
- `check_us`: the runtime's whole gate check after the step's read (`TieredRuntime._gated`:
  `run_gated`, the gate counters, the outcome);
- `step_armed_us` / `step_unarmed_us`: the median no-miss step of a small runtime (2 MoE layers,
  hidden 64, every expert resident at both tiers) with the gate armed (tau 0.6, confidence 0.99)
  and unarmed, interleaved step by step; `armed_extra_us` is their difference (CPU forward, noisy).

Micro timings are the best of --repeats runs of --calls calls (the machine is shared). Old tree
vs new: run it with PYTHONPATH set to a checkout of each.

    PYTHONPATH=. python benchmarks/gate_host_cpu.py [--vocab 256] [--calls 20000] [--repeats 7]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
import timeit

import numpy as np
import torch

from tierstore.geometry import get_preset
from tierstore.runtime import MemoryRowSource, RuntimeConfig, TieredRuntime
from tierstore.runtime.gated_step import run_gated
from tierstore.runtime.replay_drive import forward_fn
from tierstore.runtime.replay_gate import confidence_logits, fire_schedule
from tierstore.runtime.synthetic import tiled_rows


def per_call_us(fn, calls: int, repeats: int) -> float:
    return 1e6 * min(timeit.repeat(fn, number=calls, repeat=repeats)) / calls


def small_runtime() -> tuple[TieredRuntime, list[np.ndarray]]:
    g = dataclasses.replace(get_preset("ds-v2-lite").with_layers(2), hidden=64, expert_inter=64)
    rng = np.random.default_rng(0)
    steps = [np.asarray([rng.choice(g.num_experts, g.top_k, replace=False) for _ in range(2)])[None]
             for _ in range(50)]  # [1, L, k] each
    config = RuntimeConfig(kpi_every=0, force_pool=True, force_fp4_pool=True, gate=True, gate_tau=0.6,
                           fp4_policy="need")
    runtime = TieredRuntime(g, MemoryRowSource(tiled_rows(g, fp4=False)), pool_slots=g.total_routed_experts,
                            config=config, fp4_source=MemoryRowSource(tiled_rows(g, fp4=True)),
                            fp4_slots=g.total_routed_experts, fp4_arena_slots=g.total_routed_experts)
    runtime.preload()
    runtime.preload_fp4()
    return runtime, steps


def step_costs(runtime: TieredRuntime, steps: list[np.ndarray], logits: torch.Tensor, reps: int) -> dict:
    """Median no-miss step armed and unarmed, the two interleaved step by step (order alternating)."""
    g, gate, times = runtime.geometry, runtime.gate, {True: [], False: []}
    forward = forward_fn(runtime, torch.full((1, g.hidden), 0.01), torch.full((1, g.top_k), 1.0 / g.top_k), False)
    routes = [torch.as_tensor(ids) for ids in steps]
    for rep in range(reps):
        for i, ids in enumerate(routes):
            for armed in ((True, False) if (rep + i) % 2 else (False, True)):
                runtime.gate = gate if armed else None
                started = time.perf_counter()
                runtime.step(lambda ids=ids: forward(ids), lambda: None, logits_of=lambda _, i=i: logits[i])
                times[armed].append(1e6 * (time.perf_counter() - started))
    runtime.gate = gate
    armed, unarmed = statistics.median(times[True]), statistics.median(times[False])
    return {"step_armed_us": armed, "step_unarmed_us": unarmed, "armed_extra_us": armed - unarmed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--step-reps", type=int, default=40, help="passes over the 50 steps, armed and unarmed")
    args = parser.parse_args()
    torch.set_num_threads(1)
    runtime, steps = small_runtime()
    with runtime:
        logits = confidence_logits(fire_schedule(len(steps), 0), 1, args.vocab, "cpu")
        runtime.step(lambda: None, lambda: None, logits_of=lambda _: logits[0])  # fills the host copy
        gate, host = runtime.gate, runtime._gate_signal
        first = runtime.step(lambda: None, lambda: None, logits_of=lambda _: logits[0])
        assert first[1].gate is None, "the gate fired"
        gated = dict(gate=gate, logits_of=lambda _: logits[0], rerun=None, force_promote=None, record_need=None,
                     is_fp4=None, budget=64, fp_max=3, signal_of=lambda: float(host[0]))
        result = {
            "signal_us": per_call_us(lambda: host.copy_(gate.signal_tensor(logits[0]), non_blocking=True),
                                     args.calls, args.repeats),
            "run_gated_us": per_call_us(lambda: run_gated(first, **gated), args.calls, args.repeats),
            "check_us": per_call_us(lambda: runtime._gated(first, None, None, lambda _: logits[0], set()),
                                    args.calls, args.repeats),
            **step_costs(runtime, steps, logits, args.step_reps),
        }
    print(json.dumps({k: round(v, 3) for k, v in result.items()}))


if __name__ == "__main__":
    main()
