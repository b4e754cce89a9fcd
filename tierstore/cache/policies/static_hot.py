"""Static hot set: evict in the order of a fixed profile (coldest first), LRU among unprofiled keys."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from tierstore.cache.policies.ranked import RankedPolicy
from tierstore.cache.policy import register_policy


@register_policy("static-hot")
class StaticHotPolicy(RankedPolicy):
    """`profile` maps key -> heat (e.g. routing counts), or lists keys hottest first."""

    name = "static-hot"

    def __init__(self, profile: Mapping[int, float] | Iterable[int] = ()) -> None:
        super().__init__()
        if isinstance(profile, Mapping):
            self.heat = {int(k): float(v) for k, v in profile.items()}
        else:
            keys = [int(k) for k in profile]
            self.heat = {k: float(len(keys) - i) for i, k in enumerate(keys)}

    def rank(self, key: int) -> float:
        return self.heat.get(key, float("-inf"))
