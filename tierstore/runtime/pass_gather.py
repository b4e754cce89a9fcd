"""The pass's own fetch (config `gather_in_pass`): the device buffers, their arming before a pass and the per-layer
launches; the runtime (`TieredRuntime`) keeps the host state in step with what the pass did.

Per decode pass: `arm(slots, victims)` writes the spares (`DevicePool.gather_spares` or `planned_spares`: free
slots, then victims in the policy's eviction order) and, when the arena's rows moved, every expert's row address
to the device, on the compute stream ahead of the launch. Before each MoE layer's experts (after the pass log recorded the layer's
routing) `layer()` plans and copies that layer's missing rows (`kernels/cuda/pass_gather.py`: CUDA C++ on a CUDA
device, the torch reference on a CPU). The pass log's read returns what was mapped (`PassLog.host_gathered`), and
the runtime maps it on the host (`DevicePool.map_gathered`). The last MoE layer disarms the spares, so a pass that
was not armed (prefill, a pass outside `step`) gathers nothing; `disarm()` does it on the stream for a pass that
failed before its end.

Armed only while no install's copies are in flight: the pass then rewrites slots nothing else writes or reads
(the victims' last readers ran earlier on the same stream, or are this pass's finished layers).
"""

from __future__ import annotations

import torch

from tierstore.cache.arena import Arena
from tierstore.errors import ConfigError
from tierstore.kernels.cuda.pass_gather import (GatherBuffers, PLAN_THREADS, check_alignment, gather_rows_ref,
                                                plan_pass_gather_ref)
from tierstore.runtime.passlog import PassLog
from tierstore.runtime.pools import DevicePool


def gather_capacity(num_slots: int, num_layers: int, experts_per_layer: int) -> int:
    """Spares one pass may use: four times the most experts a pass can route, at most the pool."""
    return max(1, min(num_slots, 4 * num_layers * experts_per_layer))


class PassGather:
    def __init__(self, pool: DevicePool, arena: Arena, log: PassLog, capacity: int):
        if log.gathered is None or (log.gathered.numel() - 1) // 3 != capacity:
            raise ValueError(f"the pass log needs gather_capacity={capacity}")
        if pool.num_experts > PLAN_THREADS:
            raise ConfigError(f"gather_in_pass plans up to {PLAN_THREADS} experts per layer; this model has "
                              f"{pool.num_experts}: turn it off")
        if arena.num_slots == 0:
            raise ConfigError("gather_in_pass copies rows from the arena; this runtime has none (give it an arena)")
        try:
            check_alignment(arena.source.row_bytes, pool.slot_bytes, arena.stride, arena.memory.data_ptr())
        except ValueError as error:
            raise ConfigError(f"gather_in_pass: {error}") from None
        self.pool, self.arena, self.log, self.capacity = pool, arena, log, capacity
        self.device = pool.device
        self.row_bytes = arena.source.row_bytes
        self.buffers = GatherBuffers.allocate(capacity, pool.num_layers * pool.num_experts, pool.num_experts,
                                              self.device)
        cuda = self.device.type == "cuda"
        self._control = torch.zeros_like(self.buffers.control, device="cpu", pin_memory=cuda)  # [3 + 2C]
        self._control_ids = self._control.numpy()
        self._addresses = torch.zeros_like(self.buffers.addresses, device="cpu", pin_memory=cuda)  # [L * E]
        self._addresses_synced = -1  # the arena version the device's addresses hold
        self._no_fp4 = torch.full_like(pool.table, -1)  # [L, E] the FP4 table of a runtime without an FP4 pool
        self._kernels = None
        if cuda:
            from tierstore.kernels.cuda.loader import CudaError
            from tierstore.kernels.cuda.pass_gather import PassGatherCuda
            from tierstore.runtime.h2d import HostToDevice

            try:
                self._kernels = PassGatherCuda(self.device.index)
            except (CudaError, OSError) as error:
                raise ConfigError(f"gather_in_pass: its CUDA kernels did not build or load ({error}); they need "
                                  "nvcc and an sm_90a (Hopper) GPU, or turn it off") from None
            self._h2d = HostToDevice(self.device)
            self._stream_index = self.device.index if self.device.index is not None else torch.cuda.current_device()

    def arm(self, slots: list[int], victims: list[int]) -> None:
        """Before a pass is launched: `slots` with their `victims` (-1: a free slot; `DevicePool.gather_spares` or
        `planned_spares`) as its spares, at most `capacity`; none while an install's copies are in flight. One copy
        on the compute stream (two when the arena's rows moved)."""
        armed = min(len(slots), self.capacity) if self.pool.idle() else 0
        pairs = [armed, 0, 0]  # the state, then (slot, victim) per spare: one assignment
        for slot, victim in zip(slots[:armed], victims[:armed]):
            pairs += (slot, victim)
        self._control_ids[:len(pairs)] = pairs
        if self.arena.version != self._addresses_synced:
            self._addresses.numpy()[:] = [address or 0 for address in self.arena.address_table()]
            self._addresses_synced = self.arena.version
            self._write(self.buffers.addresses, self._addresses, self._addresses.numel())
        self._write(self.buffers.control, self._control, 3 + 2 * armed)

    def disarm(self) -> None:
        """No spares for the next pass (on the stream: after anything launched so far)."""
        self._control_ids[0] = 0
        self._write(self.buffers.control, self._control, 1)

    def _write(self, device: torch.Tensor, host: torch.Tensor, count: int) -> None:
        """device[:count] := host[:count]: on the compute stream (CUDA; the host copy stays untouched until the
        next pass-log read has synchronised it), or at once (CPU)."""
        if self._kernels is None:
            device[:count].copy_(host[:count])
            return
        stream = torch.cuda.current_stream(self._stream_index)
        self._h2d.copy(device.data_ptr(), host.data_ptr(), count * host.element_size(), stream)

    def layer(self, layer: int, f4_table: torch.Tensor | None) -> None:
        """Plan and copy `layer`'s missing rows (after the pass log recorded its routing, before its experts);
        `f4_table`: the FP4 pool's table, if any (its experts do not miss). Capturable on CUDA."""
        pool, buffers = self.pool, self.buffers
        f4 = f4_table if f4_table is not None else self._no_fp4
        if self._kernels is not None:
            self._kernels(layer, self.log.seen, pool.table, f4, buffers, self.log.gathered, pool.slots,
                          self.row_bytes)
            return
        first = int(self.log.gathered[0])
        plan_pass_gather_ref(layer, self.log.seen, pool.table, f4, buffers, self.log.gathered, pool.slots.data_ptr(),
                             pool.slot_bytes)
        gather_rows_ref(buffers, self.row_bytes)
        taken = self.log.gathered[1 + 3 * first:1 + 3 * int(self.log.gathered[0])].view(-1, 3)[:, 1]
        pool.generation[taken.numpy()] += 1  # the CPU compute caches decoded slots by generation
