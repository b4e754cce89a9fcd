"""Least recently used: evict the key whose last insert or hit is oldest."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

from tierstore.cache.policy import _EMPTY, EvictionPolicy, register_policy


@register_policy("lru")
class LRUPolicy(EvictionPolicy):
    name = "lru"
    filtered_order = True

    def __init__(self) -> None:
        super().__init__()
        self._order: OrderedDict[int, None] = OrderedDict()  # oldest first

    def _inserted(self, key: int) -> None:
        self._order[key] = None

    def _accessed(self, key: int) -> None:
        self._order.move_to_end(key)

    def _removed(self, key: int) -> None:
        del self._order[key]

    # the batch hooks of a pool's install and step close, inlined (the same state and errors as the
    # single hooks); a subclass, which may override a single hook, gets the base class's loops
    def on_insert_many(self, keys: Iterable[int]) -> None:
        if type(self) is not LRUPolicy:
            return super().on_insert_many(keys)
        sizes, order = self.sizes, self._order
        for key in keys:
            if key in sizes:
                raise KeyError(f"policy {self.name}: key {key} inserted twice")
            sizes[key] = 1
            self.version += 1
            order[key] = None

    def on_access_many(self, keys: Iterable[int]) -> None:
        if type(self) is not LRUPolicy:
            return super().on_access_many(keys)
        sizes, move_to_end = self.sizes, self._order.move_to_end
        for key in keys:
            if key not in sizes:
                self._require(key)
            self.version += 1
            move_to_end(key)

    def on_evict_many(self, keys: Iterable[int]) -> None:
        if type(self) is not LRUPolicy:
            return super().on_evict_many(keys)
        sizes, order, pinned = self.sizes, self._order, self.pinned
        for key in keys:
            if key not in sizes:
                self._require(key)
            del sizes[key]
            pinned.discard(key)
            self.version += 1
            del order[key]

    def eviction_order(self, exclude=_EMPTY) -> Iterator[int]:
        return (k for k in self._order if k not in self.pinned and k not in exclude)
