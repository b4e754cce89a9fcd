"""Trace replay through the real runtime (`tierstore replay`): synthetic weights at a geometry's
real shapes in a pack, routing forced from a trace, timed against an all-resident run, a naive
on-demand baseline and the physical floor.

Each step's hidden state is fixed and its routing comes from the trace, so replays see no
second-order misses: what is measured is the fetch + replay path itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tierstore.errors import TraceFormatError
from tierstore.geometry import MoEGeometry
from tierstore.io.layout import PackSpec
from tierstore.io.pack import Pack
from tierstore.io.pack_rows import PackRows
from tierstore.io.pack_writer import PackWriter
from tierstore.io.readers import make_reader
from tierstore.io.readers.choice import direct_io_supported
from tierstore.io.row_codec import row_bytes
from tierstore.kernels.layout import pack_slot, w2_slot_layout
from tierstore.runtime.config import RuntimeConfig
from tierstore.runtime.engine import TieredRuntime
from tierstore.slot_codec import KERNEL_SLOT_CODEC


def synthetic_pack_spec(geometry: MoEGeometry, seed: int) -> PackSpec:
    segments = KERNEL_SLOT_CODEC.segments("base", geometry)
    return PackSpec(tag="base", num_layers=geometry.num_moe_layers, num_experts=geometry.num_experts,
                    row_bytes=row_bytes(segments), checkpoint_id=f"synthetic-{geometry.name}-seed{seed}",
                    abi_tag=KERNEL_SLOT_CODEC.abi_tag, zero_mode="auto", segments=segments)


def ensure_synthetic_pack(geometry: MoEGeometry, pack_dir: Path | str, seed: int = 0) -> PackSpec:
    """A pack of random W2 experts (codes uniform, scale bytes 119..122) in kernel slot layout."""
    spec = synthetic_pack_spec(geometry, seed)
    layout = w2_slot_layout(geometry.hidden, geometry.expert_inter)
    h, i = geometry.hidden, geometry.expert_inter
    with PackWriter(pack_dir, spec) as writer:
        done = writer.written_layers()
        for layer in range(geometry.num_moe_layers):
            if layer in done:
                continue
            gen = torch.Generator().manual_seed(seed * 100_003 + layer)
            pending = writer.begin_layer(layer)
            for expert in range(geometry.num_experts):
                parts = []
                for n, k in ((2 * i, h), (h, i)):
                    parts.append(torch.randint(0, 4, (n, k), generator=gen, dtype=torch.uint8))
                    parts.append(torch.randint(119, 123, (n, k // 32), generator=gen, dtype=torch.uint8))
                pending.write_row(expert, pack_slot(layout, *parts)[:spec.row_bytes].numpy())
            pending.commit()
    return spec


def open_synthetic_rows(spec: PackSpec, pack_dir: Path | str) -> PackRows:
    pack = Pack(pack_dir, spec)
    return PackRows(pack, make_reader(pack.path, direct=direct_io_supported(pack.path)))


def trace_steps(experts: np.ndarray, steps: np.ndarray | None, layers: int, limit: int | None) -> list[np.ndarray]:
    """Routing per step, int64 [T, layers, k], from a trace's [tokens, L, k] experts and step ids."""
    if experts.shape[1] < layers:
        raise TraceFormatError(f"the trace has {experts.shape[1]} layers, the replay needs {layers}")
    ids = experts[:, :layers].astype(np.int64)
    bounds = np.arange(len(ids) + 1) if steps is None else np.flatnonzero(np.r_[True, np.diff(steps) != 0, True])
    out = [ids[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    return out[:limit] if limit else out


@dataclass(frozen=True)
class ReplayRun:
    label: str
    steps: int
    seconds: float
    replay_rate: float
    missing_pairs_per_step: float
    fetched_bytes: int
    fetch_gbps: float

    @property
    def steps_per_s(self) -> float:
        return self.steps / self.seconds if self.seconds else 0.0


def _forward(runtime: TieredRuntime, x: torch.Tensor, routing: torch.Tensor, weights: torch.Tensor, naive: bool):
    for layer in range(routing.shape[1]):
        ids = routing[:, layer]  # [T, k]
        if naive:  # eager, one synchronous fetch per missing expert
            for expert in ids.unique().tolist():
                runtime.fetch([(layer, expert)], [(layer, int(e)) for e in ids.unique().tolist()])
        x = x + runtime.moe(layer, x, ids, weights)
    return x


def replay(runtime: TieredRuntime, steps: list[np.ndarray], label: str, naive: bool = False, dtype=torch.float32) -> ReplayRun:
    """Drive `runtime` through `steps`; hidden states are fixed random vectors (routing is forced)."""
    device, g = runtime.device, runtime.geometry
    x = torch.randn(1, g.hidden, generator=torch.Generator().manual_seed(0)).to(device, dtype) * 0.01
    weights = torch.full((1, g.top_k), 1.0 / g.top_k, device=device)
    started = time.perf_counter()
    for routing in steps:
        ids = torch.as_tensor(routing, device=device)  # [T, L, k]
        tokens = ids.shape[0]
        runtime.step(lambda: _forward(runtime, x.expand(tokens, -1).contiguous(), ids, weights.expand(tokens, -1),
                                      naive), lambda: None)
    seconds = time.perf_counter() - started
    stats = runtime.stats()
    return ReplayRun(label, len(steps), seconds, stats.replay_rate, stats.missing_pairs_per_step,
                     stats.fetched_bytes, stats.fetch_gbps)


def host_to_device_gbps(device: torch.device, nbytes: int = 256 << 20) -> float:
    """Measured copy bandwidth from pinned host memory to `device` (plain memcpy on CPU)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst.copy_(src, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return 3 * nbytes / (time.perf_counter() - started) / 1e9


def run_replay(geometry: MoEGeometry, source_factory, steps: list[np.ndarray], *, pool_slots: int, arena_slots: int,
               device: torch.device | str, config: RuntimeConfig | None = None) -> dict:
    """Tiered, all-resident and naive runs of the same steps plus the floor, as one JSON-able dict.
    `source_factory()` returns a fresh row source per run (e.g. PackRows over the pack)."""
    device = torch.device(device)
    config = config or RuntimeConfig(kpi_every=0, force_pool=True)
    runs = {}
    with TieredRuntime(geometry, source_factory(), pool_slots=geometry.total_routed_experts, device=device,
                       config=config) as resident:
        resident.preload()
        runs["resident"] = replay(resident, steps, "all-resident")
    for label, naive in (("tiered", False), ("naive", True)):
        with TieredRuntime(geometry, source_factory(), pool_slots=pool_slots, arena_slots=arena_slots, device=device,
                           config=config) as runtime:
            runs[label] = replay(runtime, steps, label, naive=naive)
    bandwidth = host_to_device_gbps(device)
    tiered = runs["tiered"]
    floor_s = runs["resident"].seconds + tiered.fetched_bytes / (bandwidth * 1e9)
    return {
        "geometry": geometry.name, "layers": geometry.num_moe_layers, "steps": len(steps), "device": str(device),
        "pool_slots": pool_slots, "coverage": pool_slots / geometry.total_routed_experts, "arena_slots": arena_slots,
        "h2d_gbps": bandwidth, "floor_step_ms": 1e3 * floor_s / len(steps),
        "runs": {k: {**v.__dict__, "steps_per_s": v.steps_per_s, "step_ms": 1e3 * v.seconds / v.steps}
                 for k, v in runs.items()},
    }
