"""Decayed routing frequency (the reference system's `freq`): evict the key routed least, recently.

Every routed pair counts (resident or not, via `observe`), decayed with `half_life` in the time
unit of `begin_step(now)`; the counts survive eviction, so a returning hot key is still hot.
"""

from __future__ import annotations

from collections.abc import Iterable

from tierstore.cache.policies.decay import DecayedCounter
from tierstore.cache.policies.ranked import RankedPolicy
from tierstore.cache.policy import register_policy


@register_policy("freq")
class DecayedFrequencyPolicy(RankedPolicy):
    name = "freq"

    def __init__(self, half_life: float = 256.0) -> None:
        super().__init__()
        self.counter = DecayedCounter(half_life)

    def observe(self, keys: Iterable[int]) -> None:
        for key in keys:
            self.counter.add(key, self.now)

    def heat(self, key: int) -> float:
        return self.counter.value(key, self.now)

    def rank(self, key: int) -> float:
        return self.heat(key)
