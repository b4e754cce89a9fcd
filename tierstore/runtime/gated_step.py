"""A decode step under the confidence gate, on top of the base fixed point (`run_step`).

    run_step (base misses to their fixed point) -> gate decides on the final logits
    fires: need += 1 for the routed set; then up to gate_fp_max times:
        force-promote the last pass's routed experts that are not FP4 (per-step budget, shared)
        nothing promoted -> stop (a replay could not change the result)
        rewind, run_step again (repairs the base misses the FP4 replay re-routed onto), re-decide
        no longer fires -> stop

A fired step whose final pass routed only FP4 experts computes exactly what an all-FP4 run
computes (`FireRecord.converged`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from tierstore.runtime.gate import ConfidenceGate, GateDecision

if TYPE_CHECKING:
    from tierstore.runtime.step import StepOutcome

T = TypeVar("T")
Key = tuple[int, int]


@dataclass(frozen=True)
class FireRecord:
    signal: float  # before the first FP4 replay
    tau: float
    final_signal: float
    promoted: int
    replays: int
    argmax_before: int
    argmax_after: int
    converged: bool  # the final pass routed only FP4-resident experts

    def as_dict(self) -> dict:
        return asdict(self)


def _argmax(logits: torch.Tensor) -> int:
    return int(logits.reshape(-1, logits.shape[-1])[0].argmax())


def run_gated(first: tuple[T, StepOutcome], *, gate: ConfidenceGate, logits_of: Callable[[T], torch.Tensor],
              rerun: Callable[[], tuple[T, StepOutcome]], force_promote: Callable[[set, set, int | None], int],
              record_need: Callable[[set], None], is_fp4: Callable[[Key], bool], budget: int | None,
              fp_max: int, signal_of: Callable[[], float | None] = lambda: None,
              ) -> tuple[tuple[T, StepOutcome], list, GateDecision, FireRecord | None]:
    """`first` = (result, outcome) of the step's base fixed point. `rerun()` rewinds and runs the
    base fixed point again; `force_promote(routed, protect, budget)` returns how many it promoted.
    `signal_of()`: the aggregated signal of the last forward's logits, already on the host (None:
    compute it from `logits_of(result)`, a host sync).
    Returns (final (result, outcome), the reruns' outcomes, the first decision, the fire record or
    None)."""
    def decide(result: T) -> GateDecision:
        value = signal_of()
        return gate.decide(logits_of(result)) if value is None else gate.decide_value(value)

    result, outcome = first
    decision = decide(result)
    if not decision.fires:
        return first, [], decision, None
    routed = outcome.last_pass.routed_keys
    record_need(routed)
    before = _argmax(logits_of(result))
    step_routed = set(routed)
    current, reruns = first, []
    promoted_total, final = 0, decision
    for _ in range(fp_max):
        left = None if budget is None else budget - promoted_total
        promoted = force_promote(current[1].last_pass.routed_keys, step_routed, left)
        if promoted == 0:
            break
        promoted_total += promoted
        current = rerun()
        reruns.append(current[1])
        step_routed.update(current[1].last_pass.routed_keys)
        final = decide(current[0])
        if not final.fires:
            break
    converged = all(is_fp4(k) for k in current[1].last_pass.routed_keys)
    record = FireRecord(decision.signal, decision.tau, final.signal, promoted_total, len(reruns), before,
                        _argmax(logits_of(current[0])), converged)
    return current, reruns, decision, record
