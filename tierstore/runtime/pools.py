"""The device expert pool: preallocated slots, a slot table on the device, its CPU mirror and
per-slot owners, with eviction through the policy API.

Invariants (checked by `check_coherent`): `table` (device) == `mirror` (host); slot s is owned by
(l, e) iff mirror[l, e] == s; a slot is free iff it has no owner; the policy holds exactly the
mapped keys. Bytes change only in `install` (or `install_located`, its form for the runtime's step fetch
from located arena rows, with victims planned by `plan_victims` while the pass runs), or inside a pass that
fetches for itself (config `gather_in_pass`: spares from `ahead_spares`, its mappings recorded by `map_gathered`
after its pass-log read, before anything else reads the host state); `install` runs between
launches: the copy stream first waits for the compute stream (nothing launched before still reads a victim; the
step's fetch after a pass-log read needs no wait, the read synchronised it), victims are unmapped on it
before their slots are rewritten, and the new mappings are written after the copies. The host
state changes while the copies run; `install` returns once they are done, or, with `overlap`,
at once: the compute stream then waits for them on the device (an event), so nothing launched
after `install` reads a slot before its bytes land, and the host rows must stay untouched until
`wait()` (or `idle()`). Up to `INSTALLS_IN_FLIGHT` installs may have copies in flight at once, in
order on the copy stream, each with its own staging tables: an install waits on the host only
for the install that last used its staging set.

With `layer_waits` (CUDA, implies `overlap`) the compute stream does not wait for a whole install:
each layer's reader calls `wait_layer(layer)` first, a wait on that layer's event, which an install
records after the new table and that layer's rows. The table goes first (one copy, final mapping),
then the rows in layer order, so a replay launched right after `install` runs its early layers while
the later layers' rows are still on the bus. The contract: every launch that reads the pool for a
layer follows `wait_layer(layer)` on its stream (`TieredRuntime.moe` does it; a CUDA graph captures
the waits as external event-wait nodes, so a replayed graph waits on the latest records). Layers an
install leaves alone (no new row, no victim) keep their last, completed record.

Those wait nodes are not free (on the H200 a decode pass with them took ~40 us longer, its graph launch ~20 us
longer), and a pass launched when every install's copies are done needs none. Work launched or captured inside
`unwaited()` makes no per-layer waits; before each launch of it `before_unwaited_launch()` makes the compute
stream wait once, on the device, for the installs that may still be in flight (none, the usual case: no wait).

A background filler (the FP4 manager) can keep its copies out of the safe point: `reserve` takes
slots (free ones, then victims, unmapped at once) that are then neither free nor mapped, so no
install takes them and no kernel reads them; `write_reserved` copies rows into them on a stream of
their own, with nothing held, and `map_reserved` maps them (or `release_reserved` frees them).
`reserve`, `map_reserved` and `release_reserved` change the tables and must run between forwards,
serialised with `install`; each waits for its table copy before returning.

One install costs few copies: the table goes to the device whole from a host staging table (at
most two copies: victims unmapped, then the final mapping; no per-index kernels), and rows whose
host bytes and destination slots are both contiguous (an arena or staging buffer filled in
order into free slots in order) are merged into one copy per run.
"""

from __future__ import annotations

import ctypes
import time
from collections import deque
from collections.abc import Iterable, Sequence, Set
from contextlib import contextmanager
from itertools import groupby, islice
from typing import NamedTuple

import numpy as np
import torch

from tierstore.cache.policies.lru import LRUPolicy
from tierstore.cache.policy import EvictionPolicy
from tierstore.errors import CapacityError
from tierstore.runtime.h2d import HostToDevice
from tierstore.runtime.stream_ops import StreamOps

Key = tuple[int, int]

INSTALLS_IN_FLIGHT = 2  # installs whose copies may run at once (each has its own staging tables)


class _VictimPlan(NamedTuple):
    """`plan_victims`' note: valid while the policy's version and the free slot count are these."""
    version: int
    free: int
    candidates: np.ndarray  # int64 [n] key ids, first victim first
    candidate_ids: list[int]  # the same as ints
    slots: list[int]  # their slots


