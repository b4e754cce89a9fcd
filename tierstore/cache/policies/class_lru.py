"""ClassLRU: one LRU list per frequency class (as llama.cpp's MoE cache does).

Each key has a decayed hit count (inserts and hits add one; half-life in steps; kept across
evictions). Its class is ``min(num_classes - 1, floor(log2(1 + count)))``; the victim is the
least recently used key of the lowest non-empty class.
"""

from __future__ import annotations

import math

from tierstore.cache.policies.decay import DecayedCounter
from tierstore.cache.policies.ranked import RankedPolicy
from tierstore.cache.policy import register_policy


@register_policy("class-lru")
class ClassLRUPolicy(RankedPolicy):
    name = "class-lru"

    def __init__(self, half_life: float = 128.0, num_classes: int = 4) -> None:
        super().__init__()
        if num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {num_classes}")
        self.counter = DecayedCounter(half_life)
        self.num_classes = num_classes

    def _inserted(self, key: int) -> None:
        super()._inserted(key)
        self.counter.add(key, self.now)

    def _accessed(self, key: int) -> None:
        super()._accessed(key)
        self.counter.add(key, self.now)

    def frequency_class(self, key: int) -> int:
        return min(self.num_classes - 1, int(math.log2(1.0 + self.counter.value(key, self.now))))

    def rank(self, key: int) -> int:
        return self.frequency_class(key)
