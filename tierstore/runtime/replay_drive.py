"""Driving a runtime through forced routing and timing it per step (the engine of `tierstore replay`).

Each step's routing is uploaded before the clock starts and the hidden state is a fixed vector,
so what is timed is the runtime: forward (a CUDA graph when `graph`), pass-log read, fetch,
replay. The first `warmup` steps are the cold window (the pool, the arena and the kernels warm
up there); the rest is the steady window. Both are reported apart, each with its own counters,
and every step's own counters (replays, arena hit and miss rows, fetch time) are kept too, to tell
what the slow steps of a window did.

The forward ends with a stand-in for sampling, `token = argmax(hidden)` per token, which every run
computes; what the timed step does with it is its `readback`: "none" (the plain all-resident
baseline as before: forward + synchronise), "separate" (a decoder's own device-to-host copy of the
token and its sync after the step), "folded" (the forward publishes the token into the pass log,
`TieredRuntime.publish`, so the step protocol's one read brings it back; needs a runtime with
`output_words`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tierstore.runtime.engine import COUNTERS, TieredRuntime
from tierstore.runtime.graphs import capture_graphs


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
    fetch_seconds: float  # host time in fetches (on CUDA their copies finish after: copy_seconds)
    copy_seconds: float  # the copies' own time (device events on CUDA)
    arena_hit_bytes: int  # fetched rows the arena served from pinned memory
    arena_miss_bytes: int  # fetched rows read from the row source (the pack on disk)
    gate_fired: int  # steps the confidence gate fired on (0 without a gate)
    gate_replays: int
    streamed_bytes: int  # rows last passes computed from the arena (config stream_arena): bytes that missed the pool
    streamed_install_bytes: int  # rows installed after such passes (fetched too: in arena_hit_bytes)
    per_step: dict | None = None  # lists, one entry per step: ms, replays, arena_hit_rows, arena_miss_rows, pairs (1:
    # launched as a pass pair), first_missing (pairs its first pass missed: a pair's too), streamed (experts its last
    # pass computed from arena rows: config stream_arena), and PER_STEP_MS: fetch_ms
    # (host time in fetch) = arena_ms + install_ms (+ copy_wait_ms in fetch); copy_ms (the copies' device time);
    # copy_wait_ms (host blocked on copies); read_ms (pass-log reads:
    # each waits for its forward and for copies in flight); forward_ms (host time in the forward calls: on CUDA with
    # graphs their launches); prep_ms (a read's host work before its sync: policy hits, victim plans, spares)

    def as_dict(self) -> dict:
        steps = max(self.steps, 1)
        return {**self.__dict__, "step_ms": 1e3 * self.seconds / steps, "steps_per_s": self.steps / self.seconds
                if self.seconds else 0.0, "replay_rate": self.replayed_steps / steps,
                "missing_pairs_per_step": self.missing_pairs / steps,
                "fetch_gbps": self.fetched_bytes / self.fetch_seconds / 1e9 if self.fetch_seconds else 0.0,
                "copy_gbps": self.fetched_bytes / self.copy_seconds / 1e9 if self.copy_seconds else 0.0,
                "breakdown": breakdown(self.per_step)}


def breakdown(per_step: dict | None) -> dict:
    """Steps that read the pack (arena misses) vs steps served from pinned memory or the pool,
    steps with more than one replay, and the slowest step's counters."""
    if not per_step or not per_step["ms"]:
        return {}
    ms, miss = np.asarray(per_step["ms"]), np.asarray(per_step["arena_miss_rows"])
    replays = np.asarray(per_step["replays"])
    disk = miss > 0
    slowest = int(np.argmax(ms))

    def mean(values) -> float:
        return float(values.mean()) if len(values) else 0.0

    fetched = np.asarray(per_step["arena_hit_rows"]) + miss > 0
    return {"disk_steps": int(disk.sum()), "disk_step_ms": mean(ms[disk]), "no_disk_step_ms": mean(ms[~disk]),
            "arena_miss_rows_per_disk_step": mean(miss[disk]), "multi_replay_steps": int((replays > 1).sum()),
            "max_replays": int(replays.max()), "fetch_steps": int(fetched.sum()),
            "fetch_step_median_ms": {name: float(np.median(np.asarray(per_step[name])[fetched])) if fetched.any()
                                     else 0.0 for name in ("ms", *PER_STEP_MS)},
            "slowest": {k: v[slowest] for k, v in per_step.items()} | {"index": slowest},
            "by_kind": by_kind(per_step)}


