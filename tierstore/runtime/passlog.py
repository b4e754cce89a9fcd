"""What one forward pass tells the host: missing pairs, missing experts, routed experts.

The device tensors are written by the MoE layers (inside a CUDA graph on CUDA) and zeroed at
the start of every pass by the first MoE layer; `read()` brings them to the host with one
device-to-host copy into pinned memory and one synchronisation, the only ones of a pass.

All of them are views of one int32 device buffer, laid out [gathered | first | counts | seen | entries | routing |
outputs]: `reset()` zeroes the first four with one fill and `read()` copies the whole buffer at once.
`gathered` (`gather_capacity` > 0, the runtime's `gather_in_pass` and `pass_pair`): how many experts the pass
mapped for itself, then (key id, slot, victim key id or -1) of each (`kernels/cuda/pass_gather.py`);
`host_gathered()`. `first` (with `gathered`): the counts of the first pass of a pass pair, which the replay's
`reset(pair_replay=True)` keeps there before it zeroes the counts (and keeps `gathered`); `host_first_missing()`.

With `early_layers` (the runtime's `early_fetch`), `publish_layer(layer)` (capturable, called after a
layer's MoE) also copies that layer's `seen` row to pinned host memory, then a stamp after it on the
same stream, so the host can read a finished layer's routed experts while the pass still runs:
`clear_layers()` zeroes the host stamps before a pass is launched and `layer_seen(layer)` returns the
row once its stamp has landed (the row landed first), without any synchronisation.

`outputs` (`output_words` int32, 0 by default) is for what the caller reads back every step anyway,
e.g. a decoder's sampled token: `publish(values)` at the end of the forward (capturable) writes it
into the buffer, so the pass-log read that the step protocol makes is also the decoder's readback
(one device-to-host copy and one sync per pass instead of two). `PassReport.outputs` holds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

Key = tuple[int, int]


@dataclass(frozen=True, eq=False)
class PassReport:
    missing_pairs: int
    missing_ids: tuple[int, ...]  # layer * E + expert of each missing expert, as logged (at most the log's capacity)
    unlogged_experts: int  # missing experts past the log's capacity (found again by the next pass)
    routing: np.ndarray | None  # int32 [layers, T, k] routed ids, when recording
    num_experts: int = field(repr=False)
    outputs: np.ndarray | None = None  # int32 [output_words]: what the forward published, when asked for
    # int32 [L * E] the log's host copy of the routed counts, valid until the log's next read, which computes
    # `routed_ids` from it first: so that costs nothing between a read and the fetch or the step's return
    _host_seen: np.ndarray | None = field(default=None, repr=False)

    @property
    def read(self) -> bool:
        """False for `UNREAD_PASS`: a pass nobody read (its routed experts are unknown)."""
        return self._host_seen is not None

    @cached_property
    def routed_ids(self) -> np.ndarray:
        """int64 [n] ascending layer * E + expert of every routed expert."""
        if self._host_seen is None:
            raise RuntimeError("this pass was not read (a decode step of a pool holding every expert, where nothing "
                               "can miss), so its routed experts are unknown; config full_pool_reads reads each pass")
        return self._host_seen.nonzero()[0]  # 1-D: ascending = row-major

    @cached_property
    def missing_keys(self) -> tuple[Key, ...]:
        """`missing_ids` as (layer, expert), in the same order."""
        experts = self.num_experts
        return tuple(divmod(key_id, experts) for key_id in self.missing_ids)

    @cached_property
    def routed_keys(self) -> tuple[Key, ...]:
        """Every (layer, expert) routed in this pass, row-major."""
        layers, experts = np.divmod(self.routed_ids, self.num_experts)
        return tuple(zip(layers.tolist(), experts.tolist()))

    @cached_property
    def routed_id_set(self) -> frozenset[int]:
        """`routed_ids` as a set: what a fetch for this pass protects (no key tuples built)."""
        return frozenset(self.routed_ids.tolist())


# what a step reports for a pass it did not read (`TieredRuntime.step` with every expert resident): no miss, by
# construction rather than by a read; its routed experts are unknown
UNREAD_PASS = PassReport(0, (), 0, None, 0)


class PassLog:
    """counts int32 [2] = (missing pairs, missing experts); entries int32 [cap, 2] = (layer, expert);
    seen int32 [L, E] = routed pairs per expert; routing int32 [L, T_max, k] when recording;
    outputs int32 [output_words] written by `publish`; gathered int32 [1 + 3 * gather_capacity]."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, capacity: int, device,
                 record_tokens: int = 0, output_words: int = 0, early_layers: bool = False,
                 gather_capacity: int = 0):
        self.device = torch.device(device)
        self._stream_index = self.device.index if self.device.index is not None else (
            torch.cuda.current_device() if self.device.type == "cuda" else None)  # current_stream by index: fast
        self.num_experts = num_experts
        self.record_tokens = record_tokens
        gathered_words = 1 + 3 * gather_capacity if gather_capacity else 0
        sizes = (gathered_words, 2 if gather_capacity else 0, 2, num_layers * num_experts, 2 * capacity,
                 num_layers * record_tokens * top_k, output_words)
        self.buffer = torch.zeros(sum(sizes), dtype=torch.int32, device=self.device)
        gathered, first, counts, seen, entries, routing, outputs = self.buffer.split(sizes)
        self.gathered = gathered if gather_capacity else None
        self._first = first
        self.outputs = outputs if output_words else None
        self.counts = counts
        self.seen = seen.view(num_layers, num_experts)
        self.entries = entries.view(capacity, 2).fill_(-1)
        self.routing = routing.view(num_layers, record_tokens, top_k).fill_(-1) if record_tokens else None
        self._cleared = self.buffer[:sum(sizes[:4])]
        self._cleared_for_replay = self.buffer[sizes[0] + sizes[1]:sum(sizes[:4])]  # counts and seen
        self._host = torch.empty_like(self.buffer, device="cpu", pin_memory=self.device.type == "cuda")
        host = self._host.numpy()
        (self._host_gathered, self._host_first, self._host_counts, self._host_seen, self._host_entries,
         self._host_routing, self._host_outputs) = np.split(host, np.cumsum(sizes)[:6])
        self._layer_rows = self._layer_stamps = None
        self._last_report: PassReport | None = None  # the last read's, whose routed ids the next read computes first
        if early_layers:
            pin = self.device.type == "cuda"
            self._layer_rows = torch.zeros(num_layers, num_experts, dtype=torch.int32, pin_memory=pin)  # [L, E]
            self._layer_stamps = torch.zeros(num_layers, dtype=torch.int32, pin_memory=pin)  # [L] 1 = row landed
            self._stamp = torch.ones(1, dtype=torch.int32, device=self.device)  # what publish_layer copies
            self._host_layer_rows, self._host_layer_stamps = self._layer_rows.numpy(), self._layer_stamps.numpy()

    def reset(self, pair_replay: bool = False) -> None:
        """Start a pass (called from the first MoE layer; capturable): one fill of gathered, first, counts and seen.
        `pair_replay` (the second pass of a pass pair): the counts go to `first`, then counts and seen are zeroed;
        what the first pass gathered stays."""
        if pair_replay:
            if self.gathered is None:
                raise ValueError("a pass pair needs a pass log with gather_capacity > 0")
            self._first.copy_(self.counts)
            self._cleared_for_replay.zero_()
            return
        self._cleared.zero_()

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Count the routed pairs of `layer` (topk_ids int [T, k]); capturable."""
        flat = topk_ids.reshape(-1).to(torch.int64)  # [T * k]
        self.seen[layer].index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        if self.routing is not None and topk_ids.shape[0] <= self.record_tokens:
            self.routing[layer, :topk_ids.shape[0]].copy_(topk_ids)

    def publish(self, values: torch.Tensor) -> None:
        """Write `values` (integers, at most `output_words` of them, flattened; cast to int32) into
        the outputs, to come back with the next `read()`; capturable (call it at the end of the
        forward, after the value is computed)."""
        if self.outputs is None:
            raise ValueError("this pass log has no outputs: make it with output_words >= 1")
        flat = values.reshape(-1)
        if flat.numel() > self.outputs.numel():
            raise ValueError(f"{flat.numel()} values do not fit {self.outputs.numel()} output words")
        self.outputs[:flat.numel()].copy_(flat)

    def publish_layer(self, layer: int) -> None:
        """Copy `layer`'s routed counts, then its stamp, to pinned host memory (asynchronous on CUDA;
        capturable). Call it after the layer's MoE, so a landed stamp means the layer is done."""
        self._layer_rows[layer].copy_(self.seen[layer], non_blocking=True)
        self._layer_stamps[layer:layer + 1].copy_(self._stamp, non_blocking=True)

    def clear_layers(self) -> None:
        """Zero the host stamps; call it before launching a pass (the last pass has been read, so
        none of its copies is still in flight)."""
        self._host_layer_stamps[:] = 0

    def layer_seen(self, layer: int) -> np.ndarray | None:
        """int32 [E]: `layer`'s routed pairs per expert in the running pass, or None while its
        copy has not landed."""
        return self._host_layer_rows[layer] if self._host_layer_stamps[layer] else None

    def host_routed_counts(self) -> np.ndarray:
        """int32 [L * E]: `host_seen` by key id (layer * E + expert), without a reshape."""
        return self._host_seen

    def host_gathered(self) -> tuple[list[int], list[int], list[int]]:
        """(key ids, slots, victim key ids or -1) of the experts the last `read()` pass mapped for itself, in
        the order it mapped them."""
        count = int(self._host_gathered[0]) if self.gathered is not None else 0
        if not count:
            return [], [], []
        flat = self._host_gathered[1:1 + 3 * count].tolist()
        return flat[0::3], flat[1::3], flat[2::3]

    def host_first_missing(self) -> tuple[int, int]:
        """(missing pairs, missing experts) of the first pass of the pair the last `read()` ended ((0, 0) after a
        pass that was not a pair's replay)."""
        return tuple(self._host_first.tolist()) if self.gathered is not None else (0, 0)

    def host_seen(self) -> np.ndarray:
        """int32 [L, E]: the routed pairs per expert of the last `read()` (a view of its host copy,
        rewritten by the next read)."""
        return self._host_seen.reshape(self.seen.shape)

    def read(self) -> PassReport:
        if self._last_report is not None:  # its routed ids from the host copy, before this read overwrites it
            self._last_report.routed_ids  # a cached property: computed here
        self._host.copy_(self.buffer, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self._stream_index).synchronize()
        pairs, experts = self._host_counts.tolist()
        logged = min(experts, len(self._host_entries) // 2)
        missing = ()
        if logged:  # a no-miss pass builds nothing here
            flat, width = self._host_entries[:2 * logged].tolist(), self.num_experts  # [2 * logged] (layer, expert)...
            missing = tuple([flat[i] * width + flat[i + 1] for i in range(0, len(flat), 2)])
        routing = self._host_routing.reshape(self.routing.shape).copy() if self.routing is not None else None
        outputs = self._host_outputs.copy() if self.outputs is not None else None
        self._last_report = PassReport(pairs, missing, experts - logged, routing, self.num_experts, outputs,
                                       self._host_seen)
        return self._last_report
