"""Where an FP4-pool step's time goes, in one run (the diagnostic behind `gate_cost.py --split`).

Three runtimes over the same synthetic rows and routing, each base pool holding every W2 expert:
`w2` (no FP4 tier), `held` (FP4 pool preloaded with the trace's hottest experts, manager paused)
and `live` (FP4 pool filled by its live manager). Variants, timed per step:

- `w2_plain`: the W2-only forward (a CUDA graph replay) + device sync, no step protocol;
- `w2_step`: the same forward through `TieredRuntime.step` (pass-log read, no FP4 tier);
- `held_plain`: the held runtime's forward + sync: the kernels with that FP4 residency, no step;
- `held_step`: the held runtime's full step (tier lock, pass-log read, close_step, the routing
  window handed to the paused manager's host snapshot);
- `live_plain`: the live runtime's forward + sync at the residency its manager reached so far
  (manager paused for these steps): its kernels' own cost;
- `live_step`: the live runtime's full step with its manager running.

The first five are interleaved step by step (rotating order, the live manager paused and idle);
`live_step` runs in blocks of consecutive steps (the manager's dynamics need a run of steps),
alternating with the interleaved blocks, ABBA over rounds. So held_plain - w2_plain is the FP4
kernels' cost, held_step - held_plain minus (w2_step - w2_plain) the FP4 tier's step machinery,
and live_step - live_plain (same runtime, residency of the same moment) the manager's interference.
Each live block also reports how long the runner waited for the tier's lock, how long the manager
held it, what it promoted, and the FP4 share of the block's routed pairs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from tierstore.geometry import MoEGeometry
from tierstore.runtime.config import RuntimeConfig
from tierstore.runtime.engine import TieredRuntime
from tierstore.runtime.replay_drive import captured_graphs, forward_fn, step_inputs
from tierstore.runtime.replay_gate import hottest_keys
from tierstore.runtime.rows import MemoryRowSource

INTERLEAVED = ("w2_plain", "w2_step", "held_plain", "held_step", "live_plain")
VARIANTS = (*INTERLEAVED, "live_step")


class TimedLock:
    """Stands in for the tier's safe-point lock: the runner thread's waits to take it, and how
    long other threads (the manager) held it (outermost acquisitions; reentrant like the RLock)."""

    def __init__(self, lock, runner: int):
        self.lock, self.runner = lock, runner
        self.runner_wait_s = self.other_hold_s = 0.0
        self._local = threading.local()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        started = time.perf_counter()
        got = self.lock.acquire(blocking, timeout)
        if got:
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                if threading.get_ident() == self.runner:
                    self.runner_wait_s += time.perf_counter() - started
                self._local.since = time.perf_counter()
            self._local.depth = depth + 1
        return got

    def release(self) -> None:
        self._local.depth -= 1
        if self._local.depth == 0 and threading.get_ident() != self.runner:
            self.other_hold_s += time.perf_counter() - self._local.since
        self.lock.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class _Driver:
    """One runtime's forward (captured per routing shape when `graph`) and its two ways to run a step."""

    def __init__(self, runtime: TieredRuntime, routes: list[torch.Tensor], graph: bool, dtype: torch.dtype):
        self.runtime = runtime
        self.forward = forward_fn(runtime, *step_inputs(runtime, dtype), naive=False)
        self.graphs = captured_graphs(self.forward, runtime.device, routes) if graph else None

    def _bound(self, ids: torch.Tensor) -> Callable:
        return self.graphs.bind(ids)[0] if self.graphs is not None else (lambda: self.forward(ids))

    def plain(self, ids: torch.Tensor) -> float:
        started = time.perf_counter()
        self._bound(ids)()
        if self.runtime.device.type == "cuda":
            torch.cuda.synchronize(self.runtime.device)
        return time.perf_counter() - started

    def step(self, ids: torch.Tensor) -> float:
        started = time.perf_counter()
        self.runtime.step(self._bound(ids), lambda: None)
        return time.perf_counter() - started


