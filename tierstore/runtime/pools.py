"""The device expert pool: preallocated slots, a slot table on the device, its CPU mirror and
per-slot owners, with eviction through the policy API.

Invariants (checked by `check_coherent`): `table` (device) == `mirror` (host); slot s is owned by
(l, e) iff mirror[l, e] == s; a slot is free iff it has no owner; the policy holds exactly the
mapped keys. Bytes change only in `install`, between launches: victims are unmapped on the copy
stream before their slots are rewritten, and the new mappings are written after the copies, all
on one stream that is synchronised before the host state changes.

One install costs few copies: the table goes to the device whole from a host staging table (at
most two copies: victims unmapped, then the final mapping; no per-index kernels), and rows whose
host bytes and destination slots are both contiguous (an arena or staging buffer filled in
order into free slots in order) are merged into one copy per run.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import islice

import numpy as np
import torch

from tierstore.cache.policies.lru import LRUPolicy
from tierstore.cache.policy import EvictionPolicy
from tierstore.errors import CapacityError

Key = tuple[int, int]


class DevicePool:
    def __init__(self, num_slots: int, slot_bytes: int, num_layers: int, num_experts: int,
                 device: torch.device | str, policy: EvictionPolicy):
        if num_slots < 1:
            raise CapacityError(f"a device pool needs at least one slot, got {num_slots}")
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
        self.table = torch.full((num_layers, num_experts), -1, dtype=torch.int32, device=self.device)  # [L, E]
        self.mirror = np.full((num_layers, num_experts), -1, dtype=np.int32)  # [L, E]
        self.owner = np.full((num_slots, 2), -1, dtype=np.int32)  # [S, (layer, expert)]
        self.generation = np.zeros(num_slots, dtype=np.int64)  # bumped whenever a slot's bytes change
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        pin = self.device.type == "cuda"
        # host staging of the table: [0] victims unmapped, [1] final; reused once the stream is synchronised
        self._staged = [torch.empty(num_layers, num_experts, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self.copies = 0  # row copies issued (a merged run counts once)

    # -- queries ------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_mapped(self) -> int:
        return self.num_slots - len(self._free)

    def key_id(self, key: Key) -> int:
        return key[0] * self.num_experts + key[1]

    def slot_of(self, key: Key) -> int:
        return int(self.mirror[key])

    def is_resident(self, key: Key) -> bool:
        return self.mirror[key] >= 0

    def resident_keys(self) -> list[Key]:
        return [(int(l), int(e)) for l, e in self.owner if l >= 0]

    def capacity_for(self, exclude: Iterable[Key], enough: int | None = None) -> int:
        """How many new keys can be installed without evicting any of `exclude`; with `enough`,
        counting stops there (the answer is then min(capacity, enough)) instead of walking the
        whole eviction order."""
        if enough is not None and self.num_free >= enough:
            return enough
        ids = {self.key_id(k) for k in exclude}
        order = self.policy.eviction_order(ids)
        if enough is not None:
            order = islice(order, enough - self.num_free)
        return self.num_free + sum(1 for _ in order)

    # -- policy hooks ---------------------------------------------------------------------------
    @property
    def policy(self) -> EvictionPolicy:
        """The eviction policy, with every deferred hit applied."""
        if self._stamped != self._settled:
            touched = np.flatnonzero(self._hit_stamp > self._settled)
            for key_id in touched[np.argsort(self._hit_stamp[touched])].tolist():
                self._policy.on_access(key_id)
            self._settled = self._stamped
        return self._policy

    def touch(self, keys: Iterable[Key], now: float) -> None:
        """Close a step: tell the policy what was routed and which resident keys were hit."""
        self.touch_ids(np.unique(np.asarray([self.key_id(k) for k in keys], dtype=np.int64)), now)

    def touch_ids(self, ids: np.ndarray, now: float) -> None:
        """`touch` for dense ids (int64 ascending, distinct); hits reach the policy in that order."""
        self._policy.begin_step(now)
        hits = ids[self.mirror.reshape(-1)[ids] >= 0]
        if self._deferred_hits:  # lru ignores observe(); its hits are replayed when the policy is next read
            self._hit_stamp[hits] = np.arange(self._stamped + 1, self._stamped + 1 + len(hits))
            self._stamped += len(hits)
            return
        self._policy.observe(ids.tolist())
        for key_id in hits.tolist():
            self._policy.on_access(key_id)

    # -- mutation -------------------------------------------------------------------------------
    def install(self, keys: Sequence[Key], rows: Sequence[torch.Tensor], exclude: Iterable[Key]) -> None:
        """Copy host rows (uint8 [<= slot_bytes], pinned on CUDA) into slots and map them.

        Takes free slots first, then victims from the policy that are not in `exclude` (the
        step's routed set); raises CapacityError, changing nothing, when that is not enough.
        """
        if len(keys) != len(rows):
            raise ValueError(f"{len(keys)} keys but {len(rows)} rows")
        if any(self.is_resident(k) for k in keys) or len(set(keys)) != len(keys):
            raise ValueError("install() takes distinct keys that are not resident")
        needed = len(keys) - self.num_free
        exclude_ids = {self.key_id(k) for k in exclude} | {self.key_id(k) for k in keys}
        victims: list[int] = []
        if needed > 0:
            try:
                victims = self.policy.victims(needed, exclude_ids)
            except CapacityError:
                raise CapacityError(
                    f"device pool of {self.num_slots} slots cannot take {len(keys)} more experts: "
                    f"{self.num_free} free and only {self.capacity_for(exclude) - self.num_free} evictable outside "
                    f"the step's routed set") from None
        victim_slots = [int(self.mirror[divmod(v, self.num_experts)]) for v in victims]
        slots = [self._free[-1 - i] for i in range(min(len(keys), self.num_free))] + victim_slots
        self._write_device(keys, rows, slots, victims)
        for victim, slot in zip(victims, victim_slots):
            self.mirror[divmod(victim, self.num_experts)] = -1
            self.owner[slot] = -1
            self.policy.on_evict(victim)
        del self._free[len(self._free) - min(len(keys), self.num_free):]
        for key, slot in zip(keys, slots):
            self.mirror[key] = slot
            self.owner[slot] = key
            self.generation[slot] += 1
            self.policy.on_insert(self.key_id(key))

    def _write_device(self, keys, rows, slots, victims) -> None:
        for row in rows:
            if row.numel() > self.slot_bytes:
                raise CapacityError(f"row of {row.numel()} bytes does not fit a {self.slot_bytes}-byte slot")
        unmapped, final = self._staged
        final.numpy()[:] = self.mirror
        if victims:
            final.view(-1)[torch.as_tensor(victims, dtype=torch.int64)] = -1
            unmapped.copy_(final)
        final.view(-1)[torch.as_tensor([self.key_id(k) for k in keys], dtype=torch.int64)] = \
            torch.as_tensor(slots, dtype=torch.int32)
        if self._stream is None:
            self._copy(rows, slots, unmapped if victims else None, final)
            return
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            self._copy(rows, slots, unmapped if victims else None, final)
        self._stream.synchronize()

    def _copy(self, rows, slots, unmapped: torch.Tensor | None, final: torch.Tensor) -> None:
        if unmapped is not None:
            self.table.copy_(unmapped, non_blocking=True)  # unmap before the bytes are reused
        for first, count, nbytes in self._runs(rows, slots):
            if count == 1:
                self.slots[slots[first], :nbytes].copy_(rows[first], non_blocking=True)
            else:  # `count` full rows, adjacent in one host buffer: one copy into consecutive slots
                source = rows[first].as_strided((count * nbytes,), (1,))
                self.slots[slots[first]:slots[first] + count].view(-1).copy_(source, non_blocking=True)
            self.copies += 1
        self.table.copy_(final, non_blocking=True)

    def _runs(self, rows, slots) -> list[tuple[int, int, int]]:
        """(first index, rows, row bytes) per copy: consecutive rows merge when each is a full slot,
        their host bytes are adjacent in one allocation and their slots are consecutive."""
        runs: list[list[int]] = []
        for i, row in enumerate(rows):
            if runs and self._follows(rows[i - 1], row) and slots[i] == slots[i - 1] + 1:
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

    # -- invariants -----------------------------------------------------------------------------
    def check_coherent(self) -> None:
        """Raise AssertionError unless table == mirror == owners == policy (see module doc)."""
        table = self.table.cpu().numpy()
        assert np.array_equal(table, self.mirror), "device slot table differs from its CPU mirror"
        mapped = np.argwhere(self.mirror >= 0)
        slots = self.mirror[self.mirror >= 0]
        assert len(set(slots.tolist())) == len(slots), "two keys map to one slot"
        for (layer, expert), slot in zip(mapped, slots):
            assert tuple(self.owner[slot]) == (layer, expert), f"slot {slot} owner disagrees with the table"
        owned = int((self.owner[:, 0] >= 0).sum())
        assert owned == len(slots), "an owned slot is not in the table"
        assert sorted(self._free) == sorted(np.flatnonzero(self.owner[:, 0] < 0).tolist()), "free list is stale"
        assert set(self.policy.sizes) == {int(l) * self.num_experts + int(e) for l, e in mapped}, \
            "policy keys differ from the mapped keys"
