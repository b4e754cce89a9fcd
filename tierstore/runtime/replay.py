"""Trace replay through the real runtime (`tierstore replay`): synthetic weights at a geometry's
real shapes in a pack, routing forced from a trace, timed against an all-resident run, a naive
on-demand baseline and the physical floor.

Each step's hidden state is fixed and its routing comes from the trace, so replays see no
second-order misses: what is measured is the fetch + replay path itself. Cold (warm-up) and
steady windows are timed apart (`replay_drive.drive`); the floor is computed on the steady one.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch

from tierstore.cache.arena import aligned_host_buffer
from tierstore.errors import TraceFormatError
from tierstore.geometry import MoEGeometry
from tierstore.io.layout import PackSpec
from tierstore.io.pack import Pack
from tierstore.io.pack_rows import PackRows
from tierstore.io.pack_writer import PackWriter
from tierstore.io.readers import make_reader
from tierstore.io.readers.choice import direct_io_supported
from tierstore.io.row_codec import row_bytes
from tierstore.runtime.config import RuntimeConfig
from tierstore.runtime.engine import TieredRuntime
from tierstore.runtime.replay_drive import Driver, drive, drive_interleaved, nomiss_overhead
from tierstore.runtime.synthetic import random_experts
from tierstore.slot_codec import KERNEL_SLOT_CODEC


def synthetic_pack_spec(geometry: MoEGeometry, seed: int, distinct: int = 4) -> PackSpec:
    segments = KERNEL_SLOT_CODEC.segments("base", geometry)
    return PackSpec(tag="base", num_layers=geometry.num_moe_layers, num_experts=geometry.num_experts,
                    row_bytes=row_bytes(segments),
                    checkpoint_id=f"synthetic-{geometry.name}-seed{seed}-tiled{distinct}",
                    abi_tag=KERNEL_SLOT_CODEC.abi_tag, zero_mode="auto", segments=segments)


def ensure_synthetic_pack(geometry: MoEGeometry, pack_dir: Path | str, seed: int = 0, distinct: int = 4) -> PackSpec:
    """A pack of random W2 experts in kernel slot layout: `distinct` random experts tiled over
    every row (`synthetic.tiled_rows`); every row is still written, checksummed and read back."""
    spec = synthetic_pack_spec(geometry, seed, distinct)
    with PackWriter(pack_dir, spec) as writer:
        done = writer.written_layers()
        if len(done) == geometry.num_moe_layers:
            return spec
        experts = random_experts(geometry, fp4=False, count=distinct, seed=seed)[:, :spec.row_bytes].numpy()
        for layer in range(geometry.num_moe_layers):
            if layer in done:
                continue
            pending = writer.begin_layer(layer)
            for expert in range(geometry.num_experts):
                pending.write_row(expert, experts[(layer * geometry.num_experts + expert) % distinct])
            pending.commit()
    return spec


def open_synthetic_rows(spec: PackSpec, pack_dir: Path | str) -> PackRows:
    pack = Pack(pack_dir, spec)
    return PackRows(pack, make_reader(pack.path, direct=direct_io_supported(pack.path)))


def trace_steps(experts: np.ndarray, steps: np.ndarray | None, layers: int, limit: int | None) -> list[np.ndarray]:
    """Routing per step, int64 [T, layers, k], from a trace's [tokens, L, k] experts and step ids."""
    if experts.shape[1] < layers:
        raise TraceFormatError(f"the trace has {experts.shape[1]} layers, the replay needs {layers}")
    ids = experts[:, :layers].astype(np.int64)
    bounds = np.arange(len(ids) + 1) if steps is None else np.flatnonzero(np.r_[True, np.diff(steps) != 0, True])
    out = [ids[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    return out[:limit] if limit else out


LAYER_MAPPINGS = ("first", "tile")
TOP_K_MAPPINGS = ("trace", "refuse")


def map_trace(trace, geometry: MoEGeometry, *, layers: str = "first",
              top_k: str = "trace") -> tuple[MoEGeometry, np.ndarray, dict]:
    """A recorded trace at a preset's shapes: (geometry the replay runs, routing int64 [tokens, L, k],
    mapping). The mapping is explicit and goes into the result (`trace_mapping`):

    - layers, `layers`="first": run layer l replays trace layer l (the trace needs at least the run's
      L layers; extra trace layers are dropped); "tile": run layer l replays trace layer l % (trace
      layers): the trace's routing repeats every (trace layers) run layers, each on its own keys;
    - experts: ids are used as-is, so the trace's expert count must not exceed the preset's; preset
      experts with ids >= the trace's count are never routed (the `touched_keys` of the result say
      how many (layer, expert) keys the replay routes at all);
    - top-k: a trace top-k above the preset's is refused (it does not fit). Below it, `top_k`="trace"
      runs the preset's shapes with the trace's top-k (each token routes to k experts of the preset's
      size, routing weights 1/k: less expert compute and fetch per token than the preset's own
      top-k); "refuse" refuses. Equal: as-is;
    - empty slots (-1) are refused: the replay forward routes every slot.

    Refusals raise TraceFormatError naming the mismatch."""
    if layers not in LAYER_MAPPINGS or top_k not in TOP_K_MAPPINGS:
        raise ValueError(f"layers {layers!r} / top_k {top_k!r}: choose from {LAYER_MAPPINGS} / {TOP_K_MAPPINGS}")
    ids = np.asarray(trace.experts)
    t_layers, t_k, t_experts = ids.shape[1], ids.shape[2], trace.num_experts
    g_layers, g_k, g_experts = geometry.num_moe_layers, geometry.top_k, geometry.num_experts
    where = f"trace ({t_layers} layers x {t_experts} experts, top-{t_k}) at {geometry.name} " \
            f"({g_layers} layers x {g_experts} experts, top-{g_k})"
    if t_experts > g_experts:
        raise TraceFormatError(f"{where}: the trace has {t_experts} experts per layer, more than the preset's "
                               f"{g_experts}; expert ids are used as-is and would not fit")
    if t_k > g_k:
        raise TraceFormatError(f"{where}: the trace's top-{t_k} does not fit the preset's top-{g_k}")
    if t_k < g_k and top_k == "refuse":
        raise TraceFormatError(f"{where}: the trace's top-{t_k} is below the preset's top-{g_k} (refused; "
                               "the 'trace' top-k mapping runs the preset's shapes at the trace's top-k)")
    if np.any(ids < 0):
        raise TraceFormatError(f"{where}: the trace has empty routing slots (-1), which the replay cannot force")
    if layers == "first":
        if t_layers < g_layers:
            raise TraceFormatError(f"{where}: the trace has {t_layers} layers, the replay needs {g_layers} (use "
                                   f"{t_layers} layers, or the 'tile' layer mapping)")
        source_layer = np.arange(g_layers)
        layer_rule = f"run layer l <- trace layer l (trace layers {g_layers}..{t_layers - 1} unused)" \
            if t_layers > g_layers else "run layer l <- trace layer l"
    else:
        source_layer = np.arange(g_layers) % t_layers
        layer_rule = f"run layer l <- trace layer l % {t_layers}"
    run_geometry = dataclasses.replace(geometry, top_k=t_k) if t_k < g_k else geometry
    mapping = {
        "trace": {"layers": t_layers, "experts": t_experts, "top_k": t_k, "tokens": int(ids.shape[0]),
                  "steps": int(len(np.unique(trace.step))) if trace.step is not None else int(ids.shape[0]),
                  "meta": {k: v for k, v in trace.meta.items() if isinstance(v, (str, int, float))}},
        "preset": {"name": geometry.name, "layers": g_layers, "experts": g_experts, "top_k": g_k},
        "layers": {"mode": layers, "rule": layer_rule, "source_layer": source_layer.tolist()},
        "experts": {"mode": "as-is", "rule": f"trace expert e -> preset expert e; preset experts {t_experts}.."
                    f"{g_experts - 1} never routed" if t_experts < g_experts else "trace expert e -> preset expert e"},
        "top_k": {"mode": top_k if t_k < g_k else "as-is", "used": t_k,
                  "rule": f"the preset's shapes at the trace's top-{t_k} (preset top-{g_k}), weights 1/{t_k}"
                  if t_k < g_k else f"top-{t_k} as-is"},
    }
    return run_geometry, ids[:, source_layer].astype(np.int64), mapping


def touched_keys(steps: list[np.ndarray], num_experts: int) -> int:
    """Distinct (layer, expert) keys the steps route (the working set a pool can usefully hold)."""
    if not steps:
        return 0
    ids = np.concatenate([np.asarray(s) for s in steps])  # [T, L, k]
    keys = ids + (np.arange(ids.shape[1], dtype=np.int64) * num_experts)[None, :, None]
    return int(len(np.unique(keys[ids >= 0])))


def host_to_device_gbps(device: torch.device, nbytes: int = 256 << 20) -> float:
    """Measured copy bandwidth from pinned host memory to `device` (plain memcpy on CPU)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 3 * nbytes / (time.perf_counter() - started) / 1e9


PROBE_BATCH_ROWS = (1, 2, 4, 8, 16, 32, 64)  # the batch sizes `source_read_ms_by_batch` times


class _ProbeRows:
    """Rows of a source for probes: page-aligned host memory for `most` rows and keys drawn at random over the
    whole file, none drawn twice until every row has been."""

    def __init__(self, source, most: int, seed: int):
        self.source = source
        self.order = np.random.default_rng(seed).permutation(source.num_layers * source.num_experts)
        self.drawn = 0
        buffer = aligned_host_buffer(most * source.stride, pin=False)
        self.dests = [memoryview(buffer[i * source.stride:(i + 1) * source.stride].numpy()) for i in range(most)]

    def timed_batch(self, rows: int) -> float:
        """Seconds to read the next `rows` keys."""
        picked = self.order[np.arange(self.drawn, self.drawn + rows) % len(self.order)]
        self.drawn += rows
        keys = [divmod(int(i), self.source.num_experts) for i in picked]
        started = time.perf_counter()
        self.source.read_rows(keys, self.dests[:rows])
        return time.perf_counter() - started


def source_read_gbps(source, rows: int = 64, batches: int = 4, seed: int = 0) -> float:
    """The read bandwidth of a row source (the pack through the runtime's reader): the best of `batches` timed
    batches of `rows` rows each, into page-aligned host memory, after one untimed batch that warms the reader (its
    threads, its ring). The rows are drawn at random over the whole file, and no batch rereads another's where the
    source has that many. The best batch, so that a floor built on it is a lower bound (one cold batch had read
    1.2-2.2 GB/s on a disk the runs themselves read at 1.65-1.84)."""
    per_batch = max(1, min(rows, source.num_layers * source.num_experts // (batches + 1)))
    probe = _ProbeRows(source, per_batch, seed)
    probe.timed_batch(per_batch)  # warms the reader
    best = min(probe.timed_batch(per_batch) for _ in range(batches))
    return per_batch * source.row_bytes / best / 1e9


def source_read_ms_by_batch(source, sizes: tuple[int, ...] = PROBE_BATCH_ROWS, batches: int = 3,
                            seed: int = 1) -> dict[int, float]:
    """The source's read time by batch size: for each of `sizes` (rows per batch) the fastest of `batches` timed
    batches, in milliseconds, after one untimed batch that warms the reader; the sizes take turns round by round,
    the rows drawn as `source_read_gbps` draws them. Sizes that would make the probe reread rows are left out."""
    total = source.num_layers * source.num_experts
    fitting = [size for size in sorted(sizes) if (batches * sum(s for s in sizes if s <= size) + size) <= total]
    if not fitting:
        return {}
    probe = _ProbeRows(source, fitting[-1], seed)
    probe.timed_batch(fitting[-1])  # warms the reader
    best = {size: float("inf") for size in fitting}
    for _ in range(batches):
        for size in fitting:
            best[size] = min(best[size], probe.timed_batch(size))
    return {size: 1e3 * seconds for size, seconds in best.items()}


def batch_read_ms(rows: int, by_batch: dict[int, float]) -> float:
    """The time to read `rows` rows in one batch from a probe's times by batch size (`source_read_ms_by_batch`):
    the probed time where `rows` was probed, linear between the probed sizes around it, and beyond the largest
    (or below the smallest) that size's time per row."""
    if rows <= 0:
        return 0.0
    if rows in by_batch:
        return by_batch[rows]
    below = [size for size in by_batch if size < rows]
    above = [size for size in by_batch if size > rows]
    if not below or not above:
        size = max(below) if below else min(above)
        return by_batch[size] * rows / size
    low, high = max(below), min(above)
    return by_batch[low] + (by_batch[high] - by_batch[low]) * (rows - low) / (high - low)


def run_read_gbps(window: dict) -> float:
    """The rate a run's own fetches read the row source in a window: its arena-miss bytes over its per-step arena
    host time (which also holds the checksums and the arena's bookkeeping, so the disk is at least this fast); 0.0
    where nothing was read."""
    seconds = 1e-3 * sum((window.get("per_step") or {}).get("arena_ms", []))
    return window["arena_miss_bytes"] / seconds / 1e9 if window["arena_miss_bytes"] and seconds > 0 else 0.0


def preload_arena(runtime: TieredRuntime, batch: int = 64) -> int:
    """Read every row the arena has room for into it (scan: free slots only), in batches, before
    the clock starts: a warm arena, as after a long run or a heat-file boot. Returns the rows read."""
    g = runtime.geometry
    keys = [(l, e) for l in range(g.num_moe_layers) for e in range(g.num_experts)][:runtime.arena.num_slots]
    for first in range(0, len(keys), batch):
        runtime.arena.fetch(keys[first:first + batch], scan=True)
    return len(keys)


def _open(geometry, source_factory, steps, *, pool_slots: int, arena_slots: int, device, config, preload: bool,
          arena_preload: bool = False, folds: bool = True) -> tuple[TieredRuntime, int]:
    """A runtime for one run, its pool preloaded (`preload`) and its arena filled (`arena_preload`): (runtime, arena
    rows preloaded). `folds`: with `output_words` for the steps' tokens (readback "folded")."""
    tokens = max((len(s) for s in steps), default=1)
    runtime = TieredRuntime(geometry, source_factory(), pool_slots=pool_slots, arena_slots=arena_slots, device=device,
                            config=config, output_words=tokens if folds else 0)
    try:
        if preload:
            runtime.preload()
        return runtime, preload_arena(runtime) if arena_preload and arena_slots else 0
    except BaseException:
        runtime.close()
        raise


def _report(runtime: TieredRuntime, out: dict, preload: bool, preloaded_rows: int, readback: str) -> dict:
    cuda_kernels = getattr(runtime.experts, "cuda_w2", None) is not None  # config cuda_w2 loaded the CUDA C++ op
    return {"graph": out["graph"], "preloaded": preload, "arena_preloaded_rows": preloaded_rows,
            "cuda_w2_kernels": cuda_kernels, "readback": readback, "tokens": out["tokens"],
            "steady_early_fetched_rows": out["steady_early_fetched_rows"],
            "steady_located_rows": out["steady_located_rows"], "steady_gathered_rows": out["steady_gathered_rows"],
            "steady_pair_steps": out["steady_pair_steps"], "steady_wide_pairs": out["steady_wide_pairs"],
            "pair_step_ms": out["pair_step_ms"],
            "single_step_ms": out["single_step_ms"],
            "cold": out["cold"].as_dict(), "steady": out["steady"].as_dict()}


def _run(geometry, source_factory, steps, *, pool_slots: int, arena_slots: int, device, config, preload: bool,
         arena_preload: bool = False, **drive_args) -> dict:
    runtime, preloaded_rows = _open(geometry, source_factory, steps, pool_slots=pool_slots, arena_slots=arena_slots,
                                    device=device, config=config, preload=preload, arena_preload=arena_preload,
                                    folds=drive_args.get("readback") == "folded")
    with runtime:
        out = drive(runtime, steps, **drive_args)
        return _report(runtime, out, preload, preloaded_rows, drive_args.get("readback", "none"))


def _run_interleaved(geometry, source_factory, steps, runs: dict[str, dict], *, device,
                     **drive_args) -> dict[str, dict]:
    """`_run` of each of `runs` (name -> its `_open` arguments pool_slots, arena_slots, config, preload,
    arena_preload, and its `Driver` arguments plain, readback), the runtimes open together and driven step by step in
    turn (`drive_interleaved`): name -> report."""
    with ExitStack() as stack:
        opened = {}
        for name, run in runs.items():
            readback = run.get("readback", "none")
            runtime, rows = _open(geometry, source_factory, steps, pool_slots=run["pool_slots"],
                                  arena_slots=run["arena_slots"], device=device, config=run["config"],
                                  preload=run["preload"], arena_preload=run.get("arena_preload", False),
                                  folds=readback == "folded")
            stack.enter_context(runtime)
            opened[name] = (runtime, rows, run)
        outs = drive_interleaved([Driver(runtime, steps, plain=run.get("plain", False),
                                         readback=run.get("readback", "none"), **drive_args)
                                  for runtime, _, run in opened.values()])
        return {name: _report(runtime, out, run["preload"], rows, run.get("readback", "none"))
                for (name, (runtime, rows, run)), out in zip(opened.items(), outs)}


def _tiered_readback(config: RuntimeConfig, full: bool) -> str:
    """The tiered run's token readback: folded into the pass-log read, except where a full pool reads nothing
    and its decoder reads the token itself."""
    return "separate" if full and not config.full_pool_reads_passes() else "folded"


def _overhead(geometry, source_factory, steps, *, device, config, graph: bool, warmup: int, dtype) -> dict:
    """`nomiss_overhead` on a full pool that folds its tokens into its reads, with a second full pool that reads no
    pass beside it (the unread variants) unless `config` reads a full pool's passes."""
    everything = geometry.total_routed_experts
    with ExitStack() as stack:
        runtime = stack.enter_context(_open(geometry, source_factory, steps, pool_slots=everything, arena_slots=0,
                                            device=device, config=config, preload=True)[0])
        unread = None
        if not config.full_pool_reads_passes():
            unread = stack.enter_context(_open(geometry, source_factory, steps, pool_slots=everything, arena_slots=0,
                                               device=device, config=config, preload=True, folds=False)[0])
        return nomiss_overhead(runtime, steps, graph=graph, warmup=min(warmup, len(steps) // 2), dtype=dtype,
                               unread=unread)


def run_replay(geometry: MoEGeometry, source_factory, steps: list[np.ndarray], *, pool_slots: int, arena_slots: int,
               device: torch.device | str, config: RuntimeConfig | None = None, warmup: int = 0,
               graph: bool = True, arena_preload: bool = False, overhead: bool = True,
               dtype: torch.dtype = torch.float32, compare: dict | None = None, compare_first: bool = False,
               interleave: bool = False) -> dict:
    """A plain all-resident run (preloaded, forward + sync, no step protocol), the same with the
    decoder's token readback (forward + copy + sync), the tiered run (token folded into the pass-log
    read; where its pool holds every expert and reads no pass, config full_pool_reads off, the token's own
    readback as in the plain decoder's) and the naive on-demand baseline (eager, LRU, token read back), of
    the same steps, each with a cold window (the first `warmup` steps) and a steady one, plus the floor
    of the steady tiered steps:

        floor = plain step + (pinned bytes / pinned H2D + arena-miss bytes / source read) per step

    pinned bytes: the bytes that missed the pool and came from the arena, fetched (arena hits) or computed by a pass
    straight from the arena (config stream_arena: streamed bytes; the installs after such passes are not misses, and
    are taken out of the arena hits: `floor_pinned_bytes`),

    with both bandwidths measured in this run (`floor_readback_step_ms`: the same on the readback
    baseline); source read is the faster of a probe after the runs (`source_read_gbps`'s best warm batch:
    `source_read_probe_gbps`) and the tiered run's own steady reads (`run_read_gbps`: `source_read_run_gbps`).
    `floor_batched_step_ms` (`tiered_over_floor_batched`) is the floor with each steady step's arena-miss rows
    charged instead at the probe's best time for one batch of that many rows (`source_read_ms_by_batch`: 1 / 2 / 4
    / ... 64 rows; `batch_read_ms`): a disk reads a batch of few rows more slowly than 64, so this floor says how near
    the reads came to what the disk does at the batch sizes the steps read (issue #5's target is on the other).
    `naive_over_floor` is the best naive / tiered ratio a tiered step at its floor could reach. A tiered pool that
    holds every expert is preloaded; `arena_preload`: the tiered and naive arenas are filled before the clock starts
    (no compulsory pack reads in the timed steps).
    `overhead` with a pool that holds every expert: also `nomiss_overhead` (variants interleaved).
    `source_factory()` returns a fresh row source per run (e.g. PackRows over the pack); `graph`:
    CUDA-graph forwards on CUDA (the naive baseline is eager by definition). `touched_keys`: the
    distinct (layer, expert) keys the steps route; `pool_over_touched`: the pool over that number.
    `dtype`: the activations' dtype (a decoder's is bfloat16; the default float32 keeps earlier runs
    comparable, and the kernels' inline-PTX paths run only for bfloat16). `compare`: config fields to
    change (e.g. {"layer_waits": False}) for a second tiered run (`tiered_flipped`, `tiered_over_flipped`,
    `compared_config`), in the same process after the naive run (with `compare_first`, before the tiered run: the
    later of two runs in a process was often the faster on the H200, so alternating the order balances it): a side
    by side of two settings. `interleave`: the runs but the naive one (the two resident runs, the tiered one and the
    compared one) are open together and take turns step by step (`drive_interleaved`, the order rotating), so the
    host's drift during the runs falls on all alike, the floor's resident step included (every pool and arena at
    once)."""
    device = torch.device(device)
    config = config or RuntimeConfig(kpi_every=0, force_pool=True)
    everything = geometry.total_routed_experts
    common = dict(device=device, config=config, warmup=warmup, dtype=dtype)
    full = pool_slots >= everything
    flipped_config = dataclasses.replace(config, **compare) if compare else None
    # name -> (_open and Driver arguments) of the timed runs but the naive one
    specs = {"resident": dict(pool_slots=everything, arena_slots=0, config=config, preload=True, plain=True),
             "resident_readback": dict(pool_slots=everything, arena_slots=0, config=config, preload=True, plain=True,
                                       readback="separate")}
    for name, run_config in (("tiered", config), ("tiered_flipped", flipped_config)):
        if run_config is not None:
            specs[name] = dict(pool_slots=pool_slots, arena_slots=arena_slots, config=run_config, preload=full,
                               arena_preload=arena_preload, readback=_tiered_readback(run_config, full))
    def separate(name: str) -> dict:
        return _run(geometry, source_factory, steps, device=device, graph=graph, warmup=warmup, dtype=dtype,
                    **specs[name])

    if interleave:
        runs = _run_interleaved(geometry, source_factory, steps, specs, device=device, graph=graph, warmup=warmup,
                                dtype=dtype)
    else:
        runs = {name: separate(name) for name in ("resident", "resident_readback")}
        if compare and compare_first:
            runs["tiered_flipped"] = separate("tiered_flipped")
        runs["tiered"] = separate("tiered")
    # the naive run never launches a pass pair: its runtime builds no pass gather (pass_pair auto on CUDA would),
    # nor streams from the arena: it fetches every routed expert before its layer (config stream_arena off); its
    # pool evicts by LRU whatever the tiered run's policy (issue #5's baseline)
    naive = dict(common, config=dataclasses.replace(config, pass_pair=False, stream_arena=False, policy="lru"))
    runs["naive"] = _run(geometry, source_factory, steps, pool_slots=pool_slots, arena_slots=arena_slots,
                         preload=full, arena_preload=arena_preload, naive=True, readback="separate", **naive)
    if compare and not compare_first and not interleave:
        runs["tiered_flipped"] = separate("tiered_flipped")
    h2d = host_to_device_gbps(device)
    probe = source_factory()
    try:
        probed = source_read_gbps(probe)
        by_batch = source_read_ms_by_batch(probe)
    finally:
        getattr(probe, "close", lambda: None)()
    steady = runs["tiered"]["steady"]
    own_read = run_read_gbps(steady)
    disk = max(probed, own_read)  # the faster of the two: the floor stays a lower bound
    per_step = max(steady["steps"], 1)
    pinned = steady["arena_hit_bytes"] - steady["streamed_install_bytes"] + steady["streamed_bytes"]
    fetch_ms = 1e3 * (pinned / (h2d * 1e9) + steady["arena_miss_bytes"] / (disk * 1e9)) / per_step
    resident_ms, readback_ms = runs["resident"]["steady"]["step_ms"], runs["resident_readback"]["steady"]["step_ms"]
    floor_ms, floor_readback_ms = resident_ms + fetch_ms, readback_ms + fetch_ms
    # the same floor with each step's pack reads charged at the probe's time for a batch of that many rows
    miss_rows = (steady.get("per_step") or {}).get("arena_miss_rows", [])
    batched_ms = (1e3 * pinned / (h2d * 1e9) + sum(batch_read_ms(r, by_batch) for r in miss_rows)) / per_step
    tiered_ms, naive_ms = steady["step_ms"], runs["naive"]["steady"]["step_ms"]

    def ratio(a: float, b: float) -> float:
        return a / b if b else 0.0

    touched = touched_keys(steps, geometry.num_experts)
    out = {
        "geometry": geometry.name, "top_k": geometry.top_k, "layers": geometry.num_moe_layers, "steps": len(steps), "warmup": warmup,
        "device": str(device), "dtype": str(dtype).removeprefix("torch."), "pool_slots": pool_slots, "coverage": pool_slots / everything,
        "touched_keys": touched, "pool_over_touched": ratio(pool_slots, touched),
        "arena_slots": arena_slots, "arena_preload": arena_preload, "h2d_gbps": h2d, "source_read_gbps": disk,
        "source_read_probe_gbps": probed, "source_read_run_gbps": own_read,
        "floor_fetch_ms": fetch_ms, "floor_pinned_bytes": pinned, "floor_step_ms": floor_ms, "floor_readback_step_ms": floor_readback_ms,
        "tiered_over_floor": ratio(tiered_ms, floor_ms), "tiered_over_floor_readback": ratio(tiered_ms, floor_readback_ms),
        "source_read_ms_by_batch": {str(rows): ms for rows, ms in by_batch.items()},
        "floor_batched_step_ms": resident_ms + batched_ms,
        "tiered_over_floor_batched": ratio(tiered_ms, resident_ms + batched_ms),
        "naive_over_tiered": ratio(naive_ms, tiered_ms), "naive_over_floor": ratio(naive_ms, floor_ms),
        "tiered_over_resident": ratio(tiered_ms, resident_ms),
        "tiered_over_resident_readback": ratio(tiered_ms, readback_ms),
        "tokens_match_resident": runs["tiered"]["tokens"] == runs["resident_readback"]["tokens"],
        "layer_waits": config.layer_waits, "copy_streams": config.copy_streams, "interleaved": interleave,
        "runs": runs,
    }
    if compare:
        out["compared_config"], out["compared_first"] = dict(compare), compare_first
        other = runs["tiered_flipped"]
        out["tiered_over_flipped"] = ratio(tiered_ms, other["steady"]["step_ms"])
        out["flipped_over_floor"] = ratio(other["steady"]["step_ms"], floor_ms)
        out["flipped_tokens_match_resident"] = other["tokens"] == runs["resident_readback"]["tokens"]
    if overhead and full:
        out["nomiss_overhead"] = _overhead(geometry, source_factory, steps, device=device, config=config, graph=graph,
                                           warmup=warmup, dtype=dtype)
    return out
