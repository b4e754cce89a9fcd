"""`TieredRuntime`: the device pool over the host arena over a row source (a pack), the MoE compute
that reads the pool, and the step protocol that keeps results exact.

    runtime = TieredRuntime(geometry, PackRows(...), pool_slots=..., arena_slots=..., device="cuda")
    out = runtime.moe(layer, hidden, topk_ids, topk_weights)      # called by every MoE layer
    logits, outcome = runtime.step(forward, rewind)                 # one decode step, exact
    runtime.stats(); runtime.kpi_line(); runtime.close()
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Sequence

import torch

from tierstore.cache.arena import Arena, RowSource
from tierstore.cache.policy import get_policy
from tierstore.errors import CapacityError, ConfigError, PackFormatError
from tierstore.geometry import MoEGeometry
from tierstore.kernels.layout import w2_slot_layout
from tierstore.runtime.compute import TorchExperts, TritonExperts
from tierstore.runtime.config import RuntimeConfig
from tierstore.runtime.passlog import PassLog, PassReport
from tierstore.runtime.pools import DevicePool
from tierstore.runtime.stats import RuntimeStats, StatsRecorder
from tierstore.runtime.step import StepOutcome, run_step

log = logging.getLogger("tierstore.runtime")

Key = tuple[int, int]
BACKENDS = ("auto", "torch", "triton")


def working_set_slots(geometry: MoEGeometry, tokens_per_step: int, margin: float) -> int:
    """Slots one step may need at once: margin x MoE layers x distinct experts a layer can route."""
    per_layer = min(geometry.num_experts, geometry.top_k * tokens_per_step)
    return math.ceil(margin * geometry.num_moe_layers * per_layer)


def slots_for(geometry: MoEGeometry, slot_bytes: int, *, gib: float | None = None, fraction: float | None = None) -> int:
    """Pool slots for a size in GiB or a fraction of the model's routed experts (exactly one given)."""
    if (gib is None) == (fraction is None):
        raise ConfigError("give the pool size either in GiB or as a fraction of the experts")
    if gib is not None:
        if not gib > 0:
            raise ConfigError(f"pool size must be > 0 GiB, got {gib}")
        return int(gib * 2**30) // slot_bytes
    if not 0 < fraction <= 1:
        raise ConfigError(f"pool fraction must be in (0, 1], got {fraction}")
    return max(1, round(fraction * geometry.total_routed_experts))


def check_working_set(geometry: MoEGeometry, pool_slots: int, slot_bytes: int, config: RuntimeConfig) -> None:
    need = working_set_slots(geometry, config.tokens_per_step, config.working_set_margin)
    if pool_slots >= need:
        return
    message = (f"device pool of {pool_slots} slots ({pool_slots * slot_bytes / 2**30:.3f} GiB) is below the per-step "
               f"working set of {need} slots ({config.working_set_margin} x {geometry.num_moe_layers} layers x "
               f"top-{geometry.top_k} x {config.tokens_per_step} tokens); a pool of >= {need} slots "
               f"({need * slot_bytes / 2**30:.3f} GiB) would work")
    if not config.force_pool:
        raise CapacityError(message + " (or force it)")
    log.warning("%s; forced, steps may fail or degrade", message)


