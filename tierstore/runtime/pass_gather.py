"""The pass's own fetch (config `gather_in_pass`): the device buffers, the spares staged for a pass and armed at its
launch, and the per-layer launches; the runtime (`TieredRuntime`) keeps the host state in step with what each pass
did.

While pass N runs, before its pass-log read, the host stages the spares of pass N+1 (`stage`: free slots no pass
or install may have taken since, then the first experts of the policy's eviction order as victims with their
slots) in pinned memory; launching N+1, `arm_staged` copies them to the device (one copy on the compute stream,
two when the arena's rows moved and their addresses go along). Since they were planned before N's results were
known, the device uses a victim's spare only while it still holds (`kernels/cuda/pass_gather.cu`: the victim
still maps to that slot, and neither N nor N+1 so far routed it; `begin_pass` keeps N's routed counts for N+1;
config `gather_keeps_recent` false drops the first condition).
Before each MoE layer's experts (after the pass log recorded the layer's routing) `layer()` plans and copies that
layer's missing rows (CUDA C++ on a CUDA device, the torch reference on a CPU). The pass-log read brings back what
was mapped (`PassLog.host_gathered`) and the runtime maps it on the host later, off the step's path
(`DevicePool.map_gathered`, from `TieredRuntime.settle`). The last MoE layer disarms the spares, so a pass that was
not armed (prefill, a pass outside `step`, a replay after a host fetch) gathers nothing; `disarm()` does it on the
stream for a pass that failed before its end.

A host fetch drops the staged spares (its installs may take their free slots, and its copies run while the replay
would gather), so a pass is armed only when no install's copies are in flight and its free spares are free.

`paired` (config `pass_pair`): the first pass of a pass pair plans each layer after the layer's experts ran
(`plan_and_fork`: they saw its missing experts as misses) and copies the rows on a side stream, each layer into its
own descriptors, while the pass goes on; the replay waits for a layer's rows before that layer (`wait_rows`). With
`plans` "stream" (config `pass_pair_plans`, kernel copies on CUDA) the plans run on a stream of their own, each after
its layer's experts, so the first pass does not wait for them; the replay starts after the last (`join_plans`): no
replay kernel runs while a plan unmaps a victim or reads the routed counts the replay's reset zeroes. A later layer
of the first pass may then read a victim being taken (stale, or its slot's new bytes): only that pass's result,
which the replay replaces, can be wrong; the replay finds the victim unmapped. With `plans` "inline" each plan runs
on the compute stream between its layer and the next, so nothing in the first pass reads a slot being written.
On a CPU both are done at once by the references.
With `copies` "engine" (config `pass_pair_copies`, CUDA) the copy engine moves the rows instead of a kernel: the
plan writes each layer's descriptors and row count to pinned host memory; the host, after launching the pair,
waits for each layer's count (`serve`), issues its rows on a copy stream and then writes the layer's flag there;
the replay waits for the flag (a stream wait on a device word, `StreamValues`); a plan of no rows sets its flag
itself, so a pair nobody serves (a capture's warm-up, unarmed) runs through. `serve` writes every flag it has not
written when it stops, so a failure on the host never leaves the replay waiting.
With kernel copies the pair's copy grid has `max(copy_blocks, wide_blocks)` blocks, of which a device word says how
many work: `copy_blocks` or `wide_blocks` (config `pass_pair_copy_blocks`, `pass_pair_wide_blocks`), set between
launches by `use_wide_copies` (the runtime's timed choice of the grid), so one captured pair serves both.
"""

from __future__ import annotations