def by_kind(per_step: dict) -> dict:
    """Means over the steps launched as a pass pair and over the others (config pass_pair): {"pair" | "single":
    {"steps", "ms", and each of PER_STEP_MS}}; a kind with no step is left out."""
    pairs = np.asarray(per_step["pairs"]) > 0
    out = {}
    for kind, chosen in (("pair", pairs), ("single", ~pairs)):
        if chosen.any():
            out[kind] = {"steps": int(chosen.sum())} | {name: float(np.asarray(per_step[name])[chosen].mean())
                                                       for name in ("ms", *PER_STEP_MS)}
    return out


PER_STEP_MS = ("fetch_ms", "arena_ms", "install_ms", "copy_ms", "copy_wait_ms", "read_ms", "forward_ms", "prep_ms")


def _counters(runtime: TieredRuntime) -> np.ndarray:
    """[replayed steps, first-pass missing pairs, fetched bytes, fetch ns, copy ns, arena hit rows, arena miss
    rows, gate fires, gate replays, streamed experts, streamed installs]."""
    s, a, gate = runtime.stats(), runtime.arena.stats(), runtime.gate_stats()
    return np.array([s.replayed_steps, round(s.missing_pairs_per_step * s.steps), s.fetched_bytes,
                     round(s.fetch_seconds * 1e9), round(s.copy_seconds * 1e9), a.hit_rows, a.miss_rows, gate.fired,
                     gate.replays, s.streamed_experts, s.streamed_installs], dtype=np.int64)


def _window(times: list[float], before: np.ndarray, after: np.ndarray, row_bytes: int,
            per_step: dict | None = None) -> Window:
    d = after - before
    ms = np.asarray(times) * 1e3 if times else np.zeros(1)
    return Window(len(times), float(sum(times)), float(np.percentile(ms, 50)), float(np.percentile(ms, 99)),
                  int(d[0]), int(d[1]), int(d[2]), d[3] / 1e9, d[4] / 1e9, int(d[5]) * row_bytes, int(d[6]) * row_bytes,
                  int(d[7]), int(d[8]), int(d[9]) * row_bytes, int(d[10]) * row_bytes, per_step)


def _per_step(times: list[float], marks: list[tuple]) -> dict:
    """Per-step deltas of `TieredRuntime.counters()` (marks[i] before step i, marks[-1] after the last)."""
    d = np.diff(np.asarray(marks, dtype=np.float64).reshape(len(marks), len(COUNTERS)), axis=0)  # [steps, counters]
    column = dict(zip(COUNTERS, d.T))
    out = {"ms": [round(1e3 * t, 4) for t in times]}
    out.update({name: column[name].astype(int).tolist() for name in ("replays", "arena_hit_rows", "arena_miss_rows",
                                                                    "pairs", "first_missing", "streamed")})
    out.update({name: np.round(1e3 * column[name[:-3] + "_s"], 4).tolist() for name in PER_STEP_MS})
    return out


READBACKS = ("none", "separate", "folded")


