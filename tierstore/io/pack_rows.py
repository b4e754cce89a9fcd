"""Reading rows of a pack: layer presence, batched reads, and checksum verification before any
row is handed on. A row that fails its checksum is never returned as good data.

Each row is verified as soon as its own read has finished, on a small verification pool, while
the rest of the batch is still being read; the batch's last read to finish has nothing left to
overlap with, so its row is verified on the thread that read it (a batch of one row never waits
for the pool's wake-up). `read_rows` returns only when every read and every verification of the
batch is done."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

from tierstore.errors import PackFormatError, ReadError
from tierstore.io.checksum import row_checksum
from tierstore.io.pack import Pack
from tierstore.io.readers.base import ReadOp, Reader


class PackRows:
    """Rows of `pack`, read through `reader` (which must be open on the pack file itself).

    `read_rows(keys, dests)` reads row `keys[i]` = (layer, expert) into `dests[i]`, a writable
    memoryview of `stride` bytes (the row's payload first, then page padding). It raises ReadError
    or PackFormatError if any read fails or any row fails its checksum; destinations are then
    undefined and must not be used.
    """

    def __init__(self, pack: Pack, reader: Reader, verify_threads: int = 1):
        if reader.file_identity() != pack.inode:
            raise PackFormatError(f"reader is open on another file than {pack.path} (a new generation?); reopen both")
        self.pack = pack
        self.reader = reader
        spec = pack.spec
        self.num_layers, self.num_experts = spec.num_layers, spec.num_experts
        self.row_bytes, self.stride = spec.row_bytes, spec.stride
        if verify_threads < 1:
            raise ValueError(f"verify_threads must be >= 1, got {verify_threads}")
        self._verifier = ThreadPoolExecutor(max_workers=verify_threads, thread_name_prefix="tierstore-verify")

    def has_layer(self, layer: int) -> bool:
        return self.pack.has_layer(layer)

    def read_rows(self, keys: Sequence[tuple[int, int]], dests: Sequence[memoryview]) -> None:
        if len(keys) != len(dests):
            raise ValueError(f"{len(keys)} keys but {len(dests)} destinations")
        ops = []
        for (layer, expert), dest in zip(keys, dests):
            if not self.pack.has_layer(layer):
                raise PackFormatError(f"layer {layer} is not written in {self.pack.path}")
            if len(dest) != self.stride:
                raise ReadError(f"destination of row ({layer}, {expert}) is {len(dest)} bytes, expected {self.stride}")
            ops.append(ReadOp(self.pack.spec.row_offset(layer, expert), dest))
        checks: dict[int, Future] = {}
        sums: dict[int, str] = {}
        unread = [len(ops)]
        counting = threading.Lock()

        def verify(index: int) -> None:  # called as each read finishes, maybe on a reader thread
            with counting:
                unread[0] -= 1
                last = not unread[0]
            if last:  # no read left to overlap with: a hand-off to the pool would only add its wake-up
                sums[index] = row_checksum(dests[index][:self.row_bytes])
            else:
                checks[index] = self._verifier.submit(row_checksum, dests[index][:self.row_bytes])

        try:
            self.reader.read(ops, on_read=verify)
        finally:
            wait(checks.values())  # no verification is left reading memory the caller may reuse
        sums.update((index, check.result()) for index, check in checks.items())
        bad = [key for index, key in enumerate(keys) if sums[index] != self.pack.checksum(*key)]
        if bad:
            listed = ", ".join(f"({layer}, {expert})" for layer, expert in bad[:8])
            raise PackFormatError(f"{len(bad)} row(s) of {self.pack.path} fail their checksum: {listed}; "
                                  "run `tierstore verify` and rebuild the pack")

    def register_memory(self, region: memoryview | None) -> bool:
        """Offer memory made of whole rows (`stride` bytes each; the arena's slots) to the reader
        for registration (io_uring fixed buffers); None withdraws it. Returns whether it is used."""
        return self.reader.register(region, self.stride)

    def close(self) -> None:
        self.reader.close()
        self._verifier.shutdown(wait=True)
