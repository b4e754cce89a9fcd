"""Policies whose eviction order is a sort by a per-key rank (lowest rank evicted first)."""

from __future__ import annotations

from collections.abc import Iterator

from tierstore.cache.policy import _EMPTY, EvictionPolicy


class RankedPolicy(EvictionPolicy):
    """Subclasses define `rank(key)`; ties are broken by the key's last touch (older first)."""

    def __init__(self) -> None:
        super().__init__()
        self._clock = 0
        self.last_touch: dict[int, int] = {}

    def rank(self, key: int):
        raise NotImplementedError

    def _touch(self, key: int) -> None:
        self._clock += 1
        self.last_touch[key] = self._clock

    def _inserted(self, key: int) -> None:
        self._touch(key)

    def _accessed(self, key: int) -> None:
        self._touch(key)

    def _removed(self, key: int) -> None:
        del self.last_touch[key]

    def _full_rank(self, key: int):
        return (self.rank(key), self.last_touch[key], key)

    def victim(self, exclude=_EMPTY) -> int | None:
        keys = [k for k in self.sizes if k not in self.pinned and k not in exclude]
        return min(keys, key=self._full_rank) if keys else None

    def eviction_order(self, exclude=_EMPTY) -> Iterator[int]:
        keys = [k for k in self.sizes if k not in self.pinned and k not in exclude]
        return iter(sorted(keys, key=self._full_rank))