class _InstallBuffers:
    """One install's host staging of the table ([0] victims unmapped, [1] final; pinned on CUDA)
    and the device events that time its copies (CUDA)."""

    def __init__(self, num_layers: int, num_experts: int, pin: bool, timed: bool):
        self.staged = [torch.empty(num_layers, num_experts, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.staged_ids = [t.numpy().reshape(-1) for t in self.staged]  # [L * E] views by key id
        self.marks = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if timed else None
        self.mark_handles: list[int] = []  # the marks' driver handles (`DevicePool` sets them: `StreamOps.handle`)
        self.streamed = False  # issued by `install_located(..., streamed=True)`: no launch waits for its copies


class DevicePool:
    def __init__(self, num_slots: int, slot_bytes: int, num_layers: int, num_experts: int,
                 device: torch.device | str, policy: EvictionPolicy, overlap: bool = False, layer_waits: bool = False,
                 copy_streams: int = 1):
        if num_slots < 1:
            raise CapacityError(f"a device pool needs at least one slot, got {num_slots}")
        if copy_streams not in (1, 2):
            raise ValueError(f"copy_streams must be 1 or 2, got {copy_streams}")
        self.device = torch.device(device)
        self.num_slots, self.slot_bytes = num_slots, slot_bytes
        self.num_layers, self.num_experts = num_layers, num_experts
        self._policy = policy
        self._deferred_hits = type(policy) is LRUPolicy  # exact class: a subclass may override the hooks
        self._hit_stamp = np.zeros(num_layers * num_experts, dtype=np.int64)  # [L * E] order of the last hit
        self._stamped = self._settled = 0  # stamps handed out / already replayed into the policy
        try:
            self.slots = torch.zeros(num_slots, slot_bytes, dtype=torch.uint8, device=self.device)  # [S, slot_bytes]
        except (RuntimeError, torch.OutOfMemoryError) as exc:
            raise CapacityError(f"cannot allocate a pool of {num_slots} slots x {slot_bytes} bytes "
                                f"({num_slots * slot_bytes / 2**30:.2f} GiB) on {self.device}: {exc}") from None
        self._slot_rows = self.slots.unbind(0)  # [S] views [slot_bytes]: no indexing per copy
        self.table = torch.full((num_layers, num_experts), -1, dtype=torch.int32, device=self.device)  # [L, E]
        self._table_bytes = self.table.numel() * self.table.element_size()
        self.mirror = np.full((num_layers, num_experts), -1, dtype=np.int32)  # [L, E]
        self.owner = np.full((num_slots, 2), -1, dtype=np.int32)  # [S, (layer, expert)]
        self.generation = np.zeros(num_slots, dtype=np.int64)  # bumped whenever a slot's bytes change
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._reserved: set[int] = set()  # slots taken by `reserve`, not mapped yet
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # the install's own lookups, resolved once: current_stream of an index-less device asks torch for the
        # current device on every call, and wait_stream makes a new event each time
        self._device_index = self._stream.device_index if self._stream is not None else None
        self._compute_mark = torch.cuda.Event() if self._stream is not None else None
        self._h2d = HostToDevice(self.device) if self._stream is not None else None  # row and table copies
        # the located installs' stream ordering through the driver, on raw handles (torch's forms cost more host time)
        self._ops = StreamOps(self.device) if self._stream is not None else None
        self._copy_handle = self._stream.cuda_stream if self._stream is not None else None
        self._compute_handle = self._ops.handle(self._compute_mark) if self._ops is not None else None
        # `write_reserved`'s copies: their own stream and timing events (they run outside the safe point)
        self._reserve_stream = torch.cuda.Stream(self.device) if self._stream is not None else None
        self._reserve_marks = ([torch.cuda.Event(enable_timing=True) for _ in range(2)]
                               if self._stream is not None else None)
        pin = self.device.type == "cuda"
        # per install in flight: host staging of the table ([0] victims unmapped, [1] final) and the copies' timing
        # events; an install takes the next set and first waits for the install that used it last
        self._installs = [_InstallBuffers(num_layers, num_experts, pin, timed=self._stream is not None)
                          for _ in range(INSTALLS_IN_FLIGHT)]
        for buffers in self._installs if self._ops is not None else ():
            buffers.mark_handles = [self._ops.handle(mark) for mark in buffers.marks]
        self._next_install = 0
        self._in_flight: deque[_InstallBuffers] = deque()  # issued on the copy stream, oldest first
        self.layer_waits = layer_waits and self._stream is not None
        self._waits_off = False  # inside `unwaited()`
        self.overlap = overlap or self.layer_waits
        # per layer: the last install's rows of that layer (and the table) landed; recorded once here, because
        # a wait on a never-recorded torch event is a no-op and would not be captured into a graph
        self._layer_ready = [torch.cuda.Event(external=True) for _ in range(num_layers)] if self.layer_waits else None
        # copy_streams 2 (with layer_waits): row copies alternate between the copy stream and a second one, so one
        # copy's set-up overlaps another's transfer; each layer then waits on one event per stream
        self._side = torch.cuda.Stream(self.device) if self.layer_waits and copy_streams == 2 else None
        self._side_ready = [torch.cuda.Event(external=True) for _ in range(num_layers)] if self._side else None
        self._side_done = torch.cuda.Event() if self._side is not None else None
        for event in (self._layer_ready or []) + (self._side_ready or []):
            event.record(torch.cuda.current_stream(self.device))
        self._layer_handles = [event.cuda_event for event in self._layer_ready] if self._layer_ready else None
        self._plan: _VictimPlan | None = None
        self.copies = 0  # row copies issued (a merged run counts once)
        self.copy_seconds = 0.0  # the copies' own time (device events on CUDA; the memcpys on CPU)
        self.wait_seconds = 0.0  # host time blocked on copies

    # -- queries ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_mapped(self) -> int:
        return self.num_slots - len(self._free) - len(self._reserved)

    def key_id(self, key: Key) -> int:
        return key[0] * self.num_experts + key[1]

    def key_ids(self, keys: Iterable[Key]) -> list[int]:
        experts = self.num_experts
        return [layer * experts + expert for layer, expert in keys]

    def slot_of(self, key: Key) -> int:
        return int(self.mirror[key])

    def is_resident(self, key: Key) -> bool:
        return self.mirror[key] >= 0

    def all_resident(self, ids: np.ndarray) -> bool:
        """Whether every key id of `ids` (int [N]) is resident."""
        return not np.count_nonzero(self.mirror.reshape(-1)[ids] < 0)

    def unmapped_ids(self, ids: Iterable[int]) -> list[int]:
        """The key ids of `ids` that are not resident, in order: dict lookups in the policy's keys, which are
        exactly the mapped ones (see the module doc), not array reads one by one."""
        mapped = self._policy.sizes
        return [key_id for key_id in ids if key_id not in mapped]

    def missing(self, keys: Iterable[Key]) -> list[Key]:
        """The keys that are not resident, in order (`is_resident` of each, without its call)."""
        mirror = self.mirror
        return [key for key in keys if mirror[key] < 0]

    def resident_keys(self) -> list[Key]:
        return [(int(l), int(e)) for l, e in self.owner if l >= 0]

    def capacity_for(self, exclude: Iterable[Key], enough: int | None = None) -> int:
        """How many new keys can be installed without evicting any of `exclude`; with `enough`,
        counting stops there (the answer is then min(capacity, enough)) instead of walking the
        whole eviction order."""
        if enough is not None and self.num_free >= enough:
            return enough
        order = self.policy.eviction_order(set(self.key_ids(exclude)))
        if enough is not None:
            order = islice(order, enough - self.num_free)
        return self.num_free + sum(1 for _ in order)

    def evictable(self, exclude: Iterable[Key], count: int, below: int | None = None) -> list[int]:
        """The first `count` key ids (fewer when there are not that many) the policy would evict
        without evicting any of `exclude`: the victims of an install that lacks `count` free slots.
        `below`: only key ids under it (the layers a running pass has finished)."""
        return self.evictable_ids(set(self.key_ids(exclude)), count, below)

    def evictable_ids(self, exclude_ids: Set[int], count: int, below: int | None = None) -> list[int]:
        """`evictable` with the excluded experts as key ids."""
        order = self.policy.eviction_order(exclude_ids)
        if below is not None:
            order = (key_id for key_id in order if key_id < below)
        return list(islice(order, count))

    # -- policy hooks ---------------------------------------------------------------------------
    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy, with every deferred hit applied."""
        self.apply_hits()
        return self._policy

    def apply_hits(self) -> None:
        """Replay the deferred hits into the policy, oldest first (`policy` does it when read)."""
        if self._stamped != self._settled:
            touched = np.flatnonzero(self._hit_stamp > self._settled)
            self._policy.on_access_many(touched[np.argsort(self._hit_stamp[touched])].tolist())
            self._settled = self._stamped

    def touch(self, keys: Iterable[Key], now: float) -> None:
        """Close a step: tell the policy what was routed and which resident keys were hit."""
        self.touch_ids(np.unique(np.asarray(self.key_ids(keys), dtype=np.int64)), now)

    def touch_ids(self, ids: np.ndarray, now: float) -> None:
        """`touch` for dense ids (int64 ascending, distinct); hits reach the policy in that order."""
        self._policy.begin_step(now)
        hits = ids[self.mirror.reshape(-1)[ids] >= 0]
        if self._deferred_hits:  # lru ignores observe(); its hits are replayed when the policy is next read
            self._hit_stamp[hits] = np.arange(self._stamped + 1, self._stamped + 1 + len(hits))
            self._stamped += len(hits)
            return
        self._policy.observe(ids.tolist())
        self._policy.on_access_many(hits.tolist())

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait until `layer`'s rows of the last install are in place (with
        `layer_waits`; otherwise nothing to do: the stream already waits for whole installs)."""
        if self._layer_ready is not None and not self._waits_off:
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(self._layer_ready[layer])
            if self._side_ready is not None:
                stream.wait_event(self._side_ready[layer])

    @contextmanager
    def unwaited(self):
        """Launches (or a capture) inside make no `wait_layer` waits; launch that work only after
        `before_unwaited_launch()` (see the module doc)."""
        self._waits_off, was = True, self._waits_off
        try:
            yield
        finally:
            self._waits_off = was

    def before_unwaited_launch(self) -> None:
        """Before launching work made inside `unwaited()`: the compute stream waits on the device for the last
        install whose copies may still run (and with it every earlier one), streamed installs left out (nothing
        waits for them); nothing when all are done."""
        self.collect()
        waited = [buffers for buffers in self._in_flight if not buffers.streamed]
        if waited:
            self._ops.wait(self._ops.current(), waited[-1].mark_handles[1])

    # -- mutation -------------------------------------------------------------------------------
    def install(self, keys: Sequence[Key], rows: Sequence[torch.Tensor], exclude: Iterable[Key],
                victims: list[int] | None = None, after_compute: bool = True, runtime_fetch: bool = False) -> None:
        """Copy host rows (uint8 [<= slot_bytes], pinned on CUDA) into slots and map them.

        Takes free slots first, then victims from the policy that are not in `exclude` (the
        step's routed set); raises CapacityError, changing nothing, when that is not enough.
        `victims`: those victims when the caller has just asked `evictable(exclude, len(keys) -
        num_free)` for them and got them all (the policy unchanged since: no second walk of its
        order). Returns when the copies are done, or with `overlap` as soon as they are issued
        (see the module doc). `after_compute` False (CUDA, `layer_waits`): the copies do not wait
        for the work launched on the compute stream, for a caller that knows no launched kernel can still read
        a victim's slot: the compute stream is idle (synchronised, nothing launched since), or a pass runs
        whose finished layers hold every victim and new key (known from the host: `PassLog.layer_seen`), when
        the table copy rewrites the running pass's later layers with the values they already hold.
        `runtime_fetch`: the caller is the runtime's fetch, whose rows are its own arena rows (views of its uint8
        host buffers, their size checked against the slots at boot by `check_row_source`) and whose keys it took
        from `missing` over distinct keys: neither is checked again (rows one by one, keys for repeats and
        residency).
        """
        if len(keys) != len(rows):
            raise ValueError(f"{len(keys)} keys but {len(rows)} rows")
        if not keys:
            return
        buffers = self._take_install_buffers()
        ids = self.key_ids(keys)
        if not runtime_fetch:
            if len(set(ids)) != len(ids) or np.count_nonzero(self.mirror.reshape(-1)[ids] >= 0):
                raise ValueError("install() takes distinct keys that are not resident")
            self._check_rows(rows)
        if victims is None:
            victims = self._victims(len(ids) - self.num_free, exclude, ids)
        victim_slots = self.mirror.reshape(-1)[victims].tolist()
        slots = self._free[len(self._free) - min(len(keys), self.num_free):][::-1] + victim_slots  # pop() order
        self._write_device(buffers, rows, slots, ids, victims, after_compute)
        self._map(ids, slots, victims, victim_slots)
        if not self.overlap:
            self.wait()

    def _check_rows(self, rows) -> None:
        for row in rows:
            if row.dtype != torch.uint8 or row.dim() != 1 or not row.is_contiguous() or not row.is_cpu:
                raise ValueError(f"rows must be contiguous 1-D uint8 host tensors, got {row.dtype} {tuple(row.shape)} "
                                 f"on {row.device}")
            if row.numel() > self.slot_bytes:
                raise CapacityError(f"row of {row.numel()} bytes does not fit a {self.slot_bytes}-byte slot")

    # -- the step's install from located rows (planned while the pass runs) ------------------------
    @property
    def installs_located(self) -> bool:
        """Whether `install_located` works here: a CPU pool, or CUDA with `layer_waits` and one copy stream."""
        return self._stream is None or (self.layer_waits and self._side is None)

    def plan_victims(self, count: int) -> None:
        """While a pass runs, before its pass-log read: note the first `count` key ids of the policy's
        eviction order (a policy with `filtered_order`) and their slots, for `planned_victims` after the read."""
        policy = self.policy
        if policy.filtered_order:
            candidates = np.fromiter(islice(policy.eviction_order(), count), dtype=np.int64)  # [<= count]
            slots = self.mirror.reshape(-1)[candidates].tolist()
            self._plan = _VictimPlan(policy.version, len(self._free), candidates, candidates.tolist(), slots)

    def planned_victims(self, excluded: np.ndarray, count: int) -> tuple[list[int], list[int]] | None:
        """(victims, their slots): what `evictable_ids` would name for `count` outside the key ids where
        `excluded` (indexed by key id, e.g. the pass log's routed counts [L * E]) is nonzero, from the plan
        without walking the policy. None, and the caller walks the policy, when the plan is gone, stale (the
        policy or the free slots changed since) or holds fewer than `count` such victims."""
        plan, self._plan = self._plan, None
        if plan is None or plan.version != self.policy.version or plan.free != len(self._free):
            return None
        victims, slots = [], []
        for key_id, slot, routed in zip(plan.candidate_ids, plan.slots, excluded[plan.candidates].tolist()):
            if not routed:
                victims.append(key_id)
                slots.append(slot)
                if len(victims) == count:
                    return victims, slots
        return None

    def install_located(self, ids: list[int], addresses: list[int], nbytes: int, victims: list[int],
                        victim_slots: list[int], streamed: bool = False) -> None:
        """`install` for the runtime's fetch right after a pass-log read (`installs_located`; nothing launched on
        the compute stream since its sync, so the copies do not wait for it): key ids `ids` (ascending, distinct,
        not resident), their rows at host `addresses` (`nbytes` <= slot_bytes each, pinned, untouched until
        `wait()`), and (`victims`, `victim_slots`) for the free slots lacking (from `planned_victims`, exactly
        that many). The first layer's rows are on the bus before the host state changes.

        `streamed` (config `stream_arena`: rows the last pass streamed from the arena, installed for later passes):
        nothing launched later waits for these copies. The victims are unmapped on the compute stream first (a
        later launch no longer reads their slots: it streams them, or misses), the copy stream waits for that, then
        the rows and, after them, the final table; a pass that reads the new mapping while the copies run finds the
        rows landed, and one that reads the old finds the expert streamed: the same bytes either way."""
        if len(victims) != len(ids) - min(len(ids), self.num_free) or len(victim_slots) != len(victims):
            raise ValueError(f"{len(ids)} rows over {self.num_free} free slots need "
                             f"{max(0, len(ids) - self.num_free)} victims, got {len(victims)}")
        if not ids:
            return
        buffers = self._take_install_buffers()
        buffers.streamed = streamed and self._stream is not None
        slots = self._free[len(self._free) - (len(ids) - len(victims)):][::-1] + victim_slots  # pop() order
        copy = self._stream
        if buffers.streamed:
            self._issue_streamed(self._located_runs(ids, slots, addresses, nbytes), ids, slots, victims, buffers)
        elif copy is None:  # CPU: the same copies at once, then the table
            started = time.perf_counter()
            for _, layer_runs in self._located_runs(ids, slots, addresses, nbytes):
                self._issue(layer_runs, None)
            self.table.copy_(self._stage_table(buffers, ids, slots, victims)[1])
            self.copy_seconds += time.perf_counter() - started
        else:
            start, end = buffers.mark_handles
            copy = self._copy_handle
            self._ops.record(start, copy)
            self._issue_by_layer(self._located_runs(ids, slots, addresses, nbytes), ids, slots, victims, buffers, copy)
            self._ops.record(end, copy)
            self._in_flight.append(buffers)
        self._map(ids, slots, victims, victim_slots)

    def _issue_streamed(self, runs_by_layer, ids: list[int], slots: list[int], victims: list[int],
                        buffers: _InstallBuffers) -> None:
        """`install_located(..., streamed=True)` on CUDA: victims unmapped on the compute stream, then on the copy
        stream (after that) every layer's runs and the final table; no layer event is recorded."""
        unmapped, final = self._stage_table(buffers, ids, slots, victims)
        ops, compute, copy = self._ops, self._ops.current(), self._copy_handle
        if unmapped is not None:
            self._copy_table(unmapped, compute)
        ops.record(self._compute_handle, compute)
        ops.wait(copy, self._compute_handle)
        start, end = buffers.mark_handles
        ops.record(start, copy)
        for _, runs in runs_by_layer:
            self._issue(runs, copy)
        self._copy_table(final, copy)
        ops.record(end, copy)
        self._in_flight.append(buffers)

    def _located_runs(self, ids: list[int], slots: list[int], addresses: list[int], nbytes: int):
        """(layer, [(first slot, host address, bytes)]) per layer of `ids` (ascending), lazily: a row continues
        the last copy when it is a full slot, the next slot and the next bytes (never across a layer)."""
        experts, full = self.num_experts, nbytes == self.slot_bytes
        layer, runs, last_slot, last_end = ids[0] // experts, [], -2, -1
        for key_id, slot, address in zip(ids, slots, addresses):
            if key_id // experts != layer:
                yield layer, runs
                layer, runs = key_id // experts, []
            elif full and slot == last_slot + 1 and address == last_end:
                first_slot, first_address, size = runs[-1]
                runs[-1] = (first_slot, first_address, size + nbytes)
                last_slot, last_end = slot, address + nbytes
                continue
            runs.append((slot, address, nbytes))
            last_slot, last_end = slot, address + nbytes
        yield layer, runs

    # -- the pass's own fetch (config gather_in_pass) -------------------------------------------
    def ahead_spares(self, count: int, exclude_slots: Set[int]) -> tuple[list[int], list[int]]:
        """(slots, victim key ids or -1) of up to `count` spares for a pass launched after the one running (config
        gather_in_pass): the free slots outside `exclude_slots` in the order `install` takes them, then the first
        experts of the policy's eviction order with their slots (from the plan of `plan_victims` while it is
        current, else a walk; only for a policy with `filtered_order`: the pass skips victims that no longer hold,
        a filter of that order). Changes nothing; `map_gathered` records what the pass used."""
        free = list(islice((slot for slot in reversed(self._free) if slot not in exclude_slots), count))
        slots, victims = free, [-1] * len(free)
        lacking = count - len(free)
        if lacking > 0 and self._policy.filtered_order:
            plan = self._plan
            if plan is not None and plan.version == self._policy.version and plan.free == len(self._free):
                candidates, their_slots = plan.candidate_ids[:lacking], plan.slots[:lacking]
            else:
                candidates = list(islice(self.policy.eviction_order(), lacking))
                their_slots = self.mirror.reshape(-1)[candidates].tolist()
            slots, victims = free + their_slots, victims + candidates
        return slots, victims

    def map_gathered(self, ids: list[int], slots: list[int], victims: list[int]) -> None:
        """The host state of what a pass mapped for itself (its table and bytes are already on the device): key
        ids `ids` into `slots`, each taken from the free list (victim -1) or from its victim, in the pass's order
        (a victim may be an expert of a later layer that the pass then gathered again into another slot)."""
        if not ids:
            return
        evicted = [(victim, slot) for victim, slot in zip(victims, slots) if victim >= 0]
        self._map(ids, slots, [victim for victim, _ in evicted], [slot for _, slot in evicted],
                  free_taken={slot for victim, slot in zip(victims, slots) if victim < 0})

    def reserve(self, count: int, exclude: Iterable[Key]) -> list[int]:
        """Take `count` slots for `write_reserved`: free ones first, then victims from the policy
        outside `exclude`, unmapped now (their table copy done on return, so a forward launched
        after this reads none of them). Raises CapacityError, changing nothing, when that is not
        enough. Between forwards, serialised with `install`."""
        if count <= 0:
            return []
        self.wait()  # no install copy may still write a victim's slot
        victims = self._victims(count - self.num_free, exclude, [])
        victim_slots = self.mirror.reshape(-1)[victims].tolist()
        take = min(count, self.num_free)
        slots = self._free[len(self._free) - take:][::-1] + victim_slots  # pop() order, then victims
        del self._free[len(self._free) - take:]
        self._reserved.update(slots)
        if self._reserve_stream is not None:  # the rows' copies come after anything launched so far
            self._reserve_stream.wait_stream(torch.cuda.current_stream(self.device))
        if victims:
            self.mirror.reshape(-1)[victims] = -1
            self.owner[victim_slots] = -1
            self.policy.on_evict_many(victims)
            self._push_table()
        return slots

    def write_reserved(self, rows: Sequence[torch.Tensor], slots: Sequence[int]) -> None:
        """Copy host rows (uint8 [<= slot_bytes], pinned on CUDA) into reserved slots; returns when
        the copies are done. Needs no safe point (see the module doc); one caller at a time."""
        if len(rows) != len(slots) or not set(slots) <= self._reserved:
            raise ValueError("write_reserved() takes one row per slot, every slot reserved")
        self._check_rows(rows)
        if self._reserve_stream is None:
            started = time.perf_counter()
            self._copy_rows(rows, slots, None)
            self.copy_seconds += time.perf_counter() - started
            return
        start, end = self._reserve_marks
        start.record(self._reserve_stream)
        self._copy_rows(rows, slots, self._reserve_stream)
        end.record(self._reserve_stream)
        started = time.perf_counter()
        end.synchronize()
        self.wait_seconds += time.perf_counter() - started
        self.copy_seconds += start.elapsed_time(end) / 1e3

    def map_reserved(self, keys: Sequence[Key], slots: Sequence[int]) -> None:
        """Map `keys` (distinct, not resident) to reserved slots holding their rows; the table copy
        is done on return. Between forwards, serialised with `install`."""
        ids = self.key_ids(keys)
        if len(ids) != len(slots) or len(set(ids)) != len(ids) or (self.mirror.reshape(-1)[ids] >= 0).any():
            raise ValueError("map_reserved() takes one distinct non-resident key per slot")
        if not set(slots) <= self._reserved:
            raise ValueError("map_reserved() maps reserved slots only")
        if not ids:
            return
        self.wait()  # the staging tables may still be read by the last install's copies
        self._reserved.difference_update(slots)
        self.mirror.reshape(-1)[ids] = slots
        self.owner[list(slots)] = keys
        self.generation[list(slots)] += 1
        self.policy.on_insert_many(ids)
        self._push_table()

    def release_reserved(self, slots: Sequence[int]) -> None:
        """Give reserved slots back to the free list (their bytes are left as they are)."""
        if not set(slots) <= self._reserved:
            raise ValueError("release_reserved() takes reserved slots only")
        self._reserved.difference_update(slots)
        self._free.extend(slots)

    def _push_table(self) -> None:
        """The device table := the mirror, done on return (a table-only change between forwards)."""
        buffers = self._take_install_buffers()  # (the caller waited: nothing is in flight)
        final, final_ids = buffers.staged[1], buffers.staged_ids[1]
        final_ids[:] = self.mirror.reshape(-1)
        if self._stream is None:
            self.table.copy_(final)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        self._copy_table(final, self._stream)
        self._stream.synchronize()

    def _victims(self, needed: int, exclude: Iterable[Key], ids: list[int]) -> list[int]:
        if needed <= 0:
            return []
        try:
            return self.policy.victims(needed, set(self.key_ids(exclude)).union(ids))
        except CapacityError:
            raise CapacityError(
                f"device pool of {self.num_slots} slots cannot take {len(ids)} more experts: "
                f"{self.num_free} free and only {self.capacity_for(exclude) - self.num_free} evictable outside "
                f"the step's routed set") from None

    def _map(self, ids: list[int], slots, victims: list[int], victim_slots, free_taken: Set[int] | None = None) -> None:
        """The host state of an install (while its copies run): key ids `ids` into `slots` (lists or int arrays),
        the free ones among them taken from the free list's end (`install`'s pop order) or, given, `free_taken`."""
        policy, mirror = self.policy, self.mirror.reshape(-1)
        if victims:
            mirror[victims] = -1
            self.owner[victim_slots] = -1
            policy.on_evict_many(victims)
        if free_taken is None:
            del self._free[len(self._free) - (len(slots) - len(victims)):]
        elif free_taken:
            self._free = [slot for slot in self._free if slot not in free_taken]
        key_ids, slot_ids = np.asarray(ids, dtype=np.int64), np.asarray(slots, dtype=np.int64)  # [N] each, once
        layers = key_ids // self.num_experts
        mirror[key_ids] = slot_ids
        self.owner[slot_ids, 0] = layers
        self.owner[slot_ids, 1] = key_ids - layers * self.num_experts
        self.generation[slot_ids] += 1
        policy.on_insert_many(ids)

    def _take_install_buffers(self) -> _InstallBuffers:
        """The next install's staging tables and events, once the install that used them last is done
        (and with it every install before it: they share the copy stream)."""
        buffers = self._installs[self._next_install]
        self._next_install = (self._next_install + 1) % len(self._installs)
        if buffers in self._in_flight:
            self._wait_until(buffers)
        buffers.streamed = False
        return buffers

    def _write_device(self, buffers: _InstallBuffers, rows, slots: list[int], ids: list[int], victims: list[int],
                      after_compute: bool = True) -> None:
        """Stage the table, issue the copies (with `overlap`, the compute stream waits for them)."""
        if self._stream is None:
            unmapped, final = self._stage_table(buffers, ids, slots, victims)
            started = time.perf_counter()
            self._copy(rows, slots, unmapped, final, None)
            self.copy_seconds += time.perf_counter() - started
            return
        # at most one current-stream lookup per install (by index: fast), the streams passed explicitly from here on
        copy, waits = self._stream, after_compute or not self.layer_waits
        # (overlap without layer waits always waits: `compute` is then also the stream that waits for `end` below)
        compute = torch.cuda.current_stream(self._device_index) if waits else None
        if waits:
            self._compute_mark.record(compute)
            copy.wait_event(self._compute_mark)
        start, end = buffers.marks
        start.record(copy)
        if self.layer_waits:
            self._copy_by_layer(rows, slots, ids, victims, buffers, copy)
        else:
            self._copy(rows, slots, *self._stage_table(buffers, ids, slots, victims), copy)
        end.record(copy)
        if self.overlap and not self.layer_waits:  # otherwise install waits on the host first
            compute.wait_event(end)
        self._in_flight.append(buffers)

    def _stage_table(self, buffers: _InstallBuffers, ids: list[int], slots: list[int],
                     victims: list[int]) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The install's tables on the host: (the current one with the victims unmapped, or None without
        victims; the final one)."""
        (unmapped, final), (unmapped_ids, final_ids) = buffers.staged, buffers.staged_ids
        final_ids[:] = self.mirror.reshape(-1)
        if victims:
            final_ids[victims] = -1
            unmapped_ids[:] = final_ids
        final_ids[ids] = slots
        return (unmapped if victims else None), final

    def _copy_by_layer(self, rows, slots: list[int], ids: list[int], victims: list[int], buffers: _InstallBuffers,
                       stream: torch.cuda.Stream) -> None:
        """`layer_waits` order on the copy stream (`_issue_by_layer`) for host row tensors. With a second copy
        stream the table goes first; the layer's row runs alternate between the two streams, each stream
        records its own event for the layer when it copied some of its rows, and the copy stream waits for
        the second one at the end (so `end` covers both). A stream that copied none of a layer's rows keeps its
        last record of that layer, from an earlier install issued before this one on the same stream (so it
        completes first)."""
        experts = self.num_experts
        order = sorted(range(len(ids)), key=ids.__getitem__)  # row indices by key id: layer order
        by_layer = groupby(order, key=lambda index: ids[index] // experts)  # lazily: the first rows go out first
        if self._side is None:
            def runs_by_layer():
                for layer, group in by_layer:
                    indices = list(group)
                    yield layer, self._row_runs([rows[i] for i in indices], [slots[i] for i in indices])
            self._issue_by_layer(runs_by_layer(), ids, slots, victims, buffers, stream.cuda_stream)
            return
        self._copy_table(self._stage_table(buffers, ids, slots, victims)[1], stream)
        for layer in self._layers_only_losing(ids, victims):
            self._layer_ready[layer].record(stream)
        side, turn = self._side, 0
        side.wait_stream(stream)  # after the compute stream (the copy stream waited for it) and the table
        for layer, group in by_layer:
            indices = list(group)
            used = [False, False]
            for run in self._row_runs([rows[i] for i in indices], [slots[i] for i in indices]):
                self._issue([run], (stream, side)[turn])
                used[turn], turn = True, 1 - turn
            if used[0]:
                self._layer_ready[layer].record(stream)
            if used[1]:
                self._side_ready[layer].record(side)
        self._side_done.record(side)
        stream.wait_event(self._side_done)

    def _issue_by_layer(self, runs_by_layer, ids, slots, victims: list[int], buffers: _InstallBuffers,
                        stream: int) -> None:
        """The `layer_waits` order on one copy stream: the runs (slot, host address, bytes) of the lowest layer
        that gets any, the final table (staged on the host while those rows are on the bus), the events of that
        layer and of the layers that only lost victims, then each later layer's runs followed by its event.
        `runs_by_layer`: (layer, runs) in ascending layer order, best lazily (the first rows go out first); `stream`:
        the copy stream's raw handle (the events are recorded through `StreamOps`). No kernel reads a slot these
        rows overwrite before the table unmaps its victim: what ran before is done (the copy stream waited for it, or
        the caller synchronised it), or, for an install during a pass (`after_compute` False), reads only unfinished
        layers, which own no victim; what runs later waits for a layer event, recorded after the table."""
        record, layer_ready = self._ops.record, self._layer_handles
        for count, (layer, runs) in enumerate(runs_by_layer):
            self._issue(runs, stream)
            if count == 0:
                self._copy_table(self._stage_table(buffers, ids, slots, victims)[1], stream)
                for victim_layer in self._layers_only_losing(ids, victims):
                    record(layer_ready[victim_layer], stream)
            record(layer_ready[layer], stream)

    def _layers_only_losing(self, ids, victims: list[int]) -> list[int]:
        """Layers that lose victims and get no row, ascending."""
        experts = self.num_experts
        return sorted({victim // experts for victim in victims} - {key_id // experts for key_id in ids})

    def wait(self) -> None:
        """Block until every install's copies are done (their host rows and the staging tables
        may then be reused); adds their device time to `copy_seconds`."""
        if self._in_flight:
            self._wait_until(self._in_flight[-1])

    def _wait_until(self, buffers: _InstallBuffers) -> None:
        """Block until the install that used `buffers` and every earlier one are done."""
        started = time.perf_counter()
        buffers.marks[1].synchronize()
        self.wait_seconds += time.perf_counter() - started
        while self._in_flight:
            done = self._in_flight.popleft()
            self._count_copies(done)
            if done is buffers:
                break

    def _count_copies(self, done: _InstallBuffers) -> None:
        start, end = done.marks
        self.copy_seconds += start.elapsed_time(end) / 1e3

    def idle(self) -> bool:
        """Whether every install's copies are done (never blocks; `collect()` first)."""
        self.collect()
        return not self._in_flight

    def collect(self) -> None:
        """Retire the installs whose copies are done (never blocks): brings `copy_seconds` up to date."""
        while self._in_flight and self._in_flight[0].marks[1].query():
            self._count_copies(self._in_flight.popleft())

    def _copy(self, rows, slots, unmapped: torch.Tensor | None, final: torch.Tensor, stream) -> None:
        if unmapped is not None:
            self._copy_table(unmapped, stream)  # unmap before the bytes are reused
        self._copy_rows(rows, slots, stream)
        self._copy_table(final, stream)

    def _copy_table(self, staged: torch.Tensor, stream: torch.cuda.Stream | int | None) -> None:
        """The device table := a staging table: on `stream` (a stream or its raw handle; asynchronous; CUDA) or at
        once (None: CPU)."""
        if stream is None:
            self.table.copy_(staged)
        else:  # same shape and dtype (`_InstallBuffers`), both contiguous
            self._h2d.copy(self.table.data_ptr(), staged.data_ptr(), self._table_bytes, stream)

    def _copy_rows(self, rows, slots, stream: torch.cuda.Stream | None) -> None:
        """Rows into slots: on `stream` through the driver (`_issue`; CUDA), or at once (None: CPU)."""
        if stream is not None:
            self._issue(self._row_runs(rows, slots), stream)
            return
        for first, count, nbytes in self._runs(rows, slots):
            dest = self._slot_rows[slots[first]]
            if count == 1:
                (dest if nbytes == self.slot_bytes else dest[:nbytes]).copy_(rows[first])
            else:
                self.slots[slots[first]:slots[first] + count].view(-1).copy_(
                    rows[first].as_strided((count * nbytes,), (1,)))
            self.copies += 1

    def _issue(self, runs, stream: torch.cuda.Stream | int | None) -> None:
        """Copies (first slot, host address, bytes) into consecutive slots from there: asynchronous on `stream` (a
        stream or its raw handle) through the driver (`HostToDevice`), where the host issues one in a few
        microseconds, faster than the copy
        engine moves a row; or at once (None: a CPU pool)."""
        base, slot_bytes = self.slots.data_ptr(), self.slot_bytes
        for slot, address, nbytes in runs:
            if stream is None:
                ctypes.memmove(base + slot * slot_bytes, address, nbytes)
            else:
                self._h2d.copy(base + slot * slot_bytes, address, nbytes, stream)
        self.copies += len(runs)

    def _row_runs(self, rows, slots) -> list[tuple[int, int, int]]:
        """`_runs` of host row tensors as (first slot, host address, bytes) copies."""
        return [(slots[first], rows[first].data_ptr(), count * nbytes) for first, count, nbytes in self._runs(rows, slots)]

    def _runs(self, rows, slots) -> list[tuple[int, int, int]]:
        """(first index, rows, row bytes) per copy: consecutive rows merge when each is a full slot,
        their host bytes are adjacent in one allocation and their slots are consecutive."""
        runs: list[list[int]] = []
        for i, row in enumerate(rows):
            if runs and slots[i] == slots[i - 1] + 1 and self._follows(rows[i - 1], row):
                runs[-1][1] += 1
            else:
                runs.append([i, 1, row.numel()])
        return [tuple(run) for run in runs]

    def _follows(self, previous: torch.Tensor, row: torch.Tensor) -> bool:
        return (previous.numel() == row.numel() == self.slot_bytes and previous.is_contiguous() and row.is_contiguous()
                and row.data_ptr() == previous.data_ptr() + self.slot_bytes
                and row.untyped_storage().data_ptr() == previous.untyped_storage().data_ptr())

    def clear(self) -> None:
        """Unmap everything (the slots' bytes are left as they are)."""
        for key in self.resident_keys():
            self.policy.on_remove(self.key_id(key))
        self.table.fill_(-1)
        self.mirror.fill(-1)
        self.owner.fill(-1)
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._reserved.clear()

    # -- invariants -----------------------------------------------------------------------------
    def check_coherent(self) -> None:
        """Raise AssertionError unless table == mirror == owners == policy (see module doc)."""
        self.wait()  # the table copy of an install may still be in flight
        table = self.table.cpu().numpy()
        assert np.array_equal(table, self.mirror), "device slot table differs from its CPU mirror"
        mapped = np.argwhere(self.mirror >= 0)
        slots = self.mirror[self.mirror >= 0]
        assert len(set(slots.tolist())) == len(slots), "two keys map to one slot"
        for (layer, expert), slot in zip(mapped, slots):
            assert tuple(self.owner[slot]) == (layer, expert), f"slot {slot} owner disagrees with the table"
        owned = int((self.owner[:, 0] >= 0).sum())
        assert owned == len(slots), "an owned slot is not in the table"
        assert not self._reserved.intersection(self._free), "a reserved slot is on the free list"
        assert sorted(self._free + sorted(self._reserved)) == np.flatnonzero(self.owner[:, 0] < 0).tolist(), \
            "free list is stale"
        assert set(self.policy.sizes) == {int(l) * self.num_experts + int(e) for l, e in mapped}, \
            "policy keys differ from the mapped keys"
