"""Group a trace's routed keys into simulation steps (vectorised)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tierstore.sim.trace import Trace


@dataclass(frozen=True)
class StepKeys:
    """Unique keys of each step in first-routed order (layer-major within a token).

    Step s covers ``keys[offsets[s]:offsets[s+1]]``; ``counts`` holds how many routed pairs of
    the step hit that key (1 per token routing it).
    """

    keys: np.ndarray  # int64
    counts: np.ndarray  # int32
    offsets: np.ndarray  # int64 [steps + 1]
    tokens_per_step: np.ndarray  # int64 [steps]

    @property
    def num_steps(self) -> int:
        return len(self.offsets) - 1

    def step(self, s: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.offsets[s], self.offsets[s + 1]
        return self.keys[lo:hi], self.counts[lo:hi]


def step_ids(trace: Trace, tokens_per_step: int | str = 1) -> np.ndarray:
    """Step index of each token: 1 token per step, n tokens per step, or the trace's recorded steps."""
    if tokens_per_step == "recorded":
        if trace.step is None:
            raise ValueError("tokens_per_step='recorded' needs a trace with recorded steps")
        _, ids = np.unique(trace.step, return_inverse=True)
        return ids.astype(np.int64)
    if not isinstance(tokens_per_step, int) or tokens_per_step < 1:
        raise ValueError(f"tokens_per_step must be a positive int or 'recorded', got {tokens_per_step!r}")
    return np.arange(trace.num_tokens, dtype=np.int64) // tokens_per_step


def group_steps(trace: Trace, tokens_per_step: int | str = 1) -> StepKeys:
    steps = step_ids(trace, tokens_per_step)
    keys = trace.keys()
    width = keys.shape[1]
    flat_keys = keys.ravel()
    flat_steps = np.repeat(steps, width)
    valid = flat_keys >= 0
    flat_keys, flat_steps = flat_keys[valid], flat_steps[valid]
    num_steps = int(steps[-1]) + 1 if len(steps) else 0
    if tokens_per_step == 1 and _distinct_within_rows(keys):
        counts = np.ones(len(flat_keys), np.int32)
        per_step = np.bincount(flat_steps, minlength=num_steps)
    else:
        composite = flat_steps * trace.num_keys + flat_keys
        _, first, counts = np.unique(composite, return_index=True, return_counts=True)
        order = np.argsort(first, kind="stable")
        first, counts = first[order], counts[order].astype(np.int32)
        flat_keys, flat_steps = flat_keys[first], flat_steps[first]
        per_step = np.bincount(flat_steps, minlength=num_steps)
    offsets = np.zeros(num_steps + 1, np.int64)
    np.cumsum(per_step, out=offsets[1:])
    return StepKeys(flat_keys.astype(np.int64), counts, offsets, np.bincount(steps, minlength=num_steps))


def _distinct_within_rows(keys: np.ndarray) -> bool:
    s = np.sort(keys, axis=1)
    return not np.any((s[:, 1:] == s[:, :-1]) & (s[:, 1:] >= 0))
