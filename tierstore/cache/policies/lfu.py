"""Least frequently used: fewest hits since insertion (counted from 1), older touch first on ties."""

from __future__ import annotations

from tierstore.cache.policies.ranked import RankedPolicy
from tierstore.cache.policy import register_policy


@register_policy("lfu")
class LFUPolicy(RankedPolicy):
    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self.count: dict[int, int] = {}

    def _inserted(self, key: int) -> None:
        super()._inserted(key)
        self.count[key] = 1

    def _accessed(self, key: int) -> None:
        super()._accessed(key)
        self.count[key] += 1

    def _removed(self, key: int) -> None:
        super()._removed(key)
        del self.count[key]

    def rank(self, key: int) -> int:
        return self.count[key]
