"""SIEVE: a FIFO queue with visited bits and a hand that sweeps from the oldest entry to the newest.

A hit sets the key's visited bit. To evict, the hand walks toward newer entries, clearing visited
bits, and takes the first unvisited key; after the newest entry it wraps to the oldest. Pinned and
excluded keys are stepped over with their bits untouched.
"""

from __future__ import annotations

from tierstore.cache.policies.sweeping import SweepingPolicy
from tierstore.cache.policy import register_policy


@register_policy("sieve")
class SievePolicy(SweepingPolicy):
    name = "sieve"

    def __init__(self) -> None:
        super().__init__()
        self.queue: list[int] = []  # oldest first
        self.visited: dict[int, bool] = {}
        self.hand: int | None = None  # key the next sweep starts at; None = the oldest

    def _inserted(self, key: int) -> None:
        self.queue.append(key)
        self.visited[key] = False

    def _accessed(self, key: int) -> None:
        self.visited[key] = True

    def _removed(self, key: int) -> None:
        i = self.queue.index(key)
        if self.hand == key:
            self.hand = self.queue[i + 1] if i + 1 < len(self.queue) else None
        del self.queue[i]
        del self.visited[key]

    def _sweep_order(self) -> list[int]:
        start = 0 if self.hand is None else self.queue.index(self.hand)
        return self.queue[start:] + self.queue[:start]

    def plan(self, exclude):
        candidates = [k for k in self._sweep_order() if k not in self.pinned and k not in exclude]
        cleared = []
        for key in candidates:
            if not self.visited[key]:
                return key, cleared
            cleared.append(key)
        if not candidates:
            return None, None
        return candidates[0], candidates  # a full lap cleared every bit

    def apply(self, victim: int, plan) -> None:
        for key in plan:
            self.visited[key] = False
        i = self.queue.index(victim)
        self.hand = self.queue[i + 1] if i + 1 < len(self.queue) else None
