"""The chained snapshot that carries per-step routing counts from the runner to the FP4 manager.

The runner `push`es the device `seen [L, E]` counts at the end of every step; they are added to a
device accumulator. When no snapshot is pending, the accumulator is copied to one pinned host
buffer (on a side stream, with an event) and zeroed. A pending snapshot is never overwritten:
later windows keep accumulating and are published as soon as the manager `take`s the pending
one, so windows merge and none is lost. One lock serialises every use of the shared buffer (a
torn snapshot once evicted an in-flight expert in the reference system).
"""

from __future__ import annotations

import threading

import numpy as np
import torch

NOT_READY = "not-ready"


class ChainedSnapshot:
    def __init__(self, num_layers: int, num_experts: int, device: torch.device | str):
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self.accumulator = torch.zeros(num_layers, num_experts, dtype=torch.int32, device=self.device)  # [L, E]
        self.host = torch.zeros(num_layers, num_experts, dtype=torch.int32, pin_memory=cuda)  # [L, E]
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.lock = threading.Lock()
        self._event: torch.cuda.Event | None = None
        self._pending = False  # `host` holds a window the manager has not taken
        self._unpublished = False  # `accumulator` holds windows added while one was pending
        self.windows = 0  # windows pushed
        self.merged = 0  # windows that waited behind a pending snapshot

    @property
    def pending(self) -> bool:
        return self._pending

    def push(self, seen: torch.Tensor) -> None:
        """Add one step's routed counts (int32 [L, E] on the device); the caller's stream must not
        rewrite `seen` before this call returns (it waits for the side stream's read)."""
        with self.lock:
            self.windows += 1
            if self.stream is None:
                self.accumulator += seen
            else:
                main = torch.cuda.current_stream(self.device)
                self.stream.wait_stream(main)
                with torch.cuda.stream(self.stream):
                    self.accumulator += seen
                main.wait_stream(self.stream)  # the next pass zeroes `seen` only after it was read
            if self._pending:
                self.merged += 1
                self._unpublished = True
                return
            self._publish()

    def _publish(self) -> None:
        if self.stream is None:
            self.host.copy_(self.accumulator)
            self.accumulator.zero_()
        else:
            with torch.cuda.stream(self.stream):
                self.host.copy_(self.accumulator, non_blocking=True)
                self.accumulator.zero_()
                self._event = torch.cuda.Event()
                self._event.record(self.stream)
        self._pending, self._unpublished = True, False

    def take(self) -> np.ndarray | str | None:
        """The pending window's counts (int32 [L, E] copy), NOT_READY when its copy has not landed
        yet (never blocks), or None when nothing is pending. Publishes windows that merged behind it."""
        with self.lock:
            if not self._pending:
                return None
            if self._event is not None and not self._event.query():
                return NOT_READY
            counts = self.host.numpy().copy()
            self._pending = False
            if self._unpublished:
                self._publish()
            return counts
