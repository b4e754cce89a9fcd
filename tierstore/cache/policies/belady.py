"""Belady MIN (oracle): evict the key whose next use is furthest in the future.

Given the whole future as a sequence of steps (each an iterable of keys), indexed like
`begin_step(now)`. Keys never used again go first; ties go to the larger key, the same rule as
the simulator's fast path.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence

from tierstore.cache.policy import _EMPTY, EvictionPolicy, register_policy

NEVER = float("inf")


@register_policy("belady")
class BeladyPolicy(EvictionPolicy):
    name = "belady"

    def __init__(self, future: Sequence[Iterable[int]]) -> None:
        super().__init__()
        self.uses: dict[int, list[int]] = {}
        for step, keys in enumerate(future):
            for key in set(int(k) for k in keys):
                self.uses.setdefault(key, []).append(step)

    def next_use(self, key: int) -> float:
        """The first step after the current one that routes `key`."""
        steps = self.uses.get(key, ())
        i = bisect.bisect_right(steps, self.now)
        return steps[i] if i < len(steps) else NEVER

    def _rank(self, key: int):
        return (self.next_use(key), key)

    def victim(self, exclude=_EMPTY) -> int | None:
        keys = [k for k in self.sizes if k not in self.pinned and k not in exclude]
        return max(keys, key=self._rank) if keys else None

    def eviction_order(self, exclude=_EMPTY) -> Iterator[int]:
        keys = [k for k in self.sizes if k not in self.pinned and k not in exclude]
        return iter(sorted(keys, key=self._rank, reverse=True))
