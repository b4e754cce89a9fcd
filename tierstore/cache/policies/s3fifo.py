"""S3-FIFO: a small probationary FIFO, a main FIFO with 2-bit counters, and a ghost list.

New keys enter the small queue (or the main queue if their key is in the ghost list). Hits raise
a key's counter (max 3). Eviction takes from the small queue while it holds at least
`small_fraction` of the resident size: its oldest key moves to the main queue (counter reset)
if it was hit since insertion, else it is evicted and remembered as a ghost. Otherwise the main
queue works as a CLOCK: its oldest key is evicted if its counter is 0, else decremented and
re-queued. Pinned and excluded keys are stepped over unchanged. The ghost list remembers as many
keys as are resident.
"""

from __future__ import annotations

from collections import OrderedDict

from tierstore.cache.policies.sweeping import SweepingPolicy
from tierstore.cache.policy import register_policy

MAX_COUNT = 3


@register_policy("s3fifo")
class S3FIFOPolicy(SweepingPolicy):
    name = "s3fifo"

    def __init__(self, small_fraction: float = 0.1) -> None:
        super().__init__()
        if not 0.0 < small_fraction < 1.0:
            raise ValueError(f"small_fraction must be in (0, 1), got {small_fraction}")
        self.small_fraction = small_fraction
        self.small: list[int] = []  # oldest first
        self.main: list[int] = []  # oldest first
        self.count: dict[int, int] = {}
        self.ghost: OrderedDict[int, None] = OrderedDict()

    def _inserted(self, key: int) -> None:
        if key in self.ghost:
            del self.ghost[key]
            self.main.append(key)
        else:
            self.small.append(key)
        self.count[key] = 0

    def _accessed(self, key: int) -> None:
        self.count[key] = min(MAX_COUNT, self.count[key] + 1)

    def _removed(self, key: int) -> None:
        (self.small if key in self.small else self.main).remove(key)
        del self.count[key]

    def _evictable(self, key: int, exclude) -> bool:
        return key not in self.pinned and key not in exclude

    def _plan_small(self, exclude):
        promoted = []
        for key in self.small:
            if not self._evictable(key, exclude):
                continue
            if self.count[key] > 0:
                promoted.append(key)
            else:
                return key, promoted
        return None, promoted

    def _plan_main(self, queue: list[int], counts: dict[int, int], exclude):
        """CLOCK over `queue`: key at position i with counter c is reached at time c * len + i."""
        n = len(queue)
        best = None
        for i, key in enumerate(queue):
            if self._evictable(key, exclude):
                when = counts[key] * n + i
                if best is None or when < best[0]:
                    best = (when, i, key)
        return best

    def plan(self, exclude):
        small_size = sum(self.sizes[k] for k in self.small)
        try_small_first = small_size >= self.small_fraction * self.used
        if try_small_first:
            victim, promoted = self._plan_small(exclude)
            if victim is not None:
                return victim, ("small", promoted)
        else:
            promoted = []
        queue = self.main + promoted
        counts = {**self.count, **{k: 0 for k in promoted}}
        best = self._plan_main(queue, counts, exclude)
        if best is not None:
            frozen = {k for k in queue if not self._evictable(k, exclude)}
            return best[2], ("main", promoted, queue, counts, best, frozen)
        if not try_small_first:
            victim, promoted = self._plan_small(exclude)
            if victim is not None:
                return victim, ("small", promoted)
        return None, None

    def apply(self, victim: int, plan) -> None:
        promoted = plan[1]
        for key in promoted:
            self.small.remove(key)
            self.main.append(key)
            self.count[key] = 0
        if plan[0] == "small":
            self.ghost[victim] = None
            while len(self.ghost) > max(1, len(self.sizes)):
                self.ghost.popitem(last=False)
            return
        _, _, queue, counts, (when, pos, _), frozen = plan
        n = len(queue)
        for i, key in enumerate(queue):
            if key != victim and key not in frozen:
                laps = when // n + (1 if i < pos else 0)
                self.count[key] = counts[key] - laps
        self.main = queue[pos + 1:] + queue[:pos + 1]
