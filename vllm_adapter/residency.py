"""Where each layer's experts live on the device: all resident, or an expert cache shared by every
MoE layer of the process with the 2-bit rows held in host memory.

Eager execution fetches a call's missing experts before computing it (`ensure_resident`), so no
pair is ever served as a miss. Graph execution computes with the tables as they are; the
missing (layer, expert) keys are recorded and `resolve_misses` (called by the model runner
between the forward and its replay) fetches them all in one batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tierstore.cache.slots import SlotTable
from tierstore.errors import CapacityError, ConfigError
from tierstore.units import format_bytes


@dataclass
class LayerSlots:
    """A layer's view of a pool: its slot table int32 [1, E] and the pool's slot tensors."""

    name: str
    table: torch.Tensor  # [1, E] int32, -1 = not resident
    slots: tuple[torch.Tensor, ...]  # each [S, ...]


def resident_layer(name: str, rows: Sequence[torch.Tensor], device: torch.device) -> LayerSlots:
    """Every expert of the layer on the device: slot e holds expert e."""
    num_experts = rows[0].shape[0]
    table = torch.arange(num_experts, dtype=torch.int32, device=device).view(1, num_experts)
    return LayerSlots(name, table, tuple(r.to(device) for r in rows))


@dataclass
class ExpertCache:
    """A pool of `num_slots` device slots shared by all layers; host rows [E, ...] per layer.

    Eviction is least-recently-used and never takes an expert that the current call (or the
    pending batch of misses) needs.
    """

    num_slots: int
    slot_bytes: int
    device: torch.device
    slots: tuple[torch.Tensor, ...]
    host_rows: dict[str, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    layers: dict[str, LayerSlots] = field(default_factory=dict)
    pending: set[tuple[str, int]] = field(default_factory=set)
    pending_pairs: int = 0  # missing (token, expert) pairs served as zero since the last resolve
    fetched: int = 0

    def __post_init__(self) -> None:
        self._owners = SlotTable(self.num_slots)

    def add_layer(self, name: str, rows: Sequence[torch.Tensor]) -> LayerSlots:
        num_experts = rows[0].shape[0]
        if num_experts > self.num_slots:
            raise CapacityError(
                f"the expert cache holds {self.num_slots} slots ({format_bytes(self.num_slots * self.slot_bytes)}) "
                f"but one call of layer {name!r} can route to all {num_experts} of its experts: set BASE_CACHE_GB "
                f"to at least {format_bytes(num_experts * self.slot_bytes)}")
        if any(tuple(r.shape[1:]) != tuple(s.shape[1:]) for r, s in zip(rows, self.slots)):
            raise ConfigError(f"layer {name!r} has another expert geometry than the layers already in the cache")
        pin = self.device.type == "cuda"
        self.host_rows[name] = tuple(r.pin_memory() if pin else r for r in rows)
        table = torch.full((1, num_experts), -1, dtype=torch.int32, device=self.device)
        self.layers[name] = LayerSlots(name, table, self.slots)
        return self.layers[name]

    def ensure_resident(self, name: str, experts: Sequence[int]) -> int:
        """Fetch the experts of `name` that are not on the device; returns how many were fetched."""
        return self._fetch([(name, e) for e in experts])

    def record_misses(self, name: str, experts: Sequence[int], pairs: int) -> None:
        self.pending.update((name, e) for e in experts)
        self.pending_pairs += pairs

    def resolve_misses(self) -> int:
        """Fetch every recorded miss in one batch; returns how many experts were fetched."""
        keys, self.pending, self.pending_pairs = sorted(self.pending), set(), 0
        return self._fetch(keys)

    def _fetch(self, keys: list[tuple[str, int]]) -> int:
        needed = set(keys)
        busy = {slot for key in needed if (slot := self._owners.hit(key)) is not None}
        todo = [key for key in keys if key not in self._owners]
        for key in todo:
            slot = self._owners.take_free()
            if slot is None:
                slot = self._owners.evict_lru(busy)
                if slot is None:
                    raise CapacityError(f"{len(needed)} experts needed at once exceed the {self.num_slots} cache slots")
                self._unmap(slot)
            layer_name, expert = key
            for dest, source in zip(self.slots, self.host_rows[layer_name]):
                dest[slot].copy_(source[expert], non_blocking=True)
            self.layers[layer_name].table[0, expert] = slot
            self._owners.publish(key, slot)
            busy.add(slot)
        self.fetched += len(todo)
        return len(todo)

    def _unmap(self, slot: int) -> None:
        for layer in self.layers.values():
            layer.table[layer.table == slot] = -1


_process_cache: ExpertCache | None = None


def process_cache(num_slots: int, slot_bytes: int, device: torch.device,
                  make_slots) -> ExpertCache:
    """The process's one expert cache, created by the first layer that asks (`make_slots(n)`)."""
    global _process_cache
    if _process_cache is None:
        _process_cache = ExpertCache(num_slots, slot_bytes, device, make_slots(num_slots))
    elif _process_cache.num_slots != num_slots or _process_cache.device != device:
        raise ConfigError(f"the expert cache already exists with {_process_cache.num_slots} slots on "
                          f"{_process_cache.device}; a layer asked for {num_slots} on {device}")
    return _process_cache


def current_cache() -> ExpertCache | None:
    return _process_cache


def reset_process_cache() -> None:
    """Drop the process's expert cache (tests build several models in one process)."""
    global _process_cache
    _process_cache = None
