"""The pass's own fetch (`pass_gather.cu`): per MoE layer, plan which missing experts go to which spare slots
(`plan_pass_gather`, one block), then copy their rows from pinned host memory (`gather_pass_rows`). `PassGatherCuda`
builds and launches both on the current stream (capturable); `plan_pass_gather_ref` is the plain-torch reference
of the plan and `gather_rows_ref` of the copy, which the CPU runtime runs as its stand-in.

Buffers (see the .cu file): `GatherBuffers` holds the device ones the runtime owns: state int32 [3] (armed spares,
cursor, rows of the last plan), spares int32 [C, 2] (slot, victim key id or -1), addresses int64 [L * E] (host
address of each expert's arena row, 0 = not held) and desc int64 [R, 2]; `gathered` int32 [1 + 3C] lives in the pass
log's buffer (it comes back with the pass-log read).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCE = Path(__file__).resolve().with_name("pass_gather.cu")
PLAN_THREADS = 1024  # the .cu file's kPlanThreads: at most this many experts per layer, this many spares a window
COPY_THREADS = 256
COPY_BLOCKS_PER_SM = 2  # the copy's grid: this many blocks per SM share every row (one row alone keeps them all busy)
ALIGN = 16  # bytes: rows, row addresses and slots are copied in 16-byte words


@dataclass
class GatherBuffers:
    control: torch.Tensor  # int32 [3 + 2C]: state, then spares (what the host writes before a pass, in one copy)
    state: torch.Tensor  # int32 [3], a view of control
    rows: torch.Tensor  # int32 [1], state[2]: the rows of the last plan, where a copy after it on one stream reads them
    spares: torch.Tensor  # int32 [C, 2], a view of control
    addresses: torch.Tensor  # int64 [L * E]
    desc: torch.Tensor  # int64 [R, 2]

    @classmethod
    def allocate(cls, capacity: int, num_keys: int, max_rows: int, device) -> GatherBuffers:
        return cls.over(torch.zeros(3 + 2 * capacity, dtype=torch.int32, device=device),
                        torch.zeros(num_keys, dtype=torch.int64, device=device),
                        torch.zeros(max_rows, 2, dtype=torch.int64, device=device))

    @classmethod
    def over(cls, control: torch.Tensor, addresses: torch.Tensor, desc: torch.Tensor) -> GatherBuffers:
        """The buffers over these tensors, state and spares as views of `control`."""
        return cls(control, control[:3], control[2:3], control[3:].view(-1, 2), addresses, desc)


def check_alignment(row_bytes: int, slot_bytes: int, stride: int, base: int) -> None:
    """ValueError unless rows, slots, the arena's stride and its base address are multiples of 16 bytes."""
    for name, value in (("row bytes", row_bytes), ("slot bytes", slot_bytes), ("arena stride", stride),
                        ("arena address", base)):
        if value % ALIGN:
            raise ValueError(f"the pass's gather copies 16-byte words: {name} {value} is not a multiple of {ALIGN}")


class PassGatherCuda:
    """Builds (nvcc, cached) and loads both kernels once; `__call__` launches them for one layer."""

    def __init__(self, device: int | None = None) -> None:
        from tierstore.kernels.cuda import loader

        self.device = torch.cuda.current_device() if device is None else device
        torch.cuda.init()
        image = loader.build(SOURCE)
        self.plan = loader.load(image, "plan_pass_gather", self.device)
        self.gather = loader.load(image, "gather_pass_rows", self.device)
        self.copy_blocks = COPY_BLOCKS_PER_SM * torch.cuda.get_device_properties(self.device).multi_processor_count

    def __call__(self, layer: int, seen: torch.Tensor, prev_seen: torch.Tensor, w2_table: torch.Tensor,
                 f4_table: torch.Tensor, buffers: GatherBuffers, gathered: torch.Tensor, slots: torch.Tensor,
                 row_bytes: int) -> None:
        """Plan and copy `layer`'s rows, one after the other on the current stream."""
        self.plan_layer(layer, seen, prev_seen, w2_table, f4_table, buffers, gathered, slots)
        self.copy_rows(buffers.desc, buffers.rows, row_bytes)

    def plan_layer(self, layer: int, seen: torch.Tensor, prev_seen: torch.Tensor, w2_table: torch.Tensor,
                   f4_table: torch.Tensor, buffers: GatherBuffers, gathered: torch.Tensor, slots: torch.Tensor,
                   desc: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                   done: torch.Tensor | None = None) -> None:
        """Plan `layer`'s rows on the current stream into `desc` (int64 [R, 2]) and `rows` (int32, one word);
        default: the buffers' desc and rows (state[2]). `done` (int32, one device word): set to 1 when no row was
        planned."""
        num_layers, num_experts = w2_table.shape
        if num_experts > PLAN_THREADS:
            raise ValueError(f"the pass's gather plans up to {PLAN_THREADS} experts per layer, got {num_experts}")
        desc = buffers.desc if desc is None else desc
        rows = buffers.rows if rows is None else rows
        stream = torch.cuda.current_stream().cuda_stream
        self.plan.launch((1,), (PLAN_THREADS,), 0, stream, "pppppppppppiiipq",
                         [seen.data_ptr(), prev_seen.data_ptr(), w2_table.data_ptr(), f4_table.data_ptr(),
                          buffers.addresses.data_ptr(), buffers.state.data_ptr(), buffers.spares.data_ptr(),
                          gathered.data_ptr(), desc.data_ptr(), rows.data_ptr(),
                          done.data_ptr() if done is not None else 0, layer, num_experts, num_layers,
                          slots.data_ptr(), slots.shape[1]])

    def copy_rows(self, desc: torch.Tensor, rows: torch.Tensor, row_bytes: int, blocks: int | None = None,
                  active: torch.Tensor | None = None) -> None:
        """Copy the `rows[0]` rows `desc` describes, on the current stream, over a grid of `blocks` blocks (default:
        a few per SM) of which `active[0]` work (int32, one device word read when the kernel runs; None: all)."""
        stream = torch.cuda.current_stream().cuda_stream
        working = active.data_ptr() if active is not None else 0
        self.gather.launch((blocks or self.copy_blocks,), (COPY_THREADS,), 0, stream, "ppqp",
                           [rows.data_ptr(), desc.data_ptr(), row_bytes, working])