def _ms(values: list[float]) -> dict:
    ms = np.asarray(values) * 1e3 if values else np.zeros(1)
    return {"steps": len(values), "mean_ms": float(ms.mean()), "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99)), "max_ms": float(ms.max())}


def fp4_step_split(geometry: MoEGeometry, rows: tuple[torch.Tensor, torch.Tensor], steps: list[np.ndarray], *,
                   fp4_slots: int, device, graph: bool = True, dtype: torch.dtype = torch.float32, rounds: int = 4,
                   warmup: int = 10) -> dict:
    """The split described in the module doc. `rows`: (W2 rows, FP4 rows), uint8 [L, E, bytes] each;
    `steps`: routing, int [T, L, k] per step; each block runs all of them."""
    device = torch.device(device)
    w2_rows, fp4_rows = rows
    config = RuntimeConfig(kpi_every=0, force_pool=True, force_fp4_pool=True)
    everything = geometry.total_routed_experts
    routes = [torch.as_tensor(np.asarray(r), dtype=torch.int64).to(device) for r in steps]

    def runtime(fp4: bool) -> TieredRuntime:
        extra = dict(fp4_source=MemoryRowSource(fp4_rows), fp4_slots=fp4_slots, fp4_arena_slots=fp4_slots) if fp4 else {}
        made = TieredRuntime(geometry, MemoryRowSource(w2_rows), pool_slots=everything, device=device, config=config,
                             **extra)
        made.preload()
        return made

    w2, held, live = runtime(False), runtime(True), runtime(True)
    try:
        resident = hottest_keys(geometry, steps, held.fp4.pool.num_slots)
        held.preload_fp4(resident)
        if not held.pause_fp4_manager(60):
            raise RuntimeError("the held runtime's FP4 manager did not pause")
        held_table = held.fp4.pool.mirror.copy()
        lock = live.fp4.lock = TimedLock(live.fp4.lock, threading.get_ident())
        drivers = {name: _Driver(rt, routes, graph, dtype) for name, rt in (("w2", w2), ("held", held), ("live", live))}
        runs = {"w2_plain": drivers["w2"].plain, "w2_step": drivers["w2"].step, "held_plain": drivers["held"].plain,
                "held_step": drivers["held"].step, "live_plain": drivers["live"].plain, "live_step": drivers["live"].step}
        for ids in routes[:warmup]:  # kernels, arenas; the live manager starts filling its pool here
            for name in VARIANTS:
                runs[name](ids)
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        blocks = []

        def interleaved() -> None:
            if not live.pause_fp4_manager(60):
                raise RuntimeError("the live runtime's FP4 manager did not pause")
            for i, ids in enumerate(routes):
                for j in range(len(INTERLEAVED)):
                    name = INTERLEAVED[(i + j) % len(INTERLEAVED)]
                    times[name].append(runs[name](ids))
            live.resume_fp4_manager()

        def live_block() -> None:
            live.wait_fp4_manager(60)  # windows merged during the interleaved block are consumed first
            s0, waited0, held0 = live.fp4_stats(), lock.runner_wait_s, lock.other_hold_s
            live.fp4.pool.collect()
            copy0 = live.fp4.pool.copy_seconds
            block = []
            for ids in routes:
                block.append(runs["live_step"](ids))
            live.wait_fp4_manager(60)
            live.fp4.pool.collect()
            s1 = live.fp4_stats()
            times["live_step"].extend(block)
            pairs = s1.routed_pairs - s0.routed_pairs
            blocks.append({**_ms(block), "runner_lock_wait_ms": 1e3 * (lock.runner_wait_s - waited0),
                           "manager_lock_hold_ms": 1e3 * (lock.other_hold_s - held0),
                           "promoted_lazy": s1.promoted_lazy - s0.promoted_lazy,
                           "fp4_copy_device_ms": 1e3 * (live.fp4.pool.copy_seconds - copy0),
                           "fp4_pair_share": (s1.fp4_pairs - s0.fp4_pairs) / pairs if pairs else 0.0,
                           "mapped": s1.mapped})

        for r in range(rounds):
            for part in ((interleaved, live_block) if r % 2 == 0 else (live_block, interleaved)):
                part()
        out = {name: _ms(values) for name, values in times.items()}
        means = {name: v["mean_ms"] for name, v in out.items()}
        routed = fp4_pairs = 0
        resident_set = set(resident)
        for ids in steps:
            ids = np.asarray(ids)  # [T, L, k]
            for layer in range(ids.shape[1]):
                for e in ids[:, layer].reshape(-1).tolist():
                    routed += 1
                    fp4_pairs += (layer, int(e)) in resident_set
        return {
            "device": str(device), "dtype": str(dtype).removeprefix("torch."), "graph": all(
                d.graphs is not None for d in drivers.values()) if device.type == "cuda" else False,
            "fp4_slots": fp4_slots, "steps_per_block": len(routes), "rounds": rounds, "variants": out,
            "live_blocks": blocks,
            "held": {"fp4_pair_share": fp4_pairs / routed if routed else 0.0,
                     "unchanged": bool(np.array_equal(held_table, held.fp4.pool.mirror))},
            "split_ms": {"fp4_kernels": means["held_plain"] - means["w2_plain"],
                         "step_protocol_w2": means["w2_step"] - means["w2_plain"],
                         "fp4_step_machinery": (means["held_step"] - means["held_plain"])
                         - (means["w2_step"] - means["w2_plain"]),
                         "live_kernels_vs_w2": means["live_plain"] - means["w2_plain"],
                         "manager_interference": means["live_step"] - means["live_plain"]
                         - (means["held_step"] - means["held_plain"])},
        }
    finally:
        for rt in (w2, held, live):
            rt.close()
