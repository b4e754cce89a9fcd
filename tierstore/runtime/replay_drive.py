"""Driving a runtime through forced routing and timing it per step (the engine of `tierstore replay`).

Each step's routing is uploaded before the clock starts and the hidden state is a fixed vector,
so what is timed is the runtime: forward (a CUDA graph when `graph`), pass-log read, fetch,
replay. The first `warmup` steps are the cold window (the pool, the arena and the kernels warm
up there); the rest is the steady window. Both are reported apart, each with its own counters.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tierstore.runtime.engine import TieredRuntime

log = logging.getLogger("tierstore.runtime")


@dataclass(frozen=True)
class Window:
    """Counters of one window of a run (deltas over its steps)."""

    steps: int
    seconds: float
    p50_ms: float
    p99_ms: float
    replayed_steps: int
    missing_pairs: int
    fetched_bytes: int
    fetch_seconds: float
    arena_hit_bytes: int  # fetched rows the arena served from pinned memory
    arena_miss_bytes: int  # fetched rows read from the row source (the pack on disk)
    gate_fired: int  # steps the confidence gate fired on (0 without a gate)
    gate_replays: int

    def as_dict(self) -> dict:
        steps = max(self.steps, 1)
        return {**self.__dict__, "step_ms": 1e3 * self.seconds / steps, "steps_per_s": self.steps / self.seconds
                if self.seconds else 0.0, "replay_rate": self.replayed_steps / steps,
                "missing_pairs_per_step": self.missing_pairs / steps,
                "fetch_gbps": self.fetched_bytes / self.fetch_seconds / 1e9 if self.fetch_seconds else 0.0}


def _counters(runtime: TieredRuntime) -> np.ndarray:
    """[replayed steps, first-pass missing pairs, fetched bytes, fetch ns, arena hit rows, arena miss rows,
    gate fires, gate replays]."""
    s, a, gate = runtime.stats(), runtime.arena.stats(), runtime.gate_stats()
    return np.array([s.replayed_steps, round(s.missing_pairs_per_step * s.steps), s.fetched_bytes,
                     round(s.fetch_seconds * 1e9), a.hit_rows, a.miss_rows, gate.fired, gate.replays], dtype=np.int64)


def _window(times: list[float], before: np.ndarray, after: np.ndarray, row_bytes: int) -> Window:
    d = after - before
    ms = np.asarray(times) * 1e3 if times else np.zeros(1)
    return Window(len(times), float(sum(times)), float(np.percentile(ms, 50)), float(np.percentile(ms, 99)),
                  int(d[0]), int(d[1]), int(d[2]), d[3] / 1e9, int(d[4]) * row_bytes, int(d[5]) * row_bytes,
                  int(d[6]), int(d[7]))


def forward_fn(runtime: TieredRuntime, x: torch.Tensor, weights: torch.Tensor, naive: bool) -> Callable:
    """forward(ids int64 [T, L, k]) -> hidden [T, H]: every MoE layer of the runtime on a residual
    stream. `naive`: before each layer, one synchronous fetch per routed expert (on-demand)."""

    def forward(ids: torch.Tensor) -> torch.Tensor:
        tokens = ids.shape[0]
        h = x.expand(tokens, -1).contiguous()  # [T, H]
        w = weights.expand(tokens, -1)  # [T, k]
        for layer in range(ids.shape[1]):
            routed = ids[:, layer]  # [T, k]
            if naive:
                experts = [(layer, int(e)) for e in routed.unique().tolist()]
                for key in experts:
                    runtime.fetch([key], experts)
            h = h + runtime.moe(layer, h, routed, w)
        return h

    return forward


class Graphs:
    """One captured CUDA graph of `forward` per routing shape, over a static routing buffer."""

    def __init__(self, forward: Callable, device: torch.device):
        self.forward, self.device = forward, device
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}

    def capture(self, example: torch.Tensor) -> bool:
        """Capture for example's shape (after two eager warm-up passes); False when capture fails."""
        key = tuple(example.shape)
        if key in self._graphs:
            return True
        static = example.clone()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # allocations and kernel compilation outside the capture
                self.forward(static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = self.forward(static)
        except RuntimeError as exc:
            log.warning("CUDA graph capture of the replay forward failed, running eagerly: %s", exc)
            return False
        self._graphs[key] = (graph, static, out)
        return True

    def bind(self, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
        """A forward for this step: copies its routing into the static buffer now, replays on call."""
        graph, static, out = self._graphs[tuple(ids.shape)]
        static.copy_(ids)

        def run() -> torch.Tensor:
            graph.replay()
            return out

        return run


def drive(runtime: TieredRuntime, steps: list[np.ndarray], *, warmup: int, naive: bool = False, graph: bool = False,
          plain: bool = False, logits: torch.Tensor | None = None, dtype=torch.float32) -> dict:
    """Run `steps` (int [T, L, k] each) through `runtime`; {"graph": bool, "cold": Window, "steady": Window}.
    `plain`: time forward + synchronise only, without the step protocol (an all-resident baseline
    for a runtime that holds every expert). `logits` [steps, T, V] on the device: what the
    confidence gate sees at each step (synthetic confidence; the forward's output has no vocabulary)."""
    device, g = runtime.device, runtime.geometry
    x = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(0)).to(device, dtype) * 0.01  # [1, H]
    weights = torch.full((1, g.top_k), 1.0 / g.top_k, device=device)  # [1, k]
    forward = forward_fn(runtime, x, weights, naive)
    routes = [torch.as_tensor(np.asarray(r), dtype=torch.int64).to(device) for r in steps]  # uploaded before timing
    graphs = Graphs(forward, device) if graph and device.type == "cuda" and not naive else None
    if graphs is not None and not all(graphs.capture(r) for r in {tuple(r.shape): r for r in routes}.values()):
        graphs = None
    times: list[float] = []
    marks = [_counters(runtime)]
    for i, ids in enumerate(routes):
        if i == warmup:
            marks.append(_counters(runtime))
        started = time.perf_counter()
        run = graphs.bind(ids) if graphs is not None else (lambda ids=ids: forward(ids))
        if plain:
            run()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        elif logits is not None:
            runtime.step(run, lambda: None, logits_of=lambda _, i=i: logits[i])
        else:
            runtime.step(run, lambda: None)
        times.append(time.perf_counter() - started)
    if len(marks) == 1:  # no steady window: the cold one ends here
        marks.append(_counters(runtime))
    marks.append(_counters(runtime))
    row_bytes = runtime.source.row_bytes
    return {"graph": graphs is not None, "cold": _window(times[:warmup], marks[0], marks[1], row_bytes),
            "steady": _window(times[warmup:], marks[1], marks[2], row_bytes)}
