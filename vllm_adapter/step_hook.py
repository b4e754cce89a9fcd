"""The step hook around vLLM's model forward (plain Python; `tierstore.vllm_adapter.worker` binds
it to vLLM's runner).

For each scheduled batch the runner calls `hooked_forward(runtime, forward, batch, compute_logits)`
with `forward` = vLLM's own model forward (the CUDA-graph replay when one is captured: same
persistent input buffers, so calling it again launches the same graph). The runtime's `step`
then runs it to its fixed point: read the pass log (one sync), fetch every missing expert in one
batch, replay until no pair misses; on decode batches with the gate armed it computes the logits
of the sampled rows, and on a fire force-promotes the routed experts to FP4 and replays again.
After the step the FP4 manager is woken with the step's routing counts.

The rewind is a no-op: a replay writes the step's K/V to the same paged-cache slots, so the
replay's values simply replace the first pass's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepBatch:
    """What the hook needs of a scheduled batch: `decode` = every request runs exactly one token
    and none is new (the gate's condition; the sampled rows are then the first `rows` hidden
    states, one per request, in batch order)."""

    decode: bool
    rows: int


def step_batch(scheduler_output) -> StepBatch | None:
    """The batch of a vLLM `SchedulerOutput`; None when it schedules no token (nothing to run)."""
    counts = scheduler_output.num_scheduled_tokens  # request id -> tokens this step
    if scheduler_output.total_num_scheduled_tokens == 0:
        return None
    decode = (not scheduler_output.scheduled_new_reqs and not scheduler_output.scheduled_spec_decode_tokens
              and all(n == 1 for n in counts.values()))
    return StepBatch(decode, len(counts))


def _no_rewind() -> None:
    """The replay overwrites the step's paged K/V slots; nothing to undo."""


def hooked_forward(runtime, forward: Callable[[], torch.Tensor], batch: StepBatch | None,
                   compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`forward()`'s hidden states [T_padded, H] after the step protocol (plain `forward()` without
    a runtime or a batch). `compute_logits` maps the sampled rows' hidden states to logits."""
    if runtime is None or batch is None:
        return forward()
    logits_of = None
    if batch.decode and runtime.gate is not None:
        def logits_of(hidden: torch.Tensor) -> torch.Tensor:
            return compute_logits(hidden[:batch.rows])
    hidden, _ = runtime.step(forward, _no_rewind, prefill=not batch.decode, logits_of=logits_of)
    return hidden
