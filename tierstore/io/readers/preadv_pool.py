"""Reader backend: `os.preadv` on a thread pool (the GIL is released during each read)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from pathlib import Path

from tierstore.io.readers.base import OnRead, PendingBatch, ReadOp, Reader, read_remainder


class PreadvPoolReader(Reader):
    name = "preadv-pool"

    def __init__(self, path: Path | str, direct: bool = False, threads: int = 8):
        super().__init__(path, direct)
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tierstore-preadv")

    def _read_one(self, batch: PendingBatch, index: int) -> str | None:
        failure = read_remainder(self.fd, batch.ops[index], 0)
        return failure if failure is not None else batch.finished(index)

    def submit(self, ops: Sequence[ReadOp], on_read: OnRead | None = None) -> PendingBatch:
        self.check_ops(ops)
        batch = PendingBatch(ops, on_read)
        if not self.direct:
            for op in batch.ops:
                os.posix_fadvise(self.fd, op.offset, len(op.dest), os.POSIX_FADV_WILLNEED)
        if len(batch.ops) <= 2:
            batch.futures = None
            batch.results = [self._read_one(batch, index) for index in range(len(batch.ops))]
        else:
            batch.futures = [self._pool.submit(self._read_one, batch, index) for index in range(len(batch.ops))]
        return batch

    def complete(self, batch: PendingBatch) -> None:
        if batch.futures is None:
            results = batch.results
        else:
            wait(batch.futures)  # every read has finished before any error is raised
            results = [future.result() for future in batch.futures]
        for op, failure in zip(batch.ops, results):
            if failure is not None:
                batch.failures[op.offset] = failure
        self.raise_failures(batch)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        super().close()

    def describe(self) -> str:
        return f"{super().describe()}, {self.threads} threads"
