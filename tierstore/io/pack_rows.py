"""Reading rows of a pack: layer presence, batched reads, and checksum verification before any
row is handed on. A row that fails its checksum is never returned as good data."""

from __future__ import annotations

from collections.abc import Sequence

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

    def __init__(self, pack: Pack, reader: Reader):
        if reader.file_identity() != pack.inode:
            raise PackFormatError(f"reader is open on another file than {pack.path} (a new generation?); reopen both")
        self.pack = pack
        self.reader = reader
        spec = pack.spec
        self.num_layers, self.num_experts = spec.num_layers, spec.num_experts
        self.row_bytes, self.stride = spec.row_bytes, spec.stride

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
        self.reader.read(ops)
        bad = [key for key, dest in zip(keys, dests)
               if row_checksum(dest[:self.row_bytes]) != self.pack.checksum(*key)]
        if bad:
            listed = ", ".join(f"({layer}, {expert})" for layer, expert in bad[:8])
            raise PackFormatError(f"{len(bad)} row(s) of {self.pack.path} fail their checksum: {listed}; "
                                  "run `tierstore verify` and rebuild the pack")

    def close(self) -> None:
        self.reader.close()
