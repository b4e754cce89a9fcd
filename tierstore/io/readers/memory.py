"""Reader backend over an in-memory file image (tests, simulation, the all-in-RAM tier)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from tierstore.io.readers.base import OnRead, PendingBatch, ReadOp, Reader


class MemoryReader(Reader):
    """Serves reads from `image` (any bytes-like object); reads past its end come back short."""

    name = "memory"

    def __init__(self, image, label: str = "<memory>", identity: tuple[int, int] | None = None):
        self.path = label
        self.direct = False
        self.fd = -1
        self._image = memoryview(image).cast("B")
        self._identity = identity if identity is not None else (-1, id(self._image))

    @classmethod
    def from_file(cls, path: Path | str) -> MemoryReader:
        """A reader over a whole file loaded into RAM; it identifies as that file."""
        with open(path, "rb") as handle:
            info = os.fstat(handle.fileno())
            return cls(handle.read(), label=str(path), identity=(info.st_dev, info.st_ino))

    def submit(self, ops: Sequence[ReadOp], on_read: OnRead | None = None) -> PendingBatch:
        self.check_ops(ops)
        batch = PendingBatch(ops, on_read)
        for index, op in enumerate(batch.ops):
            chunk = self._image[op.offset:op.offset + len(op.dest)]
            op.dest[:len(chunk)] = chunk
            if len(chunk) < len(op.dest):
                batch.failures[op.offset] = f"short read: got {len(chunk)} of {len(op.dest)} bytes (end of image)"
            elif (failure := batch.finished(index)) is not None:
                batch.failures[op.offset] = failure
        return batch

    def complete(self, batch: PendingBatch) -> None:
        self.raise_failures(batch)

    def file_identity(self) -> tuple[int, int]:
        return self._identity
