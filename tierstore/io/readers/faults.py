"""A fault-injecting reader wrapper: EIO, short reads, delays and flipped bits, at chosen file
offsets or at random rates. Faults at chosen offsets fire once (a retry succeeds) unless
`persistent`; rate faults are drawn per read from a seeded generator."""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tierstore.io.readers.base import PAGE_BYTES, OnRead, PendingBatch, ReadOp, Reader


@dataclass
class FaultPlan:
    eio_offsets: set[int] = field(default_factory=set)
    short_offsets: set[int] = field(default_factory=set)
    flip_offsets: set[int] = field(default_factory=set)
    eio_rate: float = 0.0
    short_rate: float = 0.0
    flip_rate: float = 0.0
    delay_s: float = 0.0
    persistent: bool = False
    seed: int = 0


class FaultyReader(Reader):
    """Reads through `inner`, then applies the plan. A failed read's destination is scribbled over,
    as a real failed DMA may leave it; a flipped bit is returned as a success (checksums catch it)."""

    name = "faulty"

    def __init__(self, inner: Reader, plan: FaultPlan):
        self.inner = inner
        self.plan = plan
        self.path = inner.path
        self.direct = inner.direct
        self.fd = inner.fd
        self._rng = random.Random(plan.seed)
        self.fired: list[tuple[str, int]] = []

    def _fires(self, kind: str, offsets: set[int], rate: float, offset: int) -> bool:
        hit = offset in offsets or (rate > 0.0 and self._rng.random() < rate)
        if hit:
            self.fired.append((kind, offset))
            if not self.plan.persistent:
                offsets.discard(offset)
        return hit

    def submit(self, ops: Sequence[ReadOp], on_read: OnRead | None = None) -> PendingBatch:
        batch = PendingBatch(ops, on_read)  # on_read runs after the faults, so it sees them
        batch.inner = self.inner.submit(ops)
        return batch

    def complete(self, batch: PendingBatch) -> None:
        if self.plan.delay_s:
            time.sleep(self.plan.delay_s)
        try:
            self.inner.complete(batch.inner)
        finally:
            batch.failures.update(batch.inner.failures)
        plan = self.plan
        for op in batch.ops:
            if self._fires("eio", plan.eio_offsets, plan.eio_rate, op.offset):
                op.dest[:] = b"\xee" * len(op.dest)
                batch.failures[op.offset] = "Input/output error (injected)"
            elif self._fires("short", plan.short_offsets, plan.short_rate, op.offset):
                half = len(op.dest) // 2
                op.dest[half:] = b"\xee" * (len(op.dest) - half)
                batch.failures[op.offset] = f"short read: got {half} of {len(op.dest)} bytes (injected)"
            elif self._fires("flip", plan.flip_offsets, plan.flip_rate, op.offset):
                position = self._rng.randrange(len(op.dest))
                op.dest[position] ^= 1 << self._rng.randrange(8)
        for index, op in enumerate(batch.ops):
            if op.offset not in batch.failures and (failure := batch.finished(index)) is not None:
                batch.failures[op.offset] = failure
        self.raise_failures(batch)

    def register(self, region: memoryview | None, granule: int = PAGE_BYTES) -> bool:
        return self.inner.register(region, granule)

    def file_identity(self) -> tuple[int, int]:
        return self.inner.file_identity()

    def close(self) -> None:
        self.inner.close()

    def describe(self) -> str:
        return f"faulty over {self.inner.describe()}"
