"""The snapshot that carries per-step routing counts from the runner to the FP4 manager.

The step protocol's pass-log read already brings every pass's `seen [L, E]` routed counts to the
host (its one device-to-host copy and sync). At step end the runner `push`es the last pass's host
counts, which are added into a host accumulator; the manager `take`s everything pushed since its
last take (windows merge while it is busy: none is lost, none overwritten) and the accumulator
restarts at zero. One lock guards the accumulator (a torn snapshot once evicted an in-flight
expert in the reference system). No device work, no copy or event of its own: a window is ready
for the manager as soon as it is pushed.
"""

from __future__ import annotations

import threading

import numpy as np


class ChainedSnapshot:
    def __init__(self, num_layers: int, num_experts: int):
        self.counts = np.zeros((num_layers, num_experts), dtype=np.int64)  # [L, E] windows not taken yet
        self.lock = threading.Lock()
        self._pending = False  # `counts` holds at least one window the manager has not taken
        self.windows = 0  # windows pushed
        self.merged = 0  # windows pushed while another was pending (taken together with it)

    @property
    def pending(self) -> bool:
        return self._pending

    def push(self, seen: np.ndarray) -> None:
        """Add one step's routed counts (int [L, E] on the host; read here, not kept)."""
        with self.lock:
            self.windows += 1
            self.merged += self._pending
            self.counts += seen
            self._pending = True

    def take(self) -> np.ndarray | None:
        """The counts of every window pushed since the last take (int64 [L, E], the caller's to
        keep), or None when nothing was pushed. Never blocks on the device."""
        with self.lock:
            if not self._pending:
                return None
            counts, self.counts = self.counts, np.zeros_like(self.counts)
            self._pending = False
            return counts