def plan_pass_gather_ref(layer: int, seen: torch.Tensor, prev_seen: torch.Tensor, w2_table: torch.Tensor,
                         f4_table: torch.Tensor, buffers: GatherBuffers, gathered: torch.Tensor, slot_base: int,
                         slot_bytes: int, desc: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> None:
    """What `plan_pass_gather` writes, in plain torch on the same tensors (any device): the layer's routed experts
    in neither pool whose rows the arena holds, ascending, take the eligible spares from the cursor on in order (a
    spare is eligible when it is free, or when its victim still maps to its slot and neither the pass before nor
    this one so far routed it; the runtime passes `prev_seen` all zero unless config gather_keeps_recent), as many
    as both allow; victims unmapped, experts mapped, (key, slot, victim)
    appended to `gathered`, `desc` and `rows` (default: the buffers' desc and rows, state[2]) and the state updated,
    and the last layer disarms."""
    desc = buffers.desc if desc is None else desc
    rows = buffers.rows if rows is None else rows
    num_layers, num_experts = w2_table.shape
    flat_table, flat_f4, flat_seen = w2_table.view(-1), f4_table.view(-1), seen.view(-1)
    flat_prev = prev_seen.view(-1)
    armed, cursor, _ = buffers.state.tolist()
    keys = torch.arange(layer * num_experts, (layer + 1) * num_experts, device=w2_table.device)  # [E]
    sources = buffers.addresses[keys]  # [E]
    need = (flat_seen[keys] > 0) & (flat_table[keys] < 0) & (flat_f4[keys] < 0) & (sources != 0)
    need &= cursor < armed
    wanted = keys[need].tolist()
    window = buffers.spares[cursor:min(armed, cursor + PLAN_THREADS)].tolist()  # [(slot, victim)]
    eligible = [(cursor + i, slot, victim) for i, (slot, victim) in enumerate(window)
                if victim < 0 or (int(flat_seen[victim]) == 0 and int(flat_prev[victim]) == 0
                                  and int(flat_table[victim]) == slot)]
    take = min(len(wanted), len(eligible))
    first = int(gathered[0])
    entries = gathered[1:].view(-1, 3)
    for rank in range(take):
        key, (_, slot, victim) = wanted[rank], eligible[rank]
        if victim >= 0:
            flat_table[victim] = -1
        flat_table[key] = slot
        entries[first + rank] = torch.tensor([key, slot, victim], dtype=torch.int32)
        desc[rank, 0] = int(buffers.addresses[key])
        desc[rank, 1] = slot_base + slot * slot_bytes
    gathered[0] = first + take
    buffers.state[1] = eligible[take - 1][0] + 1 if take else cursor
    rows[0] = take
    if layer == num_layers - 1:
        buffers.state[0] = 0


def gather_rows_ref(buffers: GatherBuffers, row_bytes: int, desc: torch.Tensor | None = None,
                    rows: torch.Tensor | None = None) -> None:
    """What `gather_pass_rows` does, for host memory (a CPU pool): the first `rows[0]` rows of `desc` by address
    (default: the buffers' desc and rows (state[2]), the last plan's)."""
    desc = buffers.desc if desc is None else desc
    count = int((buffers.rows if rows is None else rows)[0])
    for source, destination in desc[:count].tolist():
        ctypes.memmove(destination, source, row_bytes)
