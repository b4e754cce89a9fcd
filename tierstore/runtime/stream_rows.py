"""Where each expert's row lies in the pinned arena, for passes that compute missing experts from it (config
`stream_arena`).

A streaming pass (`moe_mm(..., stream=True)`: the route's, the Triton stages' and the combine's STREAM, or
`W2MoeCuda(stream=True)`'s builds for the batches it serves) computes a pair whose expert has no slot in the device
pool from the expert's arena row, read over the bus: the same bytes a slot would
hold, hence the same result, with no replay. `StreamRows.at` is the table those kernels read, int64 [layers * E]:
the row's address minus the pool slots' address (so a kernel adds it where it would add a slot's offset), 0 where
the arena has no row. On a CPU runtime `row(key_id)` gives the row itself to `TorchExperts`.

Contract: a row the table names is never rewritten while a pass may read it. The runtime guarantees it by
streaming only from an arena that holds every expert (`check_arena`): such an arena never evicts, so a published row
stays where it is until the arena closes, after the last pass. `refresh(arena)` publishes rows the arena gained since
(a copy between steps, only when its `version` moved).
"""

from __future__ import annotations

import numpy as np
import torch

from tierstore.cache.arena import Arena
from tierstore.errors import ConfigError

ROW_ALIGN = 16  # the kernels' widest load (uint4)


def check_arena(arena_slots: int, total_experts: int) -> None:
    """ConfigError unless an arena of `arena_slots` rows holds every one of `total_experts` routed experts."""
    if arena_slots < total_experts:
        raise ConfigError(f"stream_arena computes missing experts from their arena rows while passes run, so the "
                          f"arena must hold every routed expert and never evict: it has {arena_slots} slots for "
                          f"{total_experts} experts (give it at least {total_experts}, or turn stream_arena off)")


class StreamRows:
    def __init__(self, pool_slots: torch.Tensor, num_layers: int, num_experts: int):
        self._base = pool_slots.data_ptr()
        self.device = pool_slots.device
        self.at = torch.zeros(num_layers * num_experts, dtype=torch.int64, device=self.device)  # [L * E]
        self._rows: list[torch.Tensor | None] = [None] * (num_layers * num_experts)  # CPU: each id's row
        self._published = np.zeros(num_layers * num_experts, dtype=np.int64)  # [L * E] CPU: the addresses of `_rows`
        self._version = -1
        # every expert has a published row: a streaming pass lacks none (the CUDA multi-token kernels' batches still miss)
        self.complete = False

    def refresh(self, arena: Arena) -> None:
        """Publish the arena's rows (between passes); nothing when the arena's rows are as last published."""
        if arena.version == self._version:
            return
        rows = arena.address_array()  # [L * E] host address, 0: no row
        misaligned = np.flatnonzero(rows % ROW_ALIGN)
        if misaligned.size:
            raise ConfigError(f"stream_arena: arena row at {int(rows[misaligned[0]]):#x} is not {ROW_ALIGN}-byte "
                              f"aligned")
        offsets = np.where(rows != 0, rows - self._base, 0)
        self.at.copy_(torch.from_numpy(offsets))  # a host copy: done on return, rare (the arena grew)
        if self.device.type == "cpu":  # only the ids whose row moved
            moved = np.flatnonzero(rows != self._published)
            for key_id, address in zip(moved.tolist(), rows[moved].tolist()):
                self._rows[key_id] = arena.row_at(address) if address else None
            self._published = rows.copy()
        self._version = arena.version
        self.complete = bool(rows.all())

    def row(self, key_id: int) -> torch.Tensor | None:
        """CPU: the published arena row of `key_id` (uint8 [row_bytes], a view), or None."""
        return self._rows[key_id]
