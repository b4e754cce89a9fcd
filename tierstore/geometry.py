"""MoE model geometry: what the tiers, the planner and the simulator need to know of a model."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tierstore.errors import CheckpointError

W2_BITS_PER_WEIGHT = 2.25  # 2-bit code + one UE8M0 byte per 32 weights
FP4_BITS_PER_WEIGHT = 4.25  # e2m1 nibble + the same UE8M0 byte per 32 weights
BF16_BITS_PER_WEIGHT = 16.0


@dataclass(frozen=True)
class MoEGeometry:
    """Shape of a model's routed experts.

    `moe_layers` are the decoder-layer indices that hold routed experts; tiers index them
    densely as 0..len(moe_layers)-1. Each routed expert is a SwiGLU MLP: w13 [2*I, H]
    (gate rows first, then up) and w2 [H, I].
    """

    name: str
    moe_layers: tuple[int, ...]
    num_experts: int
    top_k: int
    hidden: int
    expert_inter: int
    num_shared_experts: int = 0
    shared_inter: int = 0
    activation: str = "silu"
    swiglu_limit: float | None = None
    scoring: str = "softmax"
    norm_topk_prob: bool = True

    def __post_init__(self) -> None:
        for field in ("num_experts", "top_k", "hidden", "expert_inter"):
            if getattr(self, field) <= 0:
                raise ValueError(f"geometry {self.name!r}: {field} must be positive, got {getattr(self, field)}")
        if not self.moe_layers:
            raise ValueError(f"geometry {self.name!r}: no MoE layers")
        if self.top_k > self.num_experts:
            raise ValueError(f"geometry {self.name!r}: top_k {self.top_k} > num_experts {self.num_experts}")

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    @property
    def weights_per_expert(self) -> int:
        return 3 * self.hidden * self.expert_inter

    def expert_bytes(self, bits_per_weight: float) -> int:
        return int(self.weights_per_expert * bits_per_weight / 8)

    @property
    def w2_expert_bytes(self) -> int:
        return self.expert_bytes(W2_BITS_PER_WEIGHT)

    @property
    def fp4_expert_bytes(self) -> int:
        return self.expert_bytes(FP4_BITS_PER_WEIGHT)

    @property
    def bf16_expert_bytes(self) -> int:
        return self.expert_bytes(BF16_BITS_PER_WEIGHT)

    @property
    def total_routed_experts(self) -> int:
        return self.num_moe_layers * self.num_experts

    def with_layers(self, num_moe_layers: int) -> MoEGeometry:
        """The same geometry with fewer (or more) MoE layers, for reduced benchmarks and tests."""
        return dataclasses.replace(self, moe_layers=tuple(range(num_moe_layers)))


def _preset(name, layers, experts, top_k, hidden, inter, shared=0) -> MoEGeometry:
    return MoEGeometry(name=name, moe_layers=tuple(range(layers)), num_experts=experts, top_k=top_k,
                       hidden=hidden, expert_inter=inter, num_shared_experts=shared,
                       shared_inter=inter if shared else 0)


PRESETS: dict[str, MoEGeometry] = {
    g.name: g
    for g in (
        _preset("olmoe-1b-7b", 16, 64, 8, 2048, 1024),
        _preset("ds-v2-lite", 26, 64, 6, 2048, 1408, shared=2),
        _preset("qwen3-30b-a3b", 48, 128, 8, 2048, 768),
        _preset("mixtral-8x7b", 32, 8, 2, 4096, 14336),
        _preset("ds4-flash", 43, 256, 6, 4096, 2048),
        _preset("deepseek-v3", 58, 256, 8, 7168, 2048, shared=1),
        _preset("kimi-k2", 60, 384, 8, 7168, 2048, shared=1),
    )
}


def get_preset(name: str) -> MoEGeometry:
    try:
        return PRESETS[name]
    except KeyError:
        raise CheckpointError(f"unknown geometry preset {name!r}; known presets: {', '.join(PRESETS)}") from None
