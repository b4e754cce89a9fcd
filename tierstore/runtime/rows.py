"""Row sources the host arena reads from, besides a pack (`tierstore.io.pack_rows.PackRows`)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from tierstore.errors import PackFormatError, ReadError

PAGE_BYTES = 4096


class MemoryRowSource:
    """Rows held in RAM: uint8 [layers, experts, row_bytes]. Satisfies the arena's RowSource
    protocol, for tests and for benchmarks without a pack. Reads let other threads run (the FP4
    manager reads while the runner steps): each row is one numpy copy, which releases the GIL and
    stays on the calling thread (a torch copy of a row above its parallel grain starts an OpenMP
    team on the reading thread, whose spinning workers compete with the runner's forward for
    cores; measured in docs/precision-tier.md)."""

    def __init__(self, rows: torch.Tensor):
        if rows.dtype != torch.uint8 or rows.dim() != 3:
            raise PackFormatError(f"rows must be uint8 [layers, experts, row_bytes], got {rows.dtype} {tuple(rows.shape)}")
        self.rows = rows.contiguous()
        self._array = self.rows.numpy()  # [layers, experts, row_bytes], shares memory with `rows`
        self.num_layers, self.num_experts, self.row_bytes = rows.shape
        self.stride = -(-self.row_bytes // PAGE_BYTES) * PAGE_BYTES
        self.reads = 0

    def has_layer(self, layer: int) -> bool:
        return 0 <= layer < self.num_layers

    def read_rows(self, keys: Sequence[tuple[int, int]], dests: Sequence[memoryview]) -> None:
        for (layer, expert), dest in zip(keys, dests, strict=True):
            if len(dest) < self.row_bytes:
                raise ReadError(f"destination of row ({layer}, {expert}) is {len(dest)} bytes, need {self.row_bytes}")
            # a numpy copy releases the GIL (a memoryview assignment would hold it for the whole row)
            np.frombuffer(dest, dtype=np.uint8, count=self.row_bytes)[:] = self._array[layer, expert]
            self.reads += 1


def check_row_source(source, geometry, slot_bytes: int, tier: str) -> None:
    """A row source must hold one row per (layer, expert) of `geometry`, each fitting a kernel slot."""
    shape = (geometry.num_moe_layers, geometry.num_experts)
    if (source.num_layers, source.num_experts) != shape or source.row_bytes > slot_bytes:
        raise PackFormatError(
            f"{tier} row source holds {source.num_layers} x {source.num_experts} rows of {source.row_bytes} bytes; "
            f"the model needs {shape[0]} x {shape[1]} {tier} kernel slots of <= {slot_bytes} bytes "
            f"(was the {tier} pack built with the kernel slot codec?)")