def forward_fn(runtime: TieredRuntime, x: torch.Tensor, weights: torch.Tensor, naive: bool,
               publish: bool = False) -> Callable:
    """forward(ids int64 [T, L, k]) -> (hidden [T, H], token int64 [T]): every MoE layer of the
    runtime on a residual stream, then token = argmax of each hidden row (the stand-in for sampling).
    `naive`: before each layer, one synchronous fetch per routed expert (on-demand). `publish`: the
    token goes into the pass log (`runtime.publish`)."""

    def forward(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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
        token = h.argmax(-1)  # [T]
        if publish:
            runtime.publish(token)
        return h, token

    return forward


class Graphs:
    """One captured CUDA graph of `forward` per routing shape, over a static routing buffer; with `pair`
    (config pass_pair: `pair(forward) -> runtime.pass_pair(forward, rewind)`), a graph of the pass pair over the same
    buffer, with `first` (config unwaited_first_pass: `first(forward) -> runtime.first_pass(forward)`) one of the
    first pass."""

    def __init__(self, forward: Callable, device: torch.device, pair: Callable[[Callable], Callable] | None = None,
                 first: Callable[[Callable], Callable] | None = None):
        self.forward, self.device, self.pair, self.first = forward, device, pair, first
        # shape -> (static, single, pair, first)
        self._graphs: dict[tuple, tuple[torch.Tensor, tuple, tuple | None, tuple | None]] = {}

    def capture(self, example: torch.Tensor) -> bool:
        """Capture for example's shape (after two eager warm-up passes); False when capture fails."""
        key = tuple(example.shape)
        if key in self._graphs:
            return True
        static = example.clone()
        forward = lambda: self.forward(static)  # noqa: E731
        makers = [make for make in (self.pair, self.first) if make is not None]
        captured = capture_graphs([forward] + [make(forward) for make in makers], self.device, "the replay forward")
        if captured is None:
            return False
        others = iter(captured[1:])
        pair = next(others) if self.pair is not None else None
        first = next(others) if self.first is not None else None
        self._graphs[key] = (static, captured[0], pair, first)
        return True

    def bind(self, ids: torch.Tensor) -> tuple[Callable[[], torch.Tensor], Callable[[], torch.Tensor] | None,
                                              Callable[[], torch.Tensor] | None]:
        """The forward, the pass pair and the first pass (None without `pair` / `first`) of this step: copies its
        routing into the static buffer now, replays on call."""
        static, *graphs = self._graphs[tuple(ids.shape)]
        static.copy_(ids)
        return tuple(_replayer(*graph) if graph is not None else None for graph in graphs)


def _replayer(graph: torch.cuda.CUDAGraph, out) -> Callable:
    def run():
        graph.replay()
        return out
    return run


class Readback:
    """The decoder's own readback of the token: one pinned host buffer, copy + sync."""

    def __init__(self, device: torch.device, tokens: int):
        self.device = device
        self.host = torch.empty(tokens, dtype=torch.int64, pin_memory=device.type == "cuda")

    def __call__(self, token: torch.Tensor) -> int:
        n = token.numel()
        self.host[:n].copy_(token, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return int(self.host[0])


def step_inputs(runtime: TieredRuntime, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The forced-routing forward's fixed inputs: (hidden [1, H] seeded, combine weights [1, k] uniform)."""
    device, g = runtime.device, runtime.geometry
    x = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(0)).to(device, dtype) * 0.01  # [1, H]
    weights = torch.full((1, g.top_k), 1.0 / g.top_k, device=device)  # [1, k]
    return x, weights


def captured_graphs(forward: Callable, device: torch.device, routes: list[torch.Tensor],
                    pair: Callable[[Callable], Callable] | None = None,
                    first: Callable[[Callable], Callable] | None = None) -> Graphs | None:
    """`Graphs` of `forward` (and its pair and first pass) captured for every routing shape of `routes`, or None on a
    CPU device or when a capture fails (the runs then go eager)."""
    if device.type != "cuda":
        return None
    graphs = Graphs(forward, device, pair, first)
    return graphs if all(graphs.capture(r) for r in {tuple(r.shape): r for r in routes}.values()) else None


class Driver:
    """One runtime driven through forced routing: `__init__` sets up (the forward, its graphs, the routes on the
    device), `step(i)` runs and times the i-th step, `result()` reports (see `drive`). Several drivers can take
    turns step by step (`drive_interleaved`)."""

    def __init__(self, runtime: TieredRuntime, steps: list[np.ndarray], *, warmup: int, naive: bool = False,
                 graph: bool = False, plain: bool = False, readback: str = "none", logits: torch.Tensor | None = None,
                 dtype=torch.float32):
        if readback not in READBACKS or (readback == "folded" and (plain or runtime.log.outputs is None)):
            raise ValueError(f"readback {readback!r} with plain={plain}: choose one of {READBACKS}; folded needs the "
                             "step protocol and a runtime with output_words")
        self.runtime, self.warmup, self.plain, self.readback, self.logits = runtime, warmup, plain, readback, logits
        device = self.device = runtime.device
        self.forward = forward_fn(runtime, *step_inputs(runtime, dtype), naive, publish=readback == "folded")
        self.routes = [torch.as_tensor(np.asarray(r), dtype=torch.int64).to(device) for r in steps]  # before timing
        tiered = not plain and not naive
        self.pair = (lambda f: runtime.pass_pair(f, lambda: None)) if runtime.pairs and tiered else None
        self.first = runtime.first_pass if runtime.first_passes and tiered else None
        self.graphs = (captured_graphs(self.forward, device, self.routes, self.pair, self.first)
                       if graph and not naive else None)
        self.read = Readback(device, max((r.shape[0] for r in self.routes), default=1)) if readback == "separate" \
            else None
        # a decoder's logits sit at one address (its graph's output): the gate's captured signal needs that
        self.step_logits = torch.empty_like(logits[0]) if logits is not None else None  # [T, V]
        self.times: list[float] = []
        self.tokens: list[int | None] = []
        self.marks = [_counters(runtime)]
        self.steps_marks = [runtime.counters()]
        # rows fetched while their pass ran (early_fetch), by the located path and by their own pass (gather_in_pass),
        # and the steps launched as a pass pair, before the steady window
        self.at_warmup = (0, 0, 0, 0, 0)

    def step(self, i: int) -> None:
        runtime, ids, device = self.runtime, self.routes[i], self.device
        if i == self.warmup:
            self.marks.append(_counters(runtime))
            stats = runtime.stats()
            self.at_warmup = (stats.early_fetched_rows, stats.located_rows, stats.gathered_rows, stats.pair_steps,
                              stats.wide_pairs)
        if self.step_logits is not None:
            self.step_logits.copy_(self.logits[i])  # queued before the clock starts, like a decoder's own logits
        started = time.perf_counter()
        if self.graphs is not None:
            run, run_pair, run_first = self.graphs.bind(ids)
        else:
            run = lambda ids=ids: self.forward(ids)  # noqa: E731
            run_pair = self.pair(run) if self.pair is not None else None
            run_first = self.first(run) if self.first is not None else None
        if self.plain:
            _, token = run()
            if self.read is None and device.type == "cuda":  # its own stream, as a decoder would: not the copies
                torch.cuda.current_stream(device).synchronize()  # another interleaved runtime left in flight
        elif self.step_logits is not None:
            step_logits = self.step_logits
            (_, token), outcome = runtime.step(run, lambda: None, logits_of=lambda _: step_logits,
                                               forward_pair=run_pair, forward_first=run_first)
        else:
            (_, token), outcome = runtime.step(run, lambda: None, forward_pair=run_pair, forward_first=run_first)
        if self.read is not None:
            self.tokens.append(self.read(token))
        elif self.readback == "folded":
            self.tokens.append(int(outcome.last_pass.outputs[0]))
        else:
            if not self.plain and not outcome.last_pass.read and device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # a step that read nothing ends with its forward
            self.tokens.append(None)
        self.times.append(time.perf_counter() - started)
        self.steps_marks.append(runtime.counters())

    def result(self) -> dict:
        runtime, warmup, times, marks = self.runtime, self.warmup, self.times, self.marks
        if len(marks) == 1:  # no steady window: the cold one ends here
            marks.append(_counters(runtime))
        marks.append(_counters(runtime))
        row_bytes = runtime.source.row_bytes
        final = runtime.stats()
        at = self.at_warmup
        steady_early, steady_located, steady_gathered, steady_pairs, steady_wide = (
            (final.early_fetched_rows - at[0], final.located_rows - at[1], final.gathered_rows - at[2],
             final.pair_steps - at[3], final.wide_pairs - at[4]) if len(self.routes) > warmup else (0, 0, 0, 0, 0))
        return {"graph": self.graphs is not None, "tokens": self.tokens, "steady_early_fetched_rows": steady_early,
                "steady_located_rows": steady_located, "steady_gathered_rows": steady_gathered,
                "steady_pair_steps": steady_pairs, "steady_wide_pairs": steady_wide, "pair_step_ms": final.pair_step_ms,
                "single_step_ms": final.single_step_ms,
                "cold": _window(times[:warmup], marks[0], marks[1], row_bytes,
                                _per_step(times[:warmup], self.steps_marks[:warmup + 1])),
                "steady": _window(times[warmup:], marks[1], marks[2], row_bytes,
                                  _per_step(times[warmup:], self.steps_marks[warmup:]))}


def drive(runtime: TieredRuntime, steps: list[np.ndarray], *, warmup: int, naive: bool = False, graph: bool = False,
          plain: bool = False, readback: str = "none", logits: torch.Tensor | None = None, dtype=torch.float32) -> dict:
    """Run `steps` (int [T, L, k] each) through `runtime`; {"graph": bool, "cold": Window, "steady": Window,
    "tokens": [token of each step's first row, or None without a readback]}.
    `plain`: time forward + synchronise only (with `readback` "separate": forward + the token's
    copy + sync), without the step protocol (an all-resident baseline for a runtime that holds
    every expert). `readback`: see the module doc; "folded" needs `runtime.log.outputs`. `logits`
    [steps, T, V] on the device: what the confidence gate sees at each step (synthetic confidence;
    the forward's output has no vocabulary)."""
    driver = Driver(runtime, steps, warmup=warmup, naive=naive, graph=graph, plain=plain, readback=readback,
                    logits=logits, dtype=dtype)
    for i in range(len(steps)):
        driver.step(i)
    return driver.result()


def drive_interleaved(drivers: list[Driver]) -> list[dict]:
    """Each driver's `drive` result, the drivers taking turns step by step (the order rotating every step), so the
    host's drift between runs falls on all of them alike: a side-by-side comparison of runtimes of one process."""
    steps = len(drivers[0].routes)
    if any(len(d.routes) != steps for d in drivers):
        raise ValueError("interleaved drivers need the same number of steps")
    for i in range(steps):
        for j in range(len(drivers)):
            drivers[(i + j) % len(drivers)].step(i)
    return [d.result() for d in drivers]


NOMISS_VARIANTS = ("plain", "plain_readback", "passlog_read", "step_folded", "step_separate")
UNREAD_VARIANTS = ("step_unread", "step_unread_readback")  # nomiss_overhead with an `unread` runtime


def nomiss_overhead(runtime: TieredRuntime, steps: list[np.ndarray], *, graph: bool, warmup: int = 10,
                    dtype=torch.float32, unread: TieredRuntime | None = None) -> dict:
    """What the step protocol costs when nothing misses, every variant on the same runtime (which
    holds every expert) and the same captured forward, interleaved step by step (rotating order),
    so clocks and drift hit every variant alike:

    - plain: forward + synchronise (the all-resident baseline of `run_replay`);
    - plain_readback: forward + the token's device-to-host copy + sync (a plain decoder);
    - passlog_read: forward + `PassLog.read()` (the protocol's copy, sync and parse, nothing else);
    - step_folded: `runtime.step` with the token published into the pass log (one copy, one sync);
    - step_separate: `runtime.step` + the token's own copy + sync (a decoder that does not fold).

    `unread`: a second runtime that holds every expert and does not read its passes (no `output_words`; config
    `full_pool_reads` off), its own forward captured the same way, adds two variants in the same rotation:

    - step_unread: `unread.step` + synchronise (compare with plain);
    - step_unread_readback: `unread.step` + the token's copy + sync (compare with plain_readback).

    Returns per variant mean / p50 / p99 ms over the steps after `warmup`, and each variant's mean
    minus plain and minus plain_readback in microseconds."""
    if runtime.log.outputs is None:
        raise ValueError("nomiss_overhead needs a runtime with output_words >= the tokens per step")
    device = runtime.device
    routes = [torch.as_tensor(np.asarray(r), dtype=torch.int64).to(device) for r in steps]

    def binder(of: TieredRuntime, publish: bool) -> tuple[Callable[[torch.Tensor], Callable], bool]:
        """(ids -> the step's forward of runtime `of`, whether that is a captured graph)."""
        forward = forward_fn(of, *step_inputs(of, dtype), naive=False, publish=publish)
        graphs = captured_graphs(forward, device, routes) if graph else None
        if graphs is not None:
            return (lambda ids: graphs.bind(ids)[0]), True
        return (lambda ids: (lambda: forward(ids))), False

    bind, captured = binder(runtime, publish=True)
    read = Readback(device, max(r.shape[0] for r in routes))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def plain(run):
        run()
        sync()

    def plain_readback(run):
        return read(run()[1])

    def passlog_read(run):
        run()
        return runtime.log.read()

    def step_folded(run):
        return int(runtime.step(run, lambda: None)[1].last_pass.outputs[0])

    def step_separate(run):
        return read(runtime.step(run, lambda: None)[0][1])

    variants = {name: (bind, run) for name, run in zip(NOMISS_VARIANTS, (plain, plain_readback, passlog_read,
                                                                        step_folded, step_separate))}
    if unread is not None:
        if unread.log.outputs is not None or unread.config.full_pool_reads:
            raise ValueError("the unread runtime must not read its passes: no output_words, full_pool_reads off")
        bind_unread, unread_captured = binder(unread, publish=False)
        captured = captured and unread_captured

        def step_unread(run):
            unread.step(run, lambda: None)
            sync()

        def step_unread_readback(run):
            return read(unread.step(run, lambda: None)[0][1])
        variants.update(zip(UNREAD_VARIANTS, ((bind_unread, step_unread), (bind_unread, step_unread_readback))))
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for i, ids in enumerate(routes):
        for j in range(len(names)):
            name = names[(i + j) % len(names)]
            bind_step, variant = variants[name]
            started = time.perf_counter()
            variant(bind_step(ids))
            if i >= warmup:
                times[name].append(time.perf_counter() - started)
    out: dict = {"graph": captured, "steps": max(len(routes) - warmup, 0), "variants": {}}
    for name, values in times.items():
        ms = np.asarray(values) * 1e3 if values else np.zeros(1)
        out["variants"][name] = {"mean_ms": float(ms.mean()), "p50_ms": float(np.percentile(ms, 50)),
                                 "p99_ms": float(np.percentile(ms, 99))}
    means = {name: v["mean_ms"] for name, v in out["variants"].items()}
    for name in names:
        out["variants"][name]["minus_plain_us"] = 1e3 * (means[name] - means["plain"])
        out["variants"][name]["minus_plain_readback_us"] = 1e3 * (means[name] - means["plain_readback"])
    return out
