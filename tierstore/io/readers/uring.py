"""Reader backend: io_uring through the `liburing` binding (pinned: liburing==2026.3.30).

Up to `depth` reads are in flight at once; each completion is reaped as it arrives and its slot
refilled at once (a sliding window, not `depth`-sized rounds), so `on_read` runs while later reads
are still in flight. The binding holds the GIL while it waits in the kernel, so the reader never
waits there: an eventfd registered with the ring signals completions, and `os.eventfd_read`
blocks without the GIL (other Python threads, such as checksum verification, keep running).
Reads whose destination lies inside the registered buffer (typically the whole arena) use
fixed-buffer reads, which skip per-I/O page pinning.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from tierstore.errors import ReadError
from tierstore.io.readers.base import PAGE_BYTES, OnRead, PendingBatch, ReadOp, Reader, buffer_address, \
    read_remainder


def load_liburing():
    """The liburing module, or ReadError saying why io_uring cannot be used here."""
    try:
        import liburing
    except ImportError as exc:
        raise ReadError(f"io_uring unavailable: the liburing binding is not installed ({exc})") from None
    return liburing


MAX_FIXED_BYTES = 1 << 30  # the kernel's limit on one registered buffer


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
        self._eventfd = os.eventfd(0, os.EFD_CLOEXEC)
        try:
            self._uring.io_uring_register_eventfd(self._ring, self._eventfd)
        except OSError as exc:
            self._uring.io_uring_queue_exit(self._ring)
            os.close(self._eventfd)
            super().close()
            raise ReadError(f"io_uring eventfd registration failed: {exc}") from None
        self._fixed: list[tuple[int, int]] = []  # (start, end) address of each registered buffer
        if registered is not None:
            self.register(registered)

    def register(self, region: memoryview | None, granule: int = PAGE_BYTES) -> bool:
        """Register `region` as fixed buffers, replacing any earlier registration (None only
        unregisters). It is split into pieces of whole `granule`s (e.g. arena slots) of at most
        1 GiB each, the kernel's limit per buffer. Returns whether reads into it use fixed buffers;
        a refused registration (e.g. over RLIMIT_MEMLOCK) leaves plain readv, which works anyway."""
        if self.fd < 0:
            return False  # closed: the ring and its registration are gone
        if self._fixed:
            self._uring.io_uring_unregister_buffers(self._ring)
            self._fixed = []
        if region is None or len(region) == 0:
            return False
        piece = max(granule, MAX_FIXED_BYTES // granule * granule)
        pieces = [region[start:start + piece] for start in range(0, len(region), piece)]
        try:
            self._uring.io_uring_register_buffers(self._ring, self._uring.Iovec(pieces))
        except OSError:
            return False
        self._fixed = [(buffer_address(p), buffer_address(p) + len(p)) for p in pieces]
        return True

    @property
    def uses_fixed_buffers(self) -> bool:
        return bool(self._fixed)

    def _fixed_index(self, op: ReadOp) -> int | None:
        """The registered buffer wholly holding the destination, if any."""
        start = buffer_address(op.dest)
        for index, (first, last) in enumerate(self._fixed):
            if first <= start and start + len(op.dest) <= last:
                return index
        return None

    def submit(self, ops: Sequence[ReadOp], on_read: OnRead | None = None) -> PendingBatch:
        self.check_ops(ops)
        batch = PendingBatch(ops, on_read)
        batch.done = [0] * len(batch.ops)
        return batch

    def _queue(self, batch: PendingBatch, index: int, keep_alive: dict) -> None:
        uring, op = self._uring, batch.ops[index]
        sqe = uring.io_uring_get_sqe(self._ring)
        iovec = uring.Iovec([op.dest])
        keep_alive[index] = iovec  # the kernel writes through it until completion
        buf_index = self._fixed_index(op) if self._fixed else None
        if buf_index is not None:
            uring.io_uring_prep_readv_fixed(sqe, self.fd, iovec, buf_index, op.offset)
        else:
            uring.io_uring_prep_readv(sqe, self.fd, iovec, op.offset)
        sqe.user_data = index

    def _reap(self, batch: PendingBatch, keep_alive: dict) -> int:
        """Handle every completion already posted, one at a time (the ring's head entry: no
        indexing across the ring's wrap-around), without blocking; returns how many."""
        uring, reaped = self._uring, 0
        while uring.io_uring_cq_ready(self._ring):
            try:
                uring.io_uring_wait_cqe(self._ring, self._cqe)  # returns at once: an entry is ready
            except OSError:
                pass  # a failed entry is still queued; it is read below
            entry = self._cqe[0]
            index = entry.user_data
            op = batch.ops[index]
            del keep_alive[index]
            try:
                batch.done[index] = entry.res
            except OSError as exc:
                batch.failures[op.offset] = exc.strerror or str(exc)
            uring.io_uring_cq_advance(self._ring, 1)
            reaped += 1
            if batch.done[index] == len(op.dest) and (failure := batch.finished(index)) is not None:
                batch.failures[op.offset] = failure
        return reaped

    def _wait_one(self, batch: PendingBatch, keep_alive: dict) -> None:
        """Submit what is queued, then handle at least one completion (or one wake-up)."""
        self._uring.io_uring_submit(self._ring)
        if not self._reap(batch, keep_alive):
            os.eventfd_read(self._eventfd)  # sleeps until a completion is posted, GIL released

    def complete(self, batch: PendingBatch) -> None:
        keep_alive: dict = {}
        queued = 0
        try:
            while queued < len(batch.ops) or keep_alive:
                while queued < len(batch.ops) and len(keep_alive) < self.depth:
                    self._queue(batch, queued, keep_alive)
                    queued += 1
                self._wait_one(batch, keep_alive)
        except BaseException:  # e.g. KeyboardInterrupt: never leave reads writing into caller memory
            while keep_alive:
                self._wait_one(batch, keep_alive)
            raise
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
            if self._fixed:
                self._uring.io_uring_unregister_buffers(self._ring)
                self._fixed = []
            self._uring.io_uring_unregister_eventfd(self._ring)
            self._uring.io_uring_queue_exit(self._ring)
            os.close(self._eventfd)
        super().close()

    def describe(self) -> str:
        fixed = ", registered buffers" if self.uses_fixed_buffers else ""
        return f"{super().describe()}, depth {self.depth}{fixed}"
