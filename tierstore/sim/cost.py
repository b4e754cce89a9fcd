"""Step-time cost model. Defaults are the H200 figures in DESIGN.md; every field can be overridden."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class CostModel:
    hbm_bytes_per_s: float = 4.23e12  # device copy, DESIGN.md (read+write; an upper bound for reads)
    h2d_bytes_per_s: float = 55e9  # pinned host -> GPU
    disk_bytes_per_s: float = 1.1e9  # O_DIRECT reads at queue depth 8-32
    h2d_latency_s: float = 20e-6  # per batched fetch
    disk_latency_s: float = 200e-6  # per batched pack read
    dense_step_s: float = 0.0  # non-expert part of a decode step (attention, shared experts, launch)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value < 0 or (f.name.endswith("per_s") and value == 0):
                raise ValueError(f"cost model: {f.name} must be positive, got {value}")

    def compute_s(self, expert_bytes: float) -> float:
        return self.dense_step_s + expert_bytes / self.hbm_bytes_per_s

    def fetch_s(self, h2d_bytes: float, disk_bytes: float) -> float:
        """One batched fetch: disk rows are read into the arena, then everything goes over H2D."""
        t = 0.0
        if disk_bytes:
            t += self.disk_latency_s + disk_bytes / self.disk_bytes_per_s
        if h2d_bytes:
            t += self.h2d_latency_s + h2d_bytes / self.h2d_bytes_per_s
        return t

    @classmethod
    def from_overrides(cls, **overrides) -> CostModel:
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"cost model: unknown fields {sorted(unknown)}; known: {sorted(known)}")
        return cls(**overrides)
