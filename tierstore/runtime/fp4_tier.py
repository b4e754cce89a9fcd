"""The FP4 precision tier: a device pool of FP4 expert slots over a host arena of `fp4` pack rows,
with the state both promotion paths share.

- Lazy promotion (`promote_lazy`, the manager thread): hottest routed experts first, in one batch,
  evicting only victims that are cold (not routed for `fp4_cold_steps` steps) and not in the
  window being promoted from; optional hysteresis.
- Forced promotion (`force_promote`, the runner thread, gate fires): the step's routed experts
  that are not FP4, within a budget, never gated; victims never routed in the current step,
  preferring cold ones.

Every change of the pool's tables happens under `lock`, which the runner holds for the whole of a
step: no table change overlaps a forward. Forced promotions go through `DevicePool.install`
(victims unmapped before their bytes are reused, copies on the pool's own stream, waited for
before the lock is released). The manager reads its lazy rows from host RAM or the pack before it
takes `lock` (`promote_lazy`), straight into its staging in one reader batch, and copies them to
the device into reserved slots (unmapped, so no kernel reads them) with no lock held; under `lock`
it only unmaps its victims and maps the new slots (`DevicePool.reserve` / `map_reserved`), so a
step waits at most for those table updates, never for a host read or a row's device copy.

Two locks, always taken in this order: `lock` (the safe point: pool contents and tables) and
`state_lock` (host state: heat, policy, coldness, counters). The manager's bookkeeping of a window
(`observe_window`, choosing what to promote) takes only `state_lock`, so the runner's safe point
waits for the manager only while it reserves or maps slots. The runner closes a step without a
lock (`close_step` queues it; whoever next reads coldness applies it under `state_lock`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from tierstore.cache.arena import Arena, RowSource, aligned_host_buffer
from tierstore.cache.policy import get_decaying_policy
from tierstore.errors import CapacityError, PackFormatError
from tierstore.geometry import MoEGeometry
from tierstore.kernels.layout import fp4_slot_layout
from tierstore.runtime.config import RuntimeConfig
from tierstore.runtime.heat import WallClockHeat
from tierstore.runtime.pools import DevicePool
from tierstore.runtime.rows import check_row_source

log = logging.getLogger("tierstore.runtime")

Key = tuple[int, int]
HYSTERESIS_FLOOR = 4.0


@dataclass(frozen=True)
class Fp4Stats:
    slots: int
    mapped: int
    promoted_lazy: int
    promoted_forced: int
    evicted: int
    unrestored: int  # forced promotions wanted but not possible (pool full of this step's experts, or budget)
    failed_reads: int  # lazy batches dropped because their rows could not be read
    promoted_prefill: int  # promoted before a prefill layer ran (its routed set, where the pool allows)
    routed_pairs: int  # routed pairs seen by the manager
    fp4_pairs: int  # of those, pairs whose expert was FP4-resident when the window was taken

    @property
    def fp4_pair_share(self) -> float:
        return self.fp4_pairs / self.routed_pairs if self.routed_pairs else 0.0


class Fp4Tier:
    def __init__(self, geometry: MoEGeometry, source: RowSource, num_slots: int, device: torch.device | str,
                 config: RuntimeConfig, arena_slots: int = 0):
        self.geometry, self.config = geometry, config
        self.layout = fp4_slot_layout(geometry.hidden, geometry.expert_inter)
        shape = (geometry.num_moe_layers, geometry.num_experts)
        check_row_source(source, geometry, self.layout.slot_bytes, "FP4")
        device = torch.device(device)
        self.policy = get_decaying_policy(config.fp4_policy, config.fp4_half_life_s)  # begin_step: time.monotonic()
        self.lazy = getattr(self.policy, "promotes_lazily", True)
        self.pool = DevicePool(min(num_slots, geometry.total_routed_experts), self.layout.slot_bytes, *shape, device,
                               self.policy)
        self.arena = Arena(source, arena_slots, pin=device.type == "cuda")
        self.source = source
        self.heat = WallClockHeat(*shape, config.fp4_half_life_s, time.monotonic())
        self.last_seen = np.full(shape, -(1 << 40), dtype=np.int64)  # [L, E] step index of the last routing
        self.tick = 0  # steps closed (applied from `_closed`)
        self.lock = threading.RLock()  # the safe point: held by the runner for a whole step; installs take it
        self.state_lock = threading.RLock()  # host state; taken after `lock`, never before
        self._closed: deque[np.ndarray] = deque()  # routed ids of steps closed, not yet applied to last_seen
        self._arena_lock = threading.Lock()  # the arena and its row views; taken after `lock`, never before
        staged = config.fp4_promote if self.lazy else 0
        # [fp4_promote, stride] lazy rows, read straight from the source (a reader's destinations are
        # whole page-aligned strides); pinned on CUDA
        self._staging = aligned_host_buffer(staged * source.stride, device.type == "cuda").view(staged, source.stride)
        self.staged_reads = 0  # reader batches issued by lazy promotions (one per batch with a miss)
        self.promoted_lazy = self.promoted_forced = self.evicted = 0
        self.unrestored = self.failed_reads = self.promoted_prefill = self.routed_pairs = self.fp4_pairs = 0

    # -- the runner's side --------------------------------------------------------------------
    def close_step(self, routed: Iterable[Key] | np.ndarray) -> None:
        """End of a step (runner): its routed experts (keys, or dense ids int64) become warm;
        coldness counts from here."""
        if not isinstance(routed, np.ndarray):
            routed = np.asarray([self.pool.key_id(k) for k in routed], dtype=np.int64)
        self._closed.append(routed)  # no lock: the runner never waits for the manager's bookkeeping here
        if self.state_lock.acquire(blocking=False):  # apply now when free (keeps the queue short)
            try:
                self._apply_closed()
            finally:
                self.state_lock.release()

    def _apply_closed(self) -> None:
        """Apply the queued step closes to last_seen / tick (caller holds `state_lock`)."""
        while self._closed:
            self.last_seen.reshape(-1)[self._closed.popleft()] = self.tick
            self.tick += 1

    def record_need(self, routed: Iterable[Key]) -> None:
        """A gate fire: every routed expert of the step gains need (policies that track it)."""
        record = getattr(self.policy, "record_need", None)
        if record is not None:
            with self.state_lock:
                self.policy.begin_step(time.monotonic())
                record([self.pool.key_id(k) for k in routed])

    def force_promote(self, routed: Iterable[Key], protect: Iterable[Key], budget: int | None,
                      prefill: bool = False) -> int:
        """Promote the routed experts that are not FP4 (at most `budget`, None = all), never
        evicting `protect` (every expert routed in this step). Returns how many were promoted.
        `prefill`: a prefill layer's routed set, promoted where the pool allows (no shortfall kept)."""
        with self.lock, self.state_lock:
            wanted = [k for k in dict.fromkeys(routed) if not self.pool.is_resident(k)]
            if not wanted:
                return 0
            now = time.monotonic()
            heat = self.heat.values(now)
            wanted.sort(key=lambda k: -heat[k])
            take = wanted if budget is None else wanted[:max(budget, 0)]
            protect = set(protect)
            exclude = protect | self._warm_keys()
            if self.pool.capacity_for(exclude) < len(take):
                exclude = protect  # emergency: coldness is only needed against the manager's races
            room = self.pool.capacity_for(exclude)
            if not prefill:
                self.unrestored += len(wanted) - min(len(take), room)
            take = take[:room]
            if take:
                self._install(take, exclude)
                if prefill:
                    self.promoted_prefill += len(take)
                else:
                    self.promoted_forced += len(take)
            return len(take)

    # -- the manager's side -------------------------------------------------------------------
    def observe_window(self, counts: np.ndarray) -> list[Key]:
        """Take one window of routed counts (int [L, E]); returns its routed keys."""
        now = time.monotonic()
        with self.state_lock:  # not the safe-point lock: a step may run meanwhile
            self.heat.add(counts, now)
            routed = np.argwhere(counts > 0)
            resident = self.pool.mirror >= 0
            self.routed_pairs += int(counts.sum())
            self.fp4_pairs += int(counts[resident].sum())
            ids = routed[:, 0] * self.geometry.num_experts + routed[:, 1]  # [N] routed key ids, ascending
            self.policy.begin_step(now)
            self.policy.observe(np.repeat(ids, counts[counts > 0]).tolist())  # window-weighted
            self.policy.on_access_many(ids[resident[routed[:, 0], routed[:, 1]]].tolist())
            return [(int(l), int(e)) for l, e in routed]

    def promote_lazy(self, window: list[Key]) -> int:
        """Promote the window's hottest non-FP4 experts (at most `fp4_promote`), evicting only cold
        experts outside the window. Returns how many were promoted.

        Phases, so a step never waits for host reads or for the rows' device copies: choose the
        keys (`state_lock` only, host state), read their rows into the manager's own staging buffer
        (arena lock only: the runner may step meanwhile), reserve slots (tier lock: keys a forced
        promotion installed meanwhile are dropped, victims are chosen afresh and unmapped, a table
        copy), copy the rows into the reserved slots (no lock: no kernel reads them), then map them
        (tier lock, a table copy; keys a forced promotion installed meanwhile give their slots back).
        The runner's safe point waits only for the two table updates and their host bookkeeping."""
        if not self.lazy or not self.config.fp4_promote:
            return 0
        with self.state_lock:
            take = self._lazy_choice(window)
        if not take:
            return 0
        try:
            rows = self._stage(take)
        except (OSError, CapacityError, PackFormatError) as exc:
            self.failed_reads += 1
            log.warning("FP4 manager: lazy promotion of %d experts dropped: %s", len(take), exc)
            return 0
        with self.lock, self.state_lock:  # reserve: victims unmapped (a table copy), slots taken
            exclude = set(window) | self._warm_keys()
            kept = [i for i, k in enumerate(take) if not self.pool.is_resident(k)]
            kept = kept[:self.pool.capacity_for(exclude, enough=len(kept))]
            if not kept:
                return 0
            mapped_before = self.pool.num_mapped
            slots = self.pool.reserve(len(kept), exclude)
            self.evicted += mapped_before - self.pool.num_mapped
        try:  # the rows' device copies, with neither lock held: steps run meanwhile (no kernel reads these slots)
            self.pool.write_reserved([rows[i] for i in kept], slots)
        except BaseException:
            with self.lock, self.state_lock:
                self.pool.release_reserved(slots)
            raise
        with self.lock, self.state_lock:  # map what a forced promotion did not install meanwhile
            fresh = [j for j, i in enumerate(kept) if not self.pool.is_resident(take[i])]
            self.pool.release_reserved([slots[j] for j in range(len(kept)) if j not in set(fresh)])
            self.pool.map_reserved([take[kept[j]] for j in fresh], [slots[j] for j in fresh])
            self.promoted_lazy += len(fresh)
            return len(fresh)

    def _lazy_choice(self, window: list[Key]) -> list[Key]:
        heat = self.heat.values(time.monotonic())
        candidates = sorted((k for k in window if not self.pool.is_resident(k)), key=lambda k: -heat[k])
        exclude = set(window) | self._warm_keys()
        room = self.pool.capacity_for(exclude)
        take = candidates[:min(self.config.fp4_promote, room)]
        return self._past_hysteresis(take, exclude, heat)

    def _stage(self, keys: list[Key]) -> list[torch.Tensor]:
        """Rows of `keys` in the manager's staging (uint8 [row_bytes] views, in order), which no
        other fetch can overwrite. Rows the arena holds are copied from it; the others are read by
        the source straight into the staging, all in one reader batch (no pass through the arena,
        no second host copy). Host copies are numpy copies: they release the GIL and start no
        OpenMP team on the manager's thread."""
        staged = self._staging[:len(keys)]
        array = staged.numpy()  # [len(keys), stride]
        with self._arena_lock:  # the arena is not thread-safe; a forced promotion may use it meanwhile
            missing = []
            for i, key in enumerate(keys):
                if key in self.arena:
                    array[i, :self.source.row_bytes] = self.arena.fetch([key])[0].numpy()
                else:
                    missing.append(i)
            if missing:
                self.source.read_rows([keys[i] for i in missing], [memoryview(array[i]) for i in missing])
                self.staged_reads += 1
        return list(staged[:, :self.source.row_bytes])

    def _past_hysteresis(self, take: list[Key], exclude: set[Key], heat: np.ndarray) -> list[Key]:
        h = self.config.fp4_hysteresis
        displacing = len(take) - self.pool.num_free
        if not h or displacing <= 0:
            return take
        exclude_ids = {self.pool.key_id(k) for k in exclude}
        weakest = min((heat[divmod(v, self.geometry.num_experts)] for v in self.policy.eviction_order(exclude_ids)),
                      default=0.0)
        free = take[:self.pool.num_free]
        return free + [k for k in take[self.pool.num_free:] if heat[k] > h * weakest + HYSTERESIS_FLOOR]

    # -- shared -------------------------------------------------------------------------------
    def _warm_keys(self) -> set[Key]:
        """Resident experts routed within the last `fp4_cold_steps` steps (not yet evictable lazily)."""
        self._apply_closed()
        warm = self.last_seen > self.tick - 1 - self.config.fp4_cold_steps
        warm &= self.pool.mirror >= 0
        return {(int(l), int(e)) for l, e in np.argwhere(warm)}

    def _install(self, keys: list[Key], exclude: set[Key]) -> None:
        with self._arena_lock:
            self._install_rows(keys, self.arena.fetch(keys), exclude)

    def _install_rows(self, keys: list[Key], rows: list[torch.Tensor], exclude: set[Key]) -> None:
        mapped_before = self.pool.num_mapped
        self.pool.install(keys, rows, exclude)
        self.evicted += mapped_before + len(keys) - self.pool.num_mapped

    def preload(self, keys: Iterable[Key] | None = None) -> None:
        """Install `keys` (default: every expert, which needs a pool that holds them all)."""
        g = self.geometry
        keys = list(keys) if keys is not None else [(l, e) for l in range(g.num_moe_layers) for e in range(g.num_experts)]
        with self.lock, self.state_lock:
            keys = [k for k in keys if not self.pool.is_resident(k)]
            if len(keys) > self.pool.capacity_for(set(keys)):
                raise CapacityError(f"FP4 pool of {self.pool.num_slots} slots cannot hold {len(keys)} experts")
            if keys:
                self._install(keys, set(keys))

    def precision_of(self, layer: int, expert: int) -> str:
        return "fp4" if self.pool.is_resident((layer, expert)) else "2bit"

    def stats(self) -> Fp4Stats:
        with self.state_lock:
            return Fp4Stats(self.pool.num_slots, self.pool.num_mapped, self.promoted_lazy, self.promoted_forced,
                            self.evicted, self.unrestored, self.failed_reads, self.promoted_prefill,
                            self.routed_pairs, self.fp4_pairs)

    def close(self) -> None:
        self.arena.close()
        close_source = getattr(self.source, "close", None)
        if close_source is not None:
            close_source()
