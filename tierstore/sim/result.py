"""`SimResult`: per-step counters of one simulation run and the KPIs derived from them."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tierstore.geometry import MoEGeometry
from tierstore.sim.cost import CostModel

COUNTERS = (
    "pairs",  # routed pairs of the step
    "hit_pairs",  # pairs served from the GPU (base pool or FP4 pool) at step start
    "fp4_pairs",  # pairs served from the FP4 pool
    "miss_keys",  # unique keys fetched by the step's batch
    "arena_rows",  # of those, rows found in the host arena
    "base_keys",  # unique keys computed at 2 bits
    "fp4_keys",  # unique keys computed at FP4
    "fired",  # 1 if the confidence gate fired
    "forced_rows",  # FP4 rows force-promoted by the gate (on the critical path)
    "promoted_rows",  # FP4 rows promoted lazily in the background
    "tokens",  # tokens of the step
)


@dataclass
class SimResult:
    counters: dict[str, np.ndarray]
    params: dict
    geometry: MoEGeometry | None = None
    cost: CostModel = field(default_factory=CostModel)

    def _sum(self, name: str) -> int:
        return int(self.counters[name].sum())

    @property
    def num_steps(self) -> int:
        return len(self.counters["pairs"])

    @property
    def token_hit_rate(self) -> float:
        """Routed (token, layer, expert) pairs served from the GPU / all routed pairs."""
        return self._sum("hit_pairs") / max(1, self._sum("pairs"))

    @property
    def zero_miss_step_fraction(self) -> float:
        """Fraction of steps that fetched nothing (no replay): decode speed tracks this."""
        return float(np.mean(self.counters["miss_keys"] == 0)) if self.num_steps else 0.0

    @property
    def fp4_share(self) -> float:
        return self._sum("fp4_pairs") / max(1, self._sum("pairs"))

    @property
    def arena_hit_rate(self) -> float:
        """Fetched rows served from the host arena / all fetched rows (1.0 without an arena)."""
        return self._sum("arena_rows") / max(1, self._sum("miss_keys"))

    def misses_per_step(self) -> dict[str, float]:
        m = self.counters["miss_keys"]
        if not len(m):
            return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
        return {"mean": float(m.mean()), "p50": float(np.percentile(m, 50)), "p99": float(np.percentile(m, 99))}

    # --- bytes and time (need a geometry) ------------------------------------------------
    def _bytes(self):
        g = self.geometry
        if g is None:
            return None
        c = self.counters
        h2d = c["miss_keys"] * g.w2_expert_bytes
        disk = (c["miss_keys"] - c["arena_rows"]) * g.w2_expert_bytes
        forced = c["forced_rows"] * g.fp4_expert_bytes
        return h2d, disk, forced

    def bytes_moved(self) -> dict[str, int] | None:
        b = self._bytes()
        if b is None:
            return None
        h2d, disk, forced = b
        background = self._sum("promoted_rows") * self.geometry.fp4_expert_bytes
        return {"h2d_w2": int(h2d.sum()), "disk_w2": int(disk.sum()), "h2d_fp4_forced": int(forced.sum()),
                "h2d_fp4_background": int(background)}

    def step_seconds(self) -> np.ndarray | None:
        b = self._bytes()
        if b is None:
            return None
        h2d, disk, forced = b
        g, c, m = self.geometry, self.counters, self.cost
        compute = m.dense_step_s + (c["base_keys"] * g.w2_expert_bytes + c["fp4_keys"] * g.fp4_expert_bytes) / m.hbm_bytes_per_s
        fetch = np.where(disk > 0, m.disk_latency_s + disk / m.disk_bytes_per_s, 0.0)
        fetch = fetch + np.where(h2d > 0, m.h2d_latency_s + h2d / m.h2d_bytes_per_s, 0.0)
        force = np.where(forced > 0, m.h2d_latency_s + forced / m.h2d_bytes_per_s, 0.0)
        missed = c["miss_keys"] > 0
        return compute + missed * (fetch + compute) + (c["fired"] > 0) * (force + compute)

    @property
    def tokens_per_s(self) -> float:
        t = self.step_seconds()
        return float("nan") if t is None or t.sum() == 0 else self._sum("tokens") / float(t.sum())

    def summary(self) -> dict:
        out = {**self.params, "steps": self.num_steps, "routed_pairs": self._sum("pairs"),
               "token_hit_rate": self.token_hit_rate, "zero_miss_step_fraction": self.zero_miss_step_fraction,
               "misses_per_step": self.misses_per_step()}
        if self.counters["fp4_pairs"].any() or self.params.get("fp4_slots"):
            out["fp4_share"] = self.fp4_share
            out["gate_fire_rate"] = float(np.mean(self.counters["fired"] > 0)) if self.num_steps else 0.0
        if self.params.get("arena_slots") is not None:
            out["arena_hit_rate"] = self.arena_hit_rate
        steps = self.step_seconds()
        if steps is not None:
            out["bytes_moved"] = self.bytes_moved()
            out["mean_step_ms"] = float(steps.mean() * 1e3) if len(steps) else 0.0
            out["tokens_per_s"] = self.tokens_per_s
        return out

    def __repr__(self) -> str:
        return (f"SimResult(policy={self.params.get('policy')!r}, gpu_slots={self.params.get('gpu_slots')}, "
                f"token_hit_rate={self.token_hit_rate:.4f}, zero_miss_step_fraction={self.zero_miss_step_fraction:.4f})")


def empty_counters(num_steps: int) -> dict[str, np.ndarray]:
    return {name: np.zeros(num_steps, np.int64) for name in COUNTERS}
