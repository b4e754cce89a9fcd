"""What one forward pass tells the host: missing pairs, missing experts, routed experts.

The device tensors are written by the MoE layers (inside a CUDA graph on CUDA) and zeroed at
the start of every pass by the first MoE layer; `read()` brings them to the host with one
synchronisation, the only one of a pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

Key = tuple[int, int]


@dataclass(frozen=True)
class PassReport:
    missing_pairs: int
    missing_keys: tuple[Key, ...]  # distinct, as logged (at most the log's capacity)
    unlogged_experts: int  # missing experts past the log's capacity (found again by the next pass)
    routed_keys: tuple[Key, ...]  # every (layer, expert) routed in this pass
    routing: np.ndarray | None  # int32 [layers, T, k] routed ids, when recording


class PassLog:
    """counts int32 [2] = (missing pairs, missing experts); entries int32 [cap, 2] = (layer, expert);
    seen int32 [L, E] = routed pairs per expert; routing int32 [L, T_max, k] when recording."""

    def __init__(self, num_layers: int, num_experts: int, top_k: int, capacity: int, device,
                 record_tokens: int = 0):
        self.device = torch.device(device)
        self.counts = torch.zeros(2, dtype=torch.int32, device=self.device)
        self.entries = torch.full((capacity, 2), -1, dtype=torch.int32, device=self.device)
        self.seen = torch.zeros(num_layers, num_experts, dtype=torch.int32, device=self.device)
        self.routing = (torch.full((num_layers, record_tokens, top_k), -1, dtype=torch.int32, device=self.device)
                        if record_tokens else None)
        self.record_tokens = record_tokens
        pin = self.device.type == "cuda"
        self._host = [torch.empty_like(t, device="cpu", pin_memory=pin) for t in self._device_tensors()]

    def _device_tensors(self) -> list[torch.Tensor]:
        tensors = [self.counts, self.entries, self.seen]
        return tensors + ([self.routing] if self.routing is not None else [])

    def reset(self) -> None:
        """Start a pass (called from the first MoE layer; capturable)."""
        self.counts.zero_()
        self.seen.zero_()

    def record(self, layer: int, topk_ids: torch.Tensor) -> None:
        """Count the routed pairs of `layer` (topk_ids int [T, k]); capturable."""
        flat = topk_ids.reshape(-1).to(torch.int64)  # [T * k]
        self.seen[layer].index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        if self.routing is not None and topk_ids.shape[0] <= self.record_tokens:
            self.routing[layer, :topk_ids.shape[0]].copy_(topk_ids)

    def read(self) -> PassReport:
        for host, dev in zip(self._host, self._device_tensors()):
            host.copy_(dev, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        counts, entries, seen = (t.numpy() for t in self._host[:3])
        logged = min(int(counts[1]), entries.shape[0])
        missing = tuple(map(tuple, entries[:logged].tolist()))
        routed = tuple(zip(*(axis.tolist() for axis in np.nonzero(seen > 0))))  # row-major, as argwhere
        routing = self._host[3].numpy().copy() if self.routing is not None else None
        return PassReport(int(counts[0]), missing, int(counts[1]) - logged, routed, routing)
