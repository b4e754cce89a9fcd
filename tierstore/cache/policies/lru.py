"""Least recently used: evict the key whose last insert or hit is oldest."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from tierstore.cache.policy import _EMPTY, EvictionPolicy, register_policy


@register_policy("lru")
class LRUPolicy(EvictionPolicy):
    name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self._order: OrderedDict[int, None] = OrderedDict()  # oldest first

    def _inserted(self, key: int) -> None:
        self._order[key] = None

    def _accessed(self, key: int) -> None:
        self._order.move_to_end(key)

    def _removed(self, key: int) -> None:
        del self._order[key]

    def eviction_order(self, exclude=_EMPTY) -> Iterator[int]:
        return (k for k in self._order if k not in self.pinned and k not in exclude)
