"""Reader backend: io_uring through the `liburing` binding (pinned: liburing==2026.3.30).

One submit per batch of up to `depth` reads; reads whose destination lies inside the registered
buffer (typically the whole arena) use fixed-buffer reads, which skip per-I/O page pinning.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tierstore.errors import ReadError
from tierstore.io.readers.base import OnRead, PendingBatch, ReadOp, Reader, buffer_address, read_remainder


def load_liburing():
    """The liburing module, or ReadError saying why io_uring cannot be used here."""
    try:
        import liburing
    except ImportError as exc:
        raise ReadError(f"io_uring unavailable: the liburing binding is not installed ({exc})") from None
    return liburing


class UringReader(Reader):
    name = "io_uring"

    def __init__(self, path: Path | str, direct: bool = False, depth: int = 64, registered: memoryview | None = None):
        super().__init__(path, direct)
        if not 1 <= depth <= 4096:
            raise ValueError(f"queue depth must be in [1, 4096], got {depth}")
        self._uring = load_liburing()
        self.depth = depth
        self._ring = self._uring.Ring()
        self._cqe = self._uring.Cqe()
        try:
            self._uring.io_uring_queue_init(depth, self._ring)
        except OSError as exc:
            super().close()
            raise ReadError(f"io_uring setup failed: {exc}") from None
        self._registered: tuple[int, int] | None = None
        if registered is not None:
            self._register(registered)

    def _register(self, region: memoryview) -> None:
        try:
            self._uring.io_uring_register_buffers(self._ring, self._uring.Iovec([region]))
        except OSError:
            return  # fixed buffers are an optimisation; plain readv still works
        start = buffer_address(region)
        self._registered = (start, start + len(region))

    @property
    def uses_fixed_buffers(self) -> bool:
        return self._registered is not None

    def _is_registered(self, op: ReadOp) -> bool:
        if self._registered is None:
            return False
        start = buffer_address(op.dest)
        return self._registered[0] <= start and start + len(op.dest) <= self._registered[1]

    def submit(self, ops: Sequence[ReadOp], on_read: OnRead | None = None) -> PendingBatch:
        self.check_ops(ops)
        batch = PendingBatch(ops, on_read)
        batch.next_index = 0
        batch.done = [0] * len(batch.ops)
        return batch

    def _run_chunk(self, batch: PendingBatch, first: int, last: int) -> None:
        uring, keep_alive = self._uring, []
        for index in range(first, last):
            op = batch.ops[index]
            sqe = uring.io_uring_get_sqe(self._ring)
            iovec = uring.Iovec([op.dest])
            keep_alive.append(iovec)  # the kernel writes through it until completion
            if self._is_registered(op):
                uring.io_uring_prep_readv_fixed(sqe, self.fd, iovec, 0, op.offset)
            else:
                uring.io_uring_prep_readv(sqe, self.fd, iovec, op.offset)
            sqe.user_data = index
        uring.io_uring_submit_and_wait(self._ring, last - first)
        pending = last - first
        while pending:
            try:
                uring.io_uring_wait_cqe(self._ring, self._cqe)
            except OSError:
                pass  # the failed entry is still queued; it is read below
            ready = uring.io_uring_cq_ready(self._ring)
            for slot in range(ready):
                entry = self._cqe[slot]
                index = entry.user_data
                op = batch.ops[index]
                try:
                    batch.done[index] = entry.res
                except OSError as exc:
                    batch.failures[op.offset] = exc.strerror or str(exc)
                    continue
                if batch.done[index] == len(op.dest) and (failure := batch.finished(index)) is not None:
                    batch.failures[op.offset] = failure
            uring.io_uring_cq_advance(self._ring, ready)
            pending -= ready

    def complete(self, batch: PendingBatch) -> None:
        for first in range(0, len(batch.ops), self.depth):
            self._run_chunk(batch, first, min(first + self.depth, len(batch.ops)))
        for index, op in enumerate(batch.ops):
            if op.offset not in batch.failures and batch.done[index] < len(op.dest):
                failure = read_remainder(self.fd, op, batch.done[index])
                if failure is None:
                    failure = batch.finished(index)
                if failure is not None:
                    batch.failures[op.offset] = failure
        self.raise_failures(batch)

    def close(self) -> None:
        if self.fd >= 0:
            if self._registered is not None:
                self._uring.io_uring_unregister_buffers(self._ring)
            self._uring.io_uring_queue_exit(self._ring)
        super().close()

    def describe(self) -> str:
        fixed = ", registered buffers" if self.uses_fixed_buffers else ""
        return f"{super().describe()}, depth {self.depth}{fixed}"
