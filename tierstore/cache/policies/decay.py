"""Exponentially decayed counters with a half-life in the policy's time unit."""

from __future__ import annotations


class DecayedCounter:
    """``value(key, now) = sum of 2 ** -((now - t_i) / half_life)`` over the increments at t_i."""

    def __init__(self, half_life: float) -> None:
        if not half_life > 0:
            raise ValueError(f"half_life must be positive, got {half_life}")
        self.half_life = float(half_life)
        self._state: dict[int, tuple[float, float]] = {}

    def value(self, key: int, now: float) -> float:
        amount, stamp = self._state.get(key, (0.0, now))
        return amount * 2.0 ** (-(now - stamp) / self.half_life)

    def add(self, key: int, now: float, amount: float = 1.0) -> None:
        self._state[key] = (self.value(key, now) + amount, now)
