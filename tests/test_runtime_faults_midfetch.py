"""Issue 5 §5: a read fault in the middle or at the end of a step's fetch batch (rows before it read
fine) fails the step closed: a clear error naming the row, no pool mapping changed, no arena key
published from the failed batch (arena.py: "keys are published only after all reads of the batch
succeeded"), a coherent pool; the next step and a retry of the failed one equal the all-resident run."""

import re

import numpy as np
import pytest
import torch
from test_runtime_fixtures import ToyMoE
from test_runtime_reliability import faulty_runtime, hostile_tokens, packed  # noqa: F401 (module fixture)

from tierstore.errors import PackFormatError, ReadError
from tierstore.io.readers import FaultPlan
from tierstore.runtime import RuntimeConfig, TieredRuntime
from tierstore.runtime.packs import open_base_rows

WARM, FAULTED, NEXT = 0, 1, 2  # hostile_tokens steps: fills the pool, faults, a different routing


def run(runtime, model, step):
    """The logits [1, H] of one step of `runtime` on hostile_tokens(step)."""
    x = hostile_tokens(model.geometry, step, 1)  # [1, H]
    return runtime.step(lambda: model.forward(runtime, x), lambda: None)[0]


def resident_logits(packed, model):  # noqa: F811
    """step -> logits [1, H] of the all-resident run."""
    ckpt, packs, g = packed
    resident = TieredRuntime(g, open_base_rows(ckpt, packs, direct=False), pool_slots=g.total_routed_experts,
                             config=RuntimeConfig(kpi_every=0))
    with resident:
        resident.preload()
        return {step: run(resident, model, step) for step in (WARM, FAULTED, NEXT)}


def faulted_step_batch(packed, model):  # noqa: F811
    """The keys of the first pack read of step FAULTED (after step WARM), in read order, from a
    fault-free run of the same runtime."""
    runtime, rows = faulty_runtime(packed, FaultPlan())
    batches = []
    read_rows = rows.read_rows

    def recording(keys, dests):
        batches.append(list(keys))
        read_rows(keys, dests)

    with runtime:
        run(runtime, model, WARM)
        rows.read_rows = recording
        run(runtime, model, FAULTED)
    return batches[0]


def row_offset(ckpt, packs, key) -> int:
    """The pack file offset of row `key`: what FaultPlan matches."""
    probe = open_base_rows(ckpt, packs, direct=False)
    offset = probe.pack.spec.row_offset(*key)
    probe.close()
    return offset


def pool_state(pool) -> list[np.ndarray]:
    """Table, mirror [L, E], owners [S, 2] and slot generations [S], copied."""
    return [pool.table.cpu().numpy().copy(), pool.mirror.copy(), pool.owner.copy(), pool.generation.copy()]


@pytest.mark.parametrize("position", ["middle", "last"])
@pytest.mark.parametrize("fault", ["eio", "flip"])
def test_one_row_faulting_mid_batch_fails_closed_and_next_and_retry_are_exact(packed, fault, position):  # noqa: F811
    """Only one row of the step's batch faults (rows before it read fine): the step raises naming that
    row, the pool's table, mirror, owners and generations are those from before the step, no key of
    the batch is in the arena, and the next step and the retry equal the all-resident logits."""
    ckpt, packs, g = packed
    model = ToyMoE(g, seed=2)
    want = resident_logits(packed, model)
    batch = faulted_step_batch(packed, model)
    assert len(batch) >= 3  # a middle row has rows read before and after it
    bad = batch[len(batch) // 2] if position == "middle" else batch[-1]
    offset = row_offset(ckpt, packs, bad)
    plan = FaultPlan(eio_offsets={offset}) if fault == "eio" else FaultPlan(flip_offsets={offset})
    runtime, rows = faulty_runtime(packed, plan)
    if fault == "eio":
        error, message = ReadError, f"1 of {len(batch)} reads of .* offset {offset}: Input/output error"
    else:
        error, message = PackFormatError, re.escape(f"1 row(s) of {rows.pack.path} fail their checksum: {bad};")
    with runtime:
        assert torch.equal(run(runtime, model, WARM), want[WARM])
        before = pool_state(runtime.pool)
        arena_before = set(runtime.arena._table.hottest_first())
        with pytest.raises(error, match=message):
            run(runtime, model, FAULTED)
        assert rows.reader.fired == [(fault, offset)]
        assert all(np.array_equal(a, b) for a, b in zip(before, pool_state(runtime.pool)))
        runtime.pool.check_coherent()
        arena_after = set(runtime.arena._table.hottest_first())
        assert arena_after <= arena_before and not arena_after & set(batch)  # rows read fine are not published either
        assert torch.equal(run(runtime, model, NEXT), want[NEXT])
        assert torch.equal(run(runtime, model, FAULTED), want[FAULTED])
        runtime.pool.check_coherent()
        stats = runtime.stats()
        assert (stats.steps, stats.failed_steps) == (3, 1)
