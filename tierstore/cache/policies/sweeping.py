"""Base for policies whose eviction moves state (a clock hand, queue promotions).

`plan(exclude)` works out, without changing anything, the victim and the state changes that
choosing it implies; `victim` returns the planned key and `on_evict` applies the plan it was
asked for (any other removal is a plain `on_remove`). A plan is valid only for the state
`version` it was made from.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

from tierstore.cache.policy import _EMPTY, EvictionPolicy


class SweepingPolicy(EvictionPolicy):
    def __init__(self) -> None:
        super().__init__()
        self._memo = None  # (version, victim, plan)

    def plan(self, exclude) -> tuple[int | None, object]:
        raise NotImplementedError

    def apply(self, victim: int, plan: object) -> None:
        raise NotImplementedError

    def victim(self, exclude=_EMPTY) -> int | None:
        victim, plan = self.plan(exclude)
        self._memo = (self.version, victim, plan)
        return victim

    def on_evict(self, key: int) -> None:
        memo, self._memo = self._memo, None
        if memo is not None and memo[0] == self.version and memo[1] == key:
            self.apply(key, memo[2])
        self.on_remove(key)

    def eviction_order(self, exclude=_EMPTY) -> Iterator[int]:
        clone = copy.deepcopy(self)
        while (key := clone.victim(exclude)) is not None:
            yield key
            clone.on_evict(key)
