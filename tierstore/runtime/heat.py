"""Routing frequencies of every (layer, expert) decayed by wall-clock time.

`value = sum of count_i x 2 ** -((now - t_i) / half_life_s)`: a half-life in seconds, independent
of how often windows arrive or how many steps a window merges, so a busy and an idle server rank
experts on the same time scale.
"""

from __future__ import annotations

import numpy as np


class WallClockHeat:
    """float64 [L, E] decayed counts; `add` and `values` take `now` in seconds (time.monotonic())."""

    def __init__(self, num_layers: int, num_experts: int, half_life_s: float, now: float):
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be positive, got {half_life_s}")
        self.half_life_s = float(half_life_s)
        self.counts = np.zeros((num_layers, num_experts), dtype=np.float64)  # [L, E] as of `self.stamp`
        self.stamp = float(now)

    def _decay_to(self, now: float) -> None:
        elapsed = now - self.stamp
        if elapsed > 0:
            self.counts *= 2.0 ** (-elapsed / self.half_life_s)
            self.stamp = now

    def add(self, counts: np.ndarray, now: float) -> None:
        """Add a window's routed counts (int [L, E]) at time `now`."""
        self._decay_to(now)
        self.counts += counts

    def values(self, now: float) -> np.ndarray:
        """float64 [L, E] decayed to `now` (a view; do not modify)."""
        self._decay_to(now)
        return self.counts
