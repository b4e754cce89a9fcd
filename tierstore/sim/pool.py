"""A slot pool for the simulator: a capacity in slots plus an eviction policy."""

from __future__ import annotations

from tierstore.cache.policy import EvictionPolicy


class SlotPool:
    """Inserting into a full pool evicts the policy's victim (never a key in `exclude`); when no
    key may be evicted the pool overflows its capacity until a later insert shrinks it back."""

    def __init__(self, capacity: int, policy: EvictionPolicy) -> None:
        if capacity < 0:
            raise ValueError(f"pool capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self.policy = policy
        self.overflow_inserts = 0

    def __contains__(self, key: int) -> bool:
        return key in self.policy

    def __len__(self) -> int:
        return len(self.policy)

    def insert(self, key: int, exclude) -> list[int]:
        """Make `key` resident; returns the evicted keys."""
        evicted = []
        while len(self.policy) >= self.capacity:
            victim = self.policy.victim(exclude)
            if victim is None:
                self.overflow_inserts += 1
                break
            self.policy.on_evict(victim)
            evicted.append(victim)
        self.policy.on_insert(key)
        return evicted