import time

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
    def __init__(self, pool: DevicePool, arena: Arena, log: PassLog, capacity: int, paired: bool = False,
                 copy_blocks: int | None = None, copies: str = "kernel", plans: str = "stream",
                 keeps_recent: bool = False, wide_blocks: int = 0):
        knob = "pass_pair" if paired else "gather_in_pass"
        if log.gathered is None or (log.gathered.numel() - 1) // 3 != capacity:
            raise ValueError(f"the pass log needs gather_capacity={capacity}")
        if pool.num_experts > PLAN_THREADS:
            raise ConfigError(f"{knob} plans up to {PLAN_THREADS} experts per layer; this model has "
                              f"{pool.num_experts}: turn it off")
        if arena.num_slots == 0:
            raise ConfigError(f"{knob} copies rows from the arena; this runtime has none (give it an arena)")
        try:
            check_alignment(arena.source.row_bytes, pool.slot_bytes, arena.stride, arena.memory.data_ptr())
        except ValueError as error:
            raise ConfigError(f"{knob}: {error}") from None
        self.pool, self.arena, self.log, self.capacity, self.paired = pool, arena, log, capacity, paired
        self.device = pool.device
        self.row_bytes = arena.source.row_bytes
        self.buffers = GatherBuffers.allocate(capacity, pool.num_layers * pool.num_experts, pool.num_experts,
                                              self.device)
        # [L, E] the routed counts of the pass before (`begin_pass`); all zero when a victim it routed may be taken
        self.prev_seen = torch.zeros_like(log.seen)
        self.keeps_recent = keeps_recent  # config gather_keeps_recent
        cuda = self.device.type == "cuda"
        # two host stagings of the control words, used in turn: the one armed last may still be on its way
        self._controls = [torch.zeros_like(self.buffers.control, device="cpu", pin_memory=cuda) for _ in range(2)]
        self._disarmed = torch.zeros(1, dtype=torch.int32, pin_memory=cuda)  # what `disarm` writes
        self._staged: tuple[int, int, set[int]] | None = None  # (staging index, spares, their free slots)
        self._next_staging = 0
        self.armed_free: set[int] = set()  # free slots armed for the last pass launched (it may have taken them)
        self._addresses = torch.zeros_like(self.buffers.addresses, device="cpu", pin_memory=cuda)  # [L * E]
        self._addresses_synced = -1  # the arena version the device's addresses hold
        self._no_fp4 = torch.full_like(pool.table, -1)  # [L, E] the FP4 table of a runtime without an FP4 pool
        self._kernels = None
        # the paired copies' grid (None: the kernels' default, a few per SM) and, CUDA pairs with a wide grid, the
        # device word of its working blocks ([1] int32)
        self._copy_grid, self._working_blocks = copy_blocks, None
        self._plans = None  # the plans' own stream (CUDA, paired, kernel copies, plans "stream")
        self.engine = paired and copies == "engine" and cuda  # the host issues the pair's copies (CUDA only)
        if paired:  # each layer's rows described apart: a layer's copy may still run while later layers plan
            place = dict(pin_memory=True) if self.engine else dict(device=self.device)
            self.layer_desc = torch.zeros(pool.num_layers, pool.num_experts, 2, dtype=torch.int64, **place)  # [L, E, 2]
            self.layer_rows = torch.zeros(pool.num_layers, dtype=torch.int32, **place)  # [L]
        if cuda:
            from tierstore.kernels.cuda.loader import CudaError
            from tierstore.kernels.cuda.pass_gather import PassGatherCuda
            from tierstore.runtime.h2d import HostToDevice

            try:
                self._kernels = PassGatherCuda(self.device.index)
            except (CudaError, OSError) as error:
                raise ConfigError(f"{knob}: its CUDA kernels did not build or load ({error}); they need "
                                  "nvcc and an sm_90a (Hopper) GPU, or turn it off") from None
            self._h2d = HostToDevice(self.device)
            self._stream_index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            if paired:  # the copies keep the bus busy: their blocks go first where SMs free up
                self._side = torch.cuda.Stream(self.device, priority=-1)
                self._planned = [torch.cuda.Event() for _ in range(pool.num_layers)]
                self._copied = [torch.cuda.Event() for _ in range(pool.num_layers)]
                if wide_blocks and copy_blocks is not None:  # one grid for both widths, the working blocks a word
                    self._copy_grid = max(copy_blocks, wide_blocks)
                    self._grid_words = torch.tensor([copy_blocks, wide_blocks], dtype=torch.int32).pin_memory()
                    self._working_blocks = torch.full((1,), copy_blocks, dtype=torch.int32, device=self.device)
                    self._wide = False
            # kernel copies, plans on a stream of their own (config pass_pair_plans "stream"): each after its layer's
            # experts (`_layer_done`), in layer order, off the first pass's path
            self._plans = (torch.cuda.Stream(self.device, priority=-1)
                           if paired and not self.engine and plans == "stream" else None)
            self._layer_done = [torch.cuda.Event() for _ in range(pool.num_layers)] if self._plans is not None else None
            if self.engine:
                from tierstore.runtime.stream_values import StreamValues

                self._values = StreamValues(self.device)
                try:
                    self._values.probe()
                except RuntimeError as error:
                    raise ConfigError(f"pass_pair_copies engine needs stream memory operations ({error}); use "
                                      "pass_pair_copies kernel") from None
                self._flags = torch.zeros(pool.num_layers, dtype=torch.int32, device=self.device)  # [L] 1 = landed

    def stage(self, slots: list[int], victims: list[int]) -> None:
        """The next pass's spares: `slots` with their `victims` (-1: a free slot, which no pass or install may take
        before that pass; `DevicePool.ahead_spares`), at most `capacity`, in pinned memory until `arm_staged`."""
        count = min(len(slots), self.capacity)
        words = [count, 0, 0]  # the state, then (slot, victim) per spare: one assignment
        for slot, victim in zip(slots[:count], victims[:count]):
            words += (slot, victim)
        index = self._next_staging
        self._next_staging = 1 - index
        self._controls[index].numpy()[:len(words)] = words
        self._staged = (index, count, {slot for slot, victim in zip(slots[:count], victims[:count]) if victim < 0})

    def drop_staged(self) -> None:
        """Forget the staged spares (a host fetch may have taken their free slots): the next pass is not armed."""
        self._staged = None

    def arm_staged(self) -> None:
        """Before a decode pass is launched: arm the staged spares for it (none staged: it gathers nothing). One copy
        on the compute stream; the arena's row addresses go first when they moved."""
        if self._staged is None:
            self.armed_free = set()
            return
        index, count, self.armed_free = self._staged
        self._staged = None
        if self.arena.version != self._addresses_synced:
            self._addresses.numpy()[:] = self.arena.address_array()
            self._addresses_synced = self.arena.version
            self._write(self.buffers.addresses, self._addresses, self._addresses.numel())
        self._write(self.buffers.control, self._controls[index], 3 + 2 * count)

    def disarm(self) -> None:
        """No spares for the next pass (on the stream: after anything launched so far) and none staged."""
        self._staged = None
        self._write(self.buffers.control, self._disarmed, 1)

    def _write(self, device: torch.Tensor, host: torch.Tensor, count: int) -> None:
        """device[:count] := host[:count]: on the compute stream (CUDA; the host copy stays untouched until the
        pass-log read after the next has synchronised it), or at once (CPU)."""
        if self._kernels is None:
            device[:count].copy_(host[:count])
            return
        stream = torch.cuda.current_stream(self._stream_index)
        self._h2d.copy(device.data_ptr(), host.data_ptr(), count * host.element_size(), stream)

    def begin_pass(self) -> None:
        """At the start of a pass, before its routed counts are zeroed: keep the last pass's (capturable; nothing
        without `keeps_recent`, whose `prev_seen` stays zero)."""
        if self.keeps_recent:
            self.prev_seen.copy_(self.log.seen)

    def has_staged(self) -> bool:
        return self._staged is not None

    def sync(self) -> None:
        """Wait for every launched plan and copy (CUDA; the side stream too)."""
        if self._kernels is not None:
            torch.cuda.current_stream(self._stream_index).synchronize()
            if self.paired:
                self._side.synchronize()
            if self._plans is not None:
                self._plans.synchronize()

    def plan_and_fork(self, layer: int, f4_table: torch.Tensor | None) -> None:
        """Pass pair, first pass, after `layer`'s experts: plan its missing rows (on the plans' stream, or inline on
        the compute stream) and copy them on the side stream (CUDA; capturable: the replay's `join_plans` and
        `wait_rows` join them), or both at once (CPU)."""
        pool, buffers, log = self.pool, self.buffers, self.log
        f4 = f4_table if f4_table is not None else self._no_fp4
        desc, rows = self.layer_desc[layer], self.layer_rows[layer:layer + 1]
        if self._kernels is None:
            self._plan_ref(layer, f4, desc, rows)
            return
        if self.engine and layer == 0:
            self._flags.zero_()  # before any plan of this pass: the host's writes for it follow a plan
        compute = torch.cuda.current_stream(self._stream_index)
        plans = compute
        if self._plans is not None:  # the plan after this layer's experts, the pass going on meanwhile
            self._layer_done[layer].record(compute)
            self._plans.wait_event(self._layer_done[layer])
            plans = self._plans
        with torch.cuda.stream(plans):
            self._kernels.plan_layer(layer, log.seen, self.prev_seen, pool.table, f4, buffers, log.gathered,
                                     pool.slots, desc, rows, self._flags[layer:layer + 1] if self.engine else None)
        if self.engine:
            return
        self._planned[layer].record(plans)
        self._side.wait_event(self._planned[layer])
        with torch.cuda.stream(self._side):
            self._kernels.copy_rows(desc, rows, self.row_bytes, self._copy_grid, self._working_blocks)
            self._copied[layer].record(self._side)

    def use_wide_copies(self, wide: bool) -> None:
        """Before a pair is launched (kernel copies on CUDA with a wide grid; otherwise nothing): its copies work
        over `wide_blocks` blocks, or `copy_blocks`. The word is written on the compute stream when it changes
        (`_write`, from a pinned constant), so the pair's copies, ordered after that stream's work, read it."""
        if self._working_blocks is None or wide == self._wide:
            return
        self._wide = wide
        self._write(self._working_blocks, self._grid_words[1 if wide else 0:], 1)

    def join_plans(self) -> None:
        """Pass pair, between its passes (CUDA, plans on their own stream; capturable): the replay waits for the
        first pass's last plan, and so for every plan (one stream, in layer order). Its pass-log reset zeroes the
        routed counts the plans read, and a plan may unmap a victim of any layer, which no replay kernel may read
        while it happens."""
        if self._plans is not None:
            torch.cuda.current_stream(self._stream_index).wait_event(self._planned[-1])

    def wait_rows(self, layer: int) -> None:
        """Pass pair, replay, before `layer`'s experts: the compute stream waits for the rows the first pass
        copied for that layer (CUDA; nothing to wait for on a CPU)."""
        if self.engine:
            stream = torch.cuda.current_stream(self._stream_index)
            self._values.wait(stream, self._flags.data_ptr() + 4 * layer, 1)
        elif self._kernels is not None:
            torch.cuda.current_stream(self._stream_index).wait_event(self._copied[layer])

    def before_pair(self) -> None:
        """Engine copies: before a pair is launched, every layer's row count set to 'not planned yet' (-1)."""
        if self.engine:
            self.layer_rows.numpy()[:] = -1

    def serve(self, timeout: float = 10.0) -> None:
        """Engine copies, after launching a pair: each layer's planned rows issued on the copy stream as soon as its
        plan is seen, then the layer's flag written there. RuntimeError when a plan does not show within
        `timeout` seconds; every flag not yet written is written before returning or raising."""
        if not self.engine:
            return
        counts, desc = self.layer_rows.numpy(), self.layer_desc.numpy()
        stream, flags, served = self._side, self._flags.data_ptr(), 0
        try:
            for layer in range(len(counts)):
                if counts[layer] < 0:
                    deadline = time.monotonic() + timeout
                    while counts[layer] < 0:
                        if time.monotonic() > deadline:
                            raise RuntimeError(f"pass pair: layer {layer}'s plan did not show in {timeout} s")
                if counts[layer]:  # a plan of no rows set its flag itself
                    for source, destination in desc[layer, :counts[layer]].tolist():
                        self._h2d.copy(destination, source, self.row_bytes, stream)
                    self._values.write(stream, flags + 4 * layer, 1)
                served += 1
        finally:
            for layer in range(served, len(counts)):
                self._values.write(stream, flags + 4 * layer, 1)

    def recopy_gathered(self) -> None:
        """Engine copies, after a failed step: every row the last pass mapped for itself copied again and waited
        for, so each mapped slot holds its expert's bytes whatever the host issued before it stopped."""
        if not self.engine:
            return
        self.sync()
        gathered = self.log.gathered.cpu().tolist()
        addresses, slots = self.arena.address_table(), self.pool.slots
        for key, slot, _ in (gathered[1 + 3 * i:4 + 3 * i] for i in range(gathered[0])):
            if addresses[key]:  # the plan took only rows the arena holds; none is evicted while a step runs
                self._h2d.copy(slots[slot].data_ptr(), addresses[key], self.row_bytes, self._side)
        self._side.synchronize()

    def _plan_ref(self, layer: int, f4: torch.Tensor, desc: torch.Tensor | None = None,
                  rows: torch.Tensor | None = None) -> None:
        """The CPU stand-in: plan and copy `layer`'s rows with the references."""
        pool, buffers = self.pool, self.buffers
        first = int(self.log.gathered[0])
        plan_pass_gather_ref(layer, self.log.seen, self.prev_seen, pool.table, f4, buffers, self.log.gathered,
                             pool.slots.data_ptr(), pool.slot_bytes, desc, rows)
        gather_rows_ref(buffers, self.row_bytes, desc, rows)
        taken = self.log.gathered[1 + 3 * first:1 + 3 * int(self.log.gathered[0])].view(-1, 3)[:, 1]
        pool.generation[taken.numpy()] += 1  # the CPU compute caches decoded slots by generation

    def layer(self, layer: int, f4_table: torch.Tensor | None) -> None:
        """Plan and copy `layer`'s missing rows (after the pass log recorded its routing, before its experts);
        `f4_table`: the FP4 pool's table, if any (its experts do not miss). Capturable on CUDA."""
        pool, buffers = self.pool, self.buffers
        f4 = f4_table if f4_table is not None else self._no_fp4
        if self._kernels is not None:
            self._kernels(layer, self.log.seen, self.prev_seen, pool.table, f4, buffers, self.log.gathered,
                          pool.slots, self.row_bytes)
            return
        self._plan_ref(layer, f4)
