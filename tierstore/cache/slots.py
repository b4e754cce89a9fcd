"""Slot bookkeeping for the host arena: which key owns which slot, recency order, free slots."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

ARENA_POLICIES = ("lru", "freq-dense")  # this table's order, and `frequency_slots.FrequencySlotTable`'s


class SlotTable:
    """Keys published to slots, least recently used first. A slot is either free, or owned by
    exactly one published key; a key is published only once its bytes are in the slot."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._key_to_slot: OrderedDict[Hashable, int] = OrderedDict()
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    def __len__(self) -> int:
        return len(self._key_to_slot)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._key_to_slot

    @property
    def num_free(self) -> int:
        return len(self._free_slots)

    def hit(self, key: Hashable) -> int | None:
        """The key's slot, marked most recently used; None when the key is not published."""
        slot = self._key_to_slot.get(key)
        if slot is not None:
            self._key_to_slot.move_to_end(key)
        return slot

    def hit_many(self, keys) -> dict:
        """`hit` of each key in order (a repeated key once, where it first occurs): {key: slot} of the
        published ones."""
        table, move_to_end = self._key_to_slot, self._key_to_slot.move_to_end
        found = {}
        for key in keys:
            if key in found:
                continue
            slot = table.get(key)
            if slot is not None:
                move_to_end(key)
                found[key] = slot
        return found

    def take_free(self) -> int | None:
        return self._free_slots.pop() if self._free_slots else None

    def evict(self, busy: set[int]) -> int | None:
        """Unpublish the least recently used key whose slot is not in `busy`; return its slot."""
        for key, slot in self._key_to_slot.items():
            if slot not in busy:
                del self._key_to_slot[key]
                return slot
        return None

    def publish(self, key: Hashable, slot: int) -> None:
        """Make `key` the most recently used owner of `slot` (taken from take_free or evict)."""
        self._key_to_slot[key] = slot

    def release(self, slot: int) -> None:
        """Return a taken but unpublished slot to the free list."""
        self._free_slots.append(slot)

    def clear(self) -> None:
        self._key_to_slot.clear()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))

    def hottest_first(self) -> list:
        return list(reversed(self._key_to_slot))
