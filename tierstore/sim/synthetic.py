"""Seeded synthetic routing traces for tests and benchmarks (vectorised numpy).

Each layer ranks its experts by a Zipf law (``skew``; layer l uses ``skew * (1 + layer_skew *
(l / (L - 1) - 0.5))``) over its own random permutation. A token draws top-k distinct experts
by Gumbel-top-k over the log popularities; with probability ``locality`` a layer instead repeats
the previous token's experts (temporal locality). Every ``burst_len`` tokens (if set) each
layer's permutation is redrawn: a burst of new hot experts.
"""

from __future__ import annotations

import numpy as np

from tierstore.geometry import MoEGeometry
from tierstore.sim.trace import Trace


def synthetic_trace(
    num_tokens: int,
    num_layers: int,
    num_experts: int,
    top_k: int,
    *,
    skew: float = 1.1,
    layer_skew: float = 0.0,
    locality: float = 0.0,
    burst_len: int | None = None,
    tokens_per_request: int | None = None,
    seed: int = 0,
    geometry: str | None = None,
) -> Trace:
    if not (num_tokens > 0 and num_layers > 0 and 0 < top_k <= num_experts):
        raise ValueError(f"bad synthetic trace shape: tokens {num_tokens}, layers {num_layers}, "
                         f"experts {num_experts}, top_k {top_k}")
    if not 0.0 <= locality < 1.0:
        raise ValueError(f"locality must be in [0, 1), got {locality}")
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, num_experts + 1, dtype=np.float64)
    spread = np.linspace(-0.5, 0.5, num_layers) if num_layers > 1 else np.zeros(1)
    layer_skews = skew * (1.0 + layer_skew * spread)
    log_pop = -layer_skews[:, None] * np.log(ranks)[None, :]  # [L, E] by rank
    period = burst_len or num_tokens
    experts = np.empty((num_tokens, num_layers, top_k), np.int32)
    for start in range(0, num_tokens, period):
        n = min(period, num_tokens - start)
        perm = np.argsort(rng.random((num_layers, num_experts)), axis=1)  # rank -> expert id
        logits = np.empty((num_layers, num_experts))
        np.put_along_axis(logits, perm, log_pop, axis=1)  # expert id -> log popularity
        noisy = logits[None] + rng.gumbel(size=(n, num_layers, num_experts))
        top = np.argpartition(-noisy, top_k - 1, axis=2)[:, :, :top_k]
        order = np.argsort(-np.take_along_axis(noisy, top, axis=2), axis=2)
        experts[start:start + n] = np.take_along_axis(top, order, axis=2)
    if locality > 0:
        repeat = rng.random((num_tokens, num_layers)) < locality
        repeat[0] = False
        source = np.where(repeat, 0, np.arange(num_tokens)[:, None])
        source = np.maximum.accumulate(source, axis=0)  # last fresh token at or before t
        experts = np.take_along_axis(experts, source[:, :, None].repeat(top_k, axis=2), axis=0)
    request = None
    if tokens_per_request:
        request = (np.arange(num_tokens) // tokens_per_request).astype(np.int32)
    meta = {"source": f"synthetic(seed={seed}, skew={skew}, layer_skew={layer_skew}, "
                      f"locality={locality}, burst_len={burst_len})"}
    if geometry:
        meta["geometry"] = geometry
    return Trace(experts=experts, num_experts=num_experts, request=request, meta=meta)


def synthetic_for(geometry: MoEGeometry, num_tokens: int, **options) -> Trace:
    """A synthetic trace shaped like `geometry` (its layers, experts and top-k)."""
    return synthetic_trace(num_tokens, geometry.num_moe_layers, geometry.num_experts, geometry.top_k,
                           geometry=geometry.name, **options)
