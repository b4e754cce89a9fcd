"""The step protocol: forward, read the pass log (the one sync), fetch what missed, replay, to a
fixed point.

    forward -> misses? --no--> done
                 | yes
    <= tolerance: keep the logits (degraded, counted), fetch for later steps
    replays == fp_max: strict -> raise ReplayLimitError; approximate -> keep residue (counted)
    approximate after its mandatory replay: keep residue unless it is <= fp_thresh
    otherwise: fetch every missing expert in one batch, rewind the KV cache, replay

A replay of a step whose routed experts are all resident is bit-identical to a run where nothing
ever missed: same slot bytes, deterministic kernels, fixed-order combine, identical inputs.
Second-order misses (a corrected early layer re-routes a later one) are what the loop is for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from tierstore.errors import CapacityError
from tierstore.runtime.config import RuntimeConfig
from tierstore.runtime.passlog import PassReport

if TYPE_CHECKING:
    from tierstore.runtime.gated_step import FireRecord

T = TypeVar("T")


class ReplayLimitError(CapacityError):
    """Strict mode: misses remained after `fp_max` replays; no degraded logits were returned."""


@dataclass(frozen=True)
class StepOutcome:
    replays: int
    first_pass_missing_pairs: int
    residue_pairs: int  # > 0 only in degraded modes
    tolerated: bool
    last_pass: PassReport
    gate: FireRecord | None = None  # set when the confidence gate fired on this step
    all_fp4: bool | None = None  # with an FP4 tier: the last pass routed only FP4-resident experts

    def with_all_fp4(self, all_fp4: bool) -> StepOutcome:
        """This outcome with `all_fp4` set: `dataclasses.replace` without its walk over the fields."""
        return StepOutcome(self.replays, self.first_pass_missing_pairs, self.residue_pairs, self.tolerated,
                           self.last_pass, self.gate, all_fp4)


def run_step(forward: Callable[[], T], rewind: Callable[[], None], read_pass: Callable[[], PassReport],
             fetch: Callable[[PassReport, bool], int], config: RuntimeConfig,
             during_pass: Callable[[], None] | None = None,
             first_forward: Callable[[], T] | None = None, first_replays: int = 0) -> tuple[T, StepOutcome]:
    """Run one step to its fixed point. `fetch(report, partial)` makes the pass's missing experts
    (`report.missing_keys`) resident without evicting any it routed (`report.routed_ids`; partial: as many as
    fit) and returns how many it installed. `during_pass`,
    when given, runs after each `forward()` returns and before its pass is read (on CUDA the pass
    is then still running on the device).

    Fetches protect the routed set of the pass just read: after its sync nothing reads the pool,
    and experts routed only by an earlier, degraded pass are not needed by the replay (protecting
    them too would make a pool that holds one step's working set fail on stale routes).

    `first_forward`, when given, is launched instead of the first `forward()`, counted as `first_replays`
    replays: a pass pair (a pass and its replay in one launch, `TieredRuntime.pass_pair`) counts one, a first
    pass without the pool's per-layer waits (`TieredRuntime.first_pass`) none.

    Returns (result of the last forward, outcome); `outcome.last_pass.routed_keys` are the keys the
    last pass routed. A pass without misses builds no key objects.
    """
    replays, first, residue, tolerated = first_replays, None, 0, False
    approximate = config.replay_mode == "approximate"
    launch = first_forward or forward
    while True:
        result = launch()
        launch = forward
        if during_pass is not None:
            during_pass()
        report = read_pass()
        first = report.missing_pairs if first is None else first
        misses = report.missing_pairs
        if misses == 0:
            break
        if misses <= config.miss_tolerance:
            fetch(report, True)
            tolerated = True
            break
        if replays >= config.fp_max:
            if not approximate:
                raise ReplayLimitError(
                    f"strict replay: {misses} routed pairs still missed after {replays} replays (fp_max "
                    f"{config.fp_max}); no degraded logits are returned. Use a larger pool or raise fp_max; "
                    "approximate mode and a miss tolerance are the explicit degraded alternatives")
            residue = misses
            break
        if approximate and replays >= 1 and misses > config.fp_thresh:
            residue = misses
            break
        installed = fetch(report, approximate)
        if approximate and installed == 0 and report.unlogged_experts == 0:
            residue = misses  # nothing more fits: another replay would change nothing
            break
        rewind()
        replays += 1
    return result, StepOutcome(replays, first, residue, tolerated, report)
