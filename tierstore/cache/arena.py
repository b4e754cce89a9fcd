"""The host arena: one pinned (or, without CUDA, page-aligned ordinary) allocation of `num_slots`
rows over a row source such as a pack, with LRU replacement (or, with `policy="freq-dense"`, the
row asked for least: `tierstore.cache.frequency_slots`) and a persisted hot set.

Contract of `fetch(keys, scan)`:
- hits return zero-copy views of arena slots; duplicate keys in a batch share one slot;
- misses take free slots, else (unless `scan`) evict the policy's first slot not used by this
  batch (the least recently used); what finds no slot is read through a staging buffer (`overflow`);
- keys are published only after all reads of the batch succeeded; on failure the batch's slots
  go back to the free list with no owner, so a failed read can never be served as a hit;
- returned views stay valid until the next `fetch` (staging) or the slot's eviction. The arena
  is not thread-safe: callers serialise fetches.

The hot set goes to the heat file in the background every `heat_every` fetches that placed rows,
and synchronously at `close()` (see tierstore.cache.heat: it never erases the hot set the arena
booted from).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from tierstore.cache.heat import HeatWriter, parse_heat
from tierstore.cache.frequency_slots import FrequencySlotTable
from tierstore.cache.slots import ARENA_POLICIES, SlotTable
from tierstore.errors import CapacityError, PackFormatError

log = logging.getLogger("tierstore.cache")

PAGE_BYTES = 4096
LATENCY_WINDOW = 2048
MIN_AUTO_SLOTS = 16

Key = tuple[int, int]


class RowSource(Protocol):
    """Where the arena's rows come from (tierstore.io.pack_rows.PackRows is one)."""

    num_layers: int
    num_experts: int
    row_bytes: int
    stride: int

    def has_layer(self, layer: int) -> bool: ...

    def read_rows(self, keys: Sequence[Key], dests: Sequence[memoryview]) -> None: ...


def available_host_bytes() -> int:
    """Host memory available to new allocations now: free memory plus what the kernel can reclaim (page cache)."""
    import psutil

    return psutil.virtual_memory().available