class TieredRuntime:
    def __init__(self, geometry: MoEGeometry, source: RowSource, *, pool_slots: int, arena_slots: int = 0,
                 device: torch.device | str = "cpu", config: RuntimeConfig | None = None, backend: str = "auto",
                 heat_path=None, record_tokens: int = 0, on_close: Sequence[Callable[[], None]] = ()):
        self.geometry = geometry
        self.config = config or RuntimeConfig()
        self.device = torch.device(device)
        self.layout = w2_slot_layout(geometry.hidden, geometry.expert_inter)
        shape = (geometry.num_moe_layers, geometry.num_experts)
        if (source.num_layers, source.num_experts) != shape or source.row_bytes > self.layout.slot_bytes:
            raise PackFormatError(
                f"row source holds {source.num_layers} x {source.num_experts} rows of {source.row_bytes} bytes; the "
                f"model needs {shape[0]} x {shape[1]} kernel slots of <= {self.layout.slot_bytes} bytes "
                "(was the pack built with the kernel slot codec?)")
        check_working_set(geometry, pool_slots, self.layout.slot_bytes, self.config)
        self.pool = DevicePool(min(pool_slots, geometry.total_routed_experts), self.layout.slot_bytes, *shape,
                               self.device, get_policy(self.config.policy))
        self.arena = Arena(source, arena_slots, heat_path=heat_path, pin=self.device.type == "cuda")
        self.source = source
        self.log = PassLog(*shape, geometry.top_k, capacity=shape[0] * shape[1], device=self.device,
                           record_tokens=record_tokens)
        self.backend = _resolve_backend(backend, self.device)
        experts_class = TritonExperts if self.backend == "triton" else TorchExperts
        self.experts = experts_class(self.pool, self.layout, self.log, geometry.swiglu_limit)
        self._stats = StatsRecorder(self.pool.num_slots, geometry.total_routed_experts)
        self._scan = False
        self._on_close = list(on_close)
        self.last_pass: PassReport | None = None
        self.closed = False
        log.info("device pool: %d slots x %.2f MiB = %.3f GiB (%.1f%% of %d experts) on %s, backend %s; arena %d slots",
                 self.pool.num_slots, self.layout.slot_bytes / 2**20, self.pool.num_slots * self.layout.slot_bytes / 2**30,
                 100 * self.pool.num_slots / geometry.total_routed_experts, geometry.total_routed_experts,
                 self.device, self.backend, arena_slots)

    # -- the MoE layer ------------------------------------------------------------------------
    def moe(self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Routed experts of MoE layer `layer` (dense index): hidden [T, H], topk [T, k] -> [T, H]."""
        if layer == 0:
            self.log.reset()
        if self._scan:
            keys = [(layer, int(e)) for e in topk_ids.reshape(-1).unique().tolist()]
            self.fetch(keys, keys, scan=True)
        return self.experts(layer, hidden, topk_ids, topk_weights)

    # -- fetch --------------------------------------------------------------------------------
    def fetch(self, keys: Iterable[Key], protect: Iterable[Key], scan: bool = False, partial: bool = False) -> int:
        """Make `keys` resident in one batch (arena hits are zero-copy; misses read the source),
        never evicting `protect`. Returns how many were installed. Fails closed: on a read error
        nothing is mapped and the error propagates."""
        keys = [k for k in dict.fromkeys(keys) if not self.pool.is_resident(k)]
        if not keys:
            return 0
        protect = set(protect)
        room = self.pool.capacity_for(protect)
        if len(keys) > room:
            if not partial:
                raise CapacityError(
                    f"device pool of {self.pool.num_slots} slots cannot hold this step's routed experts: {len(keys)} "
                    f"more needed, {room} can be made free without evicting the {len(protect)} routed this step")
            keys = keys[:room]
            if not keys:
                return 0
        started = time.perf_counter()
        rows = self.arena.fetch(keys, scan=scan)
        self.pool.install(keys, rows, protect)
        self._stats.add_fetch(len(keys), sum(r.numel() for r in rows), time.perf_counter() - started)
        return len(keys)

    def preload(self, keys: Iterable[Key] | None = None) -> None:
        """Install `keys` (default: every expert, which needs a pool that holds them all)."""
        g = self.geometry
        keys = list(keys) if keys is not None else [(l, e) for l in range(g.num_moe_layers) for e in range(g.num_experts)]
        self.fetch(keys, keys, scan=True)

    # -- the step -----------------------------------------------------------------------------
    def step(self, forward: Callable[[], torch.Tensor], rewind: Callable[[], None], prefill: bool = False):
        """One step to its fixed point: (result of the last forward, StepOutcome). `prefill`: each MoE
        layer fetches its routed set before it runs (arena scan discipline)."""
        started = time.perf_counter()
        self._scan = prefill
        try:
            result, outcome, routed = run_step(forward, rewind, self._read_pass, self._fetch_for_step, self.config)
        except BaseException:
            self._stats.failed += 1
            raise
        finally:
            self._scan = False
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        self.pool.touch(routed, time.monotonic())
        self._stats.add_step(outcome.replays, outcome.first_pass_missing_pairs, time.perf_counter() - started,
                             outcome.tolerated, outcome.residue_pairs)
        every = self.config.kpi_every
        if every and self._stats.steps % every == 0:
            log.info(self.kpi_line(every))
        return result, outcome

    def _read_pass(self) -> PassReport:
        self.last_pass = self.log.read()
        return self.last_pass

    def _fetch_for_step(self, keys, routed, partial: bool) -> int:
        return self.fetch(keys, routed, scan=self._scan, partial=partial)

    # -- observability ------------------------------------------------------------------------
    def stats(self) -> RuntimeStats:
        arena = self.arena.stats()
        return self._stats.snapshot(arena.hit_rows, arena.miss_rows)

    def kpi_line(self, last: int = 0) -> str:
        arena = self.arena.stats()
        return self._stats.kpi_line(last, arena.hit_rows, arena.miss_rows)

    # -- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Save the arena's heat, release the pool, the pinned arena and the source's files."""
        if self.closed:
            return
        self.closed = True
        self.arena.close()
        close_source = getattr(self.source, "close", None)
        if close_source is not None:
            close_source()
        for callback in self._on_close:
            callback()
        del self.experts, self.pool, self.arena, self.log
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> TieredRuntime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ConfigError(f"unknown compute backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return backend
