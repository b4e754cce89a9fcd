"""`need` (the reference system's FP4 pool policy): ranked by decayed need, not by routing.

need[key] grows by one for every key routed in a step whose confidence gate fired
(`record_need`), already-resident keys included, so repeat offenders resist eviction. Plain
routing (`observe`) does not count. A pool under this policy is filled only by forced promotions.
"""

from __future__ import annotations

from collections.abc import Iterable

from tierstore.cache.policies.decay import DecayedCounter
from tierstore.cache.policies.ranked import RankedPolicy
from tierstore.cache.policy import register_policy


@register_policy("need")
class NeedPolicy(RankedPolicy):
    name = "need"
    promotes_lazily = False

    def __init__(self, half_life: float = 256.0) -> None:
        super().__init__()
        self.counter = DecayedCounter(half_life)

    def record_need(self, keys: Iterable[int]) -> None:
        for key in keys:
            self.counter.add(key, self.now)

    def rank(self, key: int) -> float:
        return self.counter.value(key, self.now)
