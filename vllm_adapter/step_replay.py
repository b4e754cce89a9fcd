"""The runner side of graph execution: after a step's forward, fetch its misses and replay it until
no routed pair was served as zero (a fixed point: a replay can re-route later layers onto experts
that are not resident yet).

vLLM's model runner owns the forward, so this loop is what a runner integration calls with the
step's forward (graph replay + logits) as `forward`; see docs/vllm.md for where it belongs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from tierstore.errors import CapacityError
from tierstore.vllm_adapter.residency import ExpertCache
from tierstore.vllm_adapter.settings import AdapterSettings

Result = TypeVar("Result")


@dataclass(frozen=True)
class StepReport:
    replays: int  # forwards after the first
    fetched: int  # experts fetched by this step
    residual_pairs: int  # pairs still served as zero in the returned result (approximate mode only)


def run_step(forward: Callable[[], Result], cache: ExpertCache, settings: AdapterSettings) -> tuple[Result, StepReport]:
    """Run `forward` and replay it after each batched fetch until the missing pairs are within
    BASE_MISS_TOL. `strict` raises after FP_MAX replays with pairs still missing; `approximate`
    returns that result and reports the residue."""
    cache.pending.clear()
    cache.pending_pairs = 0
    result = forward()
    replays = fetched = 0
    while cache.pending_pairs > settings.miss_tolerance:
        if replays >= settings.fp_max:
            if settings.replay_mode == "strict":
                raise CapacityError(f"{cache.pending_pairs} routed pairs still missing after {replays} replays "
                                    f"(FP_MAX={settings.fp_max}); the expert cache is too small for this step")
            residual = cache.pending_pairs
            fetched += cache.resolve_misses()  # later steps still get the experts
            return result, StepReport(replays, fetched, residual)
        fetched += cache.resolve_misses()
        result = forward()
        replays += 1
    if cache.pending:  # within tolerance: keep the result, fetch for later steps
        fetched += cache.resolve_misses()
    return result, StepReport(replays, fetched, 0)
