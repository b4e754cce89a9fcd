"""The reader interface: positional reads of one file into caller memory, in batches.

`submit(ops, on_read)` starts a batch and `complete(batch)` waits for all of it. `complete`
returns only after every read of the batch has finished (none is left writing into caller memory)
and every `on_read` call has returned, then raises ReadError naming each failed read if any failed
or came back short. Destination contents of a failed read are undefined.

`on_read(index)`, when given, is called once for each read of the batch that finished fully and
successfully, as soon as it has (possibly on a reader thread, while other reads of the batch are
still in flight), so the caller can start working on that destination early (PackRows verifies
checksums there). It is never called for a failed read; an exception it raises counts as that
read's failure.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tierstore.errors import ReadError

PAGE_BYTES = 4096


@dataclass(frozen=True)
class ReadOp:
    """Read `len(dest)` bytes at file `offset` into `dest` (a writable, contiguous byte memoryview)."""

    offset: int
    dest: memoryview


def buffer_address(view: memoryview) -> int:
    """Address of the first byte of a writable buffer."""
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def describe_failures(path: Path | str, total: int, failures: dict[int, str]) -> ReadError:
    detail = "; ".join(f"offset {offset}: {why}" for offset, why in sorted(failures.items())[:8])
    more = f" (and {len(failures) - 8} more)" if len(failures) > 8 else ""
    return ReadError(f"{len(failures)} of {total} reads of {path} failed: {detail}{more}")


def read_remainder(fd: int, op: ReadOp, done: int) -> str | None:
    """Finish a partially done read with blocking preadv; returns why it failed, or None."""
    while done < len(op.dest):
        try:
            got = os.preadv(fd, [op.dest[done:]], op.offset + done)
        except OSError as exc:
            return f"{os.strerror(exc.errno or 0) or exc}"
        if got == 0:
            return f"short read: got {done} of {len(op.dest)} bytes (end of file)"
        done += got
    return None


OnRead = Callable[[int], None]


class PendingBatch:
    """A submitted batch; backends attach what they need to finish it."""

    def __init__(self, ops: Sequence[ReadOp], on_read: OnRead | None = None):
        self.ops = list(ops)
        self.on_read = on_read
        self.failures: dict[int, str] = {}

    def finished(self, index: int) -> str | None:
        """Read `index` finished fully: run `on_read`; returns why it failed, or None."""
        if self.on_read is None:
            return None
        try:
            self.on_read(index)
        except Exception as exc:  # the read is then failed: its destination is not trusted
            return f"on_read failed: {exc!r}"
        return None


class Reader(ABC):
    """A reader of one file. `direct` readers use O_DIRECT: offsets, lengths and destination
    addresses must be multiples of 4096."""

    name: str = "reader"

    def __init__(self, path: Path | str, direct: bool = False):
        self.path = Path(path)
        self.direct = direct
        flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
        try:
            self.fd = os.open(self.path, flags)
        except OSError as exc:
            raise ReadError(f"cannot open {self.path}{' with O_DIRECT' if direct else ''}: {exc.strerror}") from exc

    def check_ops(self, ops: Sequence[ReadOp]) -> None:
        for op in ops:
            if op.offset < 0 or len(op.dest) == 0:
                raise ReadError(f"bad read of {len(op.dest)} bytes at offset {op.offset} in {self.path}")
            if self.direct and (op.offset % PAGE_BYTES or len(op.dest) % PAGE_BYTES
                                or buffer_address(op.dest) % PAGE_BYTES):
                raise ReadError(f"O_DIRECT read at offset {op.offset} of {len(op.dest)} bytes in {self.path} "
                                f"is not 4096-aligned in offset, length and destination")

    def register(self, region: memoryview | None, granule: int = PAGE_BYTES) -> bool:
        """Offer `region` (memory most reads land in, made of whole `granule`s) for the backend to
        register, replacing any earlier offer; None withdraws it. Returns whether the backend uses
        it: only io_uring does (fixed buffers). Reads anywhere else keep working either way."""
        return False

    def file_identity(self) -> tuple[int, int]:
        info = os.fstat(self.fd)
        return info.st_dev, info.st_ino

    @abstractmethod
    def submit(self, ops: Sequence[ReadOp], on_read: OnRead | None = None) -> PendingBatch: ...

    @abstractmethod
    def complete(self, batch: PendingBatch) -> None: ...

    def read(self, ops: Sequence[ReadOp], on_read: OnRead | None = None) -> None:
        self.complete(self.submit(ops, on_read))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> str:
        return f"{self.name} ({'O_DIRECT' if self.direct else 'buffered'})"

    def raise_failures(self, batch: PendingBatch) -> None:
        if batch.failures:
            raise describe_failures(self.path, len(batch.ops), batch.failures)