def arena_slots(size: str | float, stride: int, pack_bytes: int, available: int | None = None) -> int:
    """Slots for a size in GiB, or `auto`: every row of the pack when the pack takes at most half of the host memory
    `available` (default `available_host_bytes()`), else a quarter of the pack; at least 16."""
    if size == "auto":
        available = available_host_bytes() if available is None else available
        budget = pack_bytes if 2 * pack_bytes <= available else pack_bytes // 4
    else:
        try:
            gib = float(size)
        except ValueError:
            raise ValueError(f"arena size must be a number of GiB or 'auto', got {size!r}") from None
        if not gib >= 0:
            raise ValueError(f"arena size must be >= 0 GiB, got {size!r}")
        budget = int(gib * (1 << 30))
    return max(budget // stride, MIN_AUTO_SLOTS)


def aligned_host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """A page-aligned uint8 tensor [nbytes], pinned when `pin`. Pinning failure raises
    CapacityError naming a size that does fit."""
    try:
        raw = torch.empty(nbytes + PAGE_BYTES, dtype=torch.uint8, pin_memory=pin)
    except RuntimeError as exc:
        if not pin:
            raise CapacityError(f"cannot allocate {nbytes} bytes of host memory: {exc}") from None
        raise CapacityError(f"cannot pin {nbytes / 2**30:.2f} GiB of host memory; "
                            f"{_largest_pinnable(nbytes) / 2**30:.2f} GiB would fit") from None
    start = (-raw.data_ptr()) % PAGE_BYTES
    return raw[start:start + nbytes]


def _largest_pinnable(nbytes: int) -> int:
    size = nbytes // 2
    while size >= PAGE_BYTES:
        try:
            torch.empty(size, dtype=torch.uint8, pin_memory=True)  # freed at once: a probe
        except RuntimeError:
            size //= 2
            continue
        return size
    return 0


def _percentile(samples, fraction: float) -> float:
    if not samples:
        return 0.0
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


@dataclass(frozen=True)
class ArenaStats:
    hit_rows: int
    miss_rows: int
    miss_bytes: int
    overflow_rows: int
    evictions: int
    hit_p50_s: float
    hit_p99_s: float
    disk_p50_s: float
    disk_p99_s: float


class Arena:
    def __init__(self, source: RowSource, num_slots: int, heat_path: Path | str | None = None,
                 heat_every: int = 1024, preheat: bool = True, pin: bool | None = None, policy: str = "lru",
                 half_life_s: float = 60.0):
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        if policy not in ARENA_POLICIES:
            raise ValueError(f"arena policy must be one of {', '.join(ARENA_POLICIES)}, got {policy!r}")
        if not half_life_s > 0:
            raise ValueError(f"the arena policy's half_life_s must be positive, got {half_life_s}")
        self.source = source
        self.num_slots = num_slots
        self.stride = source.stride
        self.heat_path = Path(heat_path) if heat_path is not None else None
        self.heat_every = heat_every
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.memory = aligned_host_buffer(num_slots * self.stride, self.pin)  # [num_slots * stride] uint8
        # slot s's row bytes, a view made once (a hit then costs no tensor indexing)
        self._rows = self.memory.view(num_slots, self.stride)[:, :source.row_bytes].unbind(0)
        self.policy = policy
        self._table = (SlotTable(num_slots) if policy == "lru"
                       else FrequencySlotTable(num_slots, source.num_experts, half_life_s))
        # the table by key id (layer * E + expert), for `locate`: the row's host address of each id (None: not
        # here), the id of each slot (None: free); plain lists, which a few dozen lookups read fastest
        self._num_experts = source.num_experts
        self._address_of_id: list[int | None] = [None] * (source.num_layers * source.num_experts)
        # the same addresses as one array, 0 where there is no row, for the tables passes read (`address_array`)
        self._address_array = np.zeros(source.num_layers * source.num_experts, dtype=np.int64)  # [L * E]
        self._id_of_slot: list[int | None] = [None] * num_slots
        self.version = 0  # bumped whenever a row's address changes (`address_table` then differs)
        self.registered = False
        self._unregister = None
        register = getattr(source, "register_memory", None)  # optional (PackRows has it)
        if register is not None and num_slots:
            self.registered = register(self.slot_memory())
            # withdrawn at close, or when the arena is collected: never left pointing at freed memory
            self._unregister = weakref.finalize(self, register, None)
            log.info("arena slot memory %s registered with the reader", "is" if self.registered else "is not")
        self._staging = aligned_host_buffer(0, self.pin)
        self._placing_calls = 0
        self._overflow_warned = False
        self._hit_rows = self._miss_rows = self._overflow_rows = self._evictions = 0
        self._hit_latency: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._disk_latency: deque[float] = deque(maxlen=LATENCY_WINDOW)
        self._heat: HeatWriter | None = None
        if self.heat_path is not None:
            booted_from = self._read_heat()
            self._heat = HeatWriter(self.heat_path, source.num_layers, source.num_experts, booted_from, num_slots)
            if preheat and num_slots and booted_from:
                self._preheat(booted_from)

    # -- views -------------------------------------------------------------------------------
    def slot_memory(self) -> memoryview:
        """The whole slot region (registered with the source's reader when it offers that)."""
        return memoryview(self.memory.numpy())

    def _slot_view(self, slot: int) -> memoryview:
        return memoryview(self.memory[slot * self.stride:(slot + 1) * self.stride].numpy())

    def _staging_tensors(self, count: int) -> list[torch.Tensor]:
        if self._staging.numel() < count * self.stride:
            self._staging = aligned_host_buffer(max(count * self.stride, 2 * self._staging.numel()), self.pin)
        return [self._staging[i * self.stride:(i + 1) * self.stride] for i in range(count)]

    def __contains__(self, key: Key) -> bool:
        return key in self._table

    # -- fetch -------------------------------------------------------------------------------
    def _checked_keys(self, keys: Sequence[Key]) -> list[Key]:
        """`keys` as (int, int), each a row the source holds; PackFormatError at the first that is not."""
        source = self.source
        num_layers, num_experts, has_layer = source.num_layers, source.num_experts, source.has_layer
        checked = []
        for key in keys:
            layer, expert = key
            if not (0 <= layer < num_layers and 0 <= expert < num_experts):
                raise PackFormatError(f"row {key} is outside {num_layers} layers x {num_experts} experts")
            if not has_layer(layer):
                raise PackFormatError(f"layer {layer} is not available from the row source")
            checked.append((int(layer), int(expert)))
        return checked

    def fetch(self, keys: Sequence[Key], scan: bool = False,
              before_read: Callable[[], None] | None = None) -> list[torch.Tensor]:
        """Rows for `keys` as uint8 tensors [row_bytes]. `scan` (prefill): fill free slots only,
        never evict. `before_read` runs once before any row is rewritten, only when some key must be
        read from the source (a device pool waits there for copies that may still read arena rows)."""
        started = time.perf_counter()
        found = self._table.hit_many(keys)  # {key: slot}, in the order of keys
        rows = self._rows
        if len(found) == len(keys):  # every key a hit, none repeated: nothing to read or check
            self._hit_rows += len(found)
            self._hit_latency.append(time.perf_counter() - started)
            return [rows[slot] for slot in found.values()]
        busy = set(found.values())
        resident: dict[Key, torch.Tensor] = {key: rows[slot] for key, slot in found.items()}
        hit_rows = len(resident)
        # only the table's keys hit, and each was checked when it was read: the rest are checked now
        missing = self._checked_keys([key for key in dict.fromkeys(keys) if key not in resident])
        placed: list[tuple[Key, int]] = []
        overflow: list[Key] = []
        for key in missing:
            slot = self._table.take_free()
            if slot is None and not scan:
                slot = self._table.evict(busy)
                if slot is not None:
                    self._evictions += 1
                    victim = self._id_of_slot[slot]
                    self._address_of_id[victim] = self._id_of_slot[slot] = None
                    self._address_array[victim] = 0
                    self.version += 1
            if slot is None:
                overflow.append(key)
            else:
                busy.add(slot)
                placed.append((key, slot))
        if missing:
            if before_read is not None:
                before_read()
            self._read(placed, overflow, resident, scan)
        self._hit_rows += hit_rows
        self._miss_rows += len(missing)
        (self._disk_latency if missing else self._hit_latency).append(time.perf_counter() - started)
        return [resident[key] for key in keys]

    def _read(self, placed: list[tuple[Key, int]], overflow: list[Key],
              resident: dict[Key, torch.Tensor], scan: bool) -> None:
        staging = self._staging_tensors(len(overflow))
        read_keys = [key for key, _ in placed] + overflow
        dests = [self._slot_view(slot) for _, slot in placed] + [memoryview(t.numpy()) for t in staging]
        try:
            self.source.read_rows(read_keys, dests)
        except BaseException:
            for _, slot in placed:
                self._table.release(slot)
            raise
        for key, slot in placed:
            self._publish(key, slot)
            resident[key] = self._rows[slot]
        for key, tensor in zip(overflow, staging):
            resident[key] = tensor[:self.source.row_bytes]
        self._overflow_rows += len(overflow)
        if overflow and not scan and not self._overflow_warned:
            log.warning("arena of %d slots overflowed: %d rows of one batch went through staging",
                        self.num_slots, len(overflow))
            self._overflow_warned = True
        if placed:
            self._placing_calls += 1
            if self._heat is not None and self._placing_calls % self.heat_every == 0:
                self._heat.submit(self._table.hottest_first())

    def _publish(self, key: Key, slot: int) -> None:
        self._table.publish(key, slot)
        key_id = key[0] * self._num_experts + key[1]
        self._address_of_id[key_id] = address = self.memory.data_ptr() + slot * self.stride
        self._address_array[key_id] = address
        self._id_of_slot[slot] = key_id
        self.version += 1

    def locate(self, ids: Sequence[int]) -> list[int] | None:
        """Host addresses of the rows of key ids `ids` (layer * E + expert) when every one is in the
        arena, else None; changes nothing (no recency, no counts). The addresses stay valid while the
        rows do (see the module doc); `hit_ids` then records the use."""
        address_of_id = self._address_of_id
        addresses = [address_of_id[key_id] for key_id in ids]
        return None if None in addresses else addresses

    def address_table(self) -> list[int | None]:
        """Each key id's row address (None: not here), as `locate` reads it; the list itself, not a copy: read it,
        never change it. Valid until `version` changes."""
        return self._address_of_id

    def address_array(self) -> np.ndarray:
        """`address_table` as one int64 array [L * E], 0 where the arena has no row: a read-only view of the
        arena's own, for the tables a pass reads (`StreamRows`, `PassGather`). Valid until `version` changes."""
        view = self._address_array.view()
        view.flags.writeable = False
        return view

    def row_at(self, address: int) -> torch.Tensor:
        """The row (uint8 [row_bytes], a view of its slot) at a host address that `address_table` gives."""
        return self._rows[(address - self.memory.data_ptr()) // self.stride]

    def hit_ids(self, ids: Sequence[int], seconds: float = 0.0) -> None:
        """Record a use of the located rows of `ids` as `fetch` does for hits: each becomes most
        recently used, in order, and counts as a hit row (`seconds`: the lookup's host time)."""
        experts = self._num_experts
        self._table.hit_many([divmod(key_id, experts) for key_id in ids])
        self._hit_rows += len(ids)
        self._hit_latency.append(seconds)

    # -- stats -------------------------------------------------------------------------------
    def row_counts(self) -> tuple[int, int]:
        """(hit rows, miss rows) so far, without the latency percentiles of `stats()`."""
        return self._hit_rows, self._miss_rows

    def stats(self) -> ArenaStats:
        return ArenaStats(
            hit_rows=self._hit_rows, miss_rows=self._miss_rows,
            miss_bytes=self._miss_rows * self.source.row_bytes, overflow_rows=self._overflow_rows,
            evictions=self._evictions,
            hit_p50_s=_percentile(self._hit_latency, 0.50), hit_p99_s=_percentile(self._hit_latency, 0.99),
            disk_p50_s=_percentile(self._disk_latency, 0.50), disk_p99_s=_percentile(self._disk_latency, 0.99),
        )

    # -- heat --------------------------------------------------------------------------------
    def save_heat(self) -> None:
        """Write the hot set to the heat file now (atomic replace; see tierstore.cache.heat)."""
        if self._heat is not None:
            self._heat.write(self._table.hottest_first())

    def _read_heat(self) -> list[Key]:
        """The heat file's keys; [] with a warning on any problem, [] silently when it is absent."""
        try:
            return parse_heat(self.heat_path, self.source.num_layers, self.source.num_experts)
        except FileNotFoundError:
            return []
        except (PackFormatError, OSError) as exc:
            log.warning("ignoring heat file, starting with a cold arena: %s", exc)
            return []

    def _preheat(self, heat: list[Key]) -> None:
        keys = [key for key in heat if self.source.has_layer(key[0])][:self.num_slots]
        slots = [self._table.take_free() for _ in keys]
        try:
            self.source.read_rows(keys, [self._slot_view(slot) for slot in slots])
        except Exception as exc:  # any failure: a cold arena, never a half-trusted one
            log.warning("preheat from %s failed, starting with a cold arena: %s", self.heat_path, exc)
            self._table.clear()
            return
        for key, slot in reversed(list(zip(keys, slots))):  # the hottest ends most recently used
            self._publish(key, slot)

    def close(self) -> None:
        """Finish background heat writes, write the final hot set, withdraw the slot memory from
        the reader."""
        if self._heat is not None:
            self._heat.close()
        self.save_heat()
        if self._unregister is not None:
            self._unregister()
