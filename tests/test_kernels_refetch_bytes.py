"""Issue 9 §2: refetch with slot bytes. Two routed experts lose their slots (bytes overwritten with
garbage, tables unmapped): moe_mm counts and lists exactly those misses and never reads the garbage;
a "fetch" then writes the real bytes into the two slots (swapped, so the table decides which slot
serves which expert) and maps them, and the rerun equals the all-resident output exactly. Runs in
Triton's interpreter on the CPU (fp32/fp16), compiled on a GPU."""

import pytest
import torch
from test_kernels_moe import DEVICE, DTYPES, TOLERANCE, _rel_err, _run, _setup

from tierstore.kernels import MissLog, moe_mm_ref


@pytest.mark.parametrize("dtype", DTYPES)
def test_refetch_into_poisoned_slots_restores_the_all_resident_output_exactly(dtype):
    """Before the fetch: miss count 3 pairs / 2 experts, list [(0, 3), (0, 5)], finite output matching
    the reference with those pairs zeroed. After it: no miss and torch.equal to the all-resident run."""
    hidden, inter, experts = 256, 64, 6
    gen, w2, f4 = _setup(hidden, inter, experts, 1, 23, w2_slots=experts, fp4_slots=1)
    w2.table[0] = torch.tensor([4, 2, 0, 5, 1, 3], dtype=torch.int32)  # expert -> slot
    ids = torch.tensor([[0, 3], [2, 5], [3, 1], [4, 2]], dtype=torch.int32, device=DEVICE)  # [T, k]
    wts = torch.rand(4, 2, generator=gen).to(DEVICE) + 0.05  # [T, k]
    x = (3 * torch.randn(4, hidden, generator=gen)).to(DEVICE, dtype)  # [T, H]
    full = _run(x, ids, wts, w2, f4, 0, MissLog.allocate(4, DEVICE))  # [T, H]
    ref, _, _ = moe_mm_ref(x, ids, wts, w2, f4, 0, act_dtype=dtype)
    assert _rel_err(full, ref) < TOLERANCE[dtype]

    slot3, slot5 = int(w2.table[0, 3]), int(w2.table[0, 5])
    real3, real5 = w2.slots[slot3].clone(), w2.slots[slot5].clone()  # [slot_bytes] each
    garbage = torch.randint(0, 256, (2, w2.slots.shape[1]), generator=gen, dtype=torch.uint8)  # [2, slot_bytes]
    w2.slots[[slot3, slot5]] = garbage.to(DEVICE)
    w2.table[0, 3] = w2.table[0, 5] = -1
    misses = MissLog.allocate(4, DEVICE)
    degraded = _run(x, ids, wts, w2, f4, 0, misses)  # [T, H]
    want, missing_pairs, missing = moe_mm_ref(x, ids, wts, w2, f4, 0, act_dtype=dtype)
    assert (missing_pairs, missing) == (3, [(0, 3), (0, 5)])
    assert misses.counts.tolist() == [3, 2]
    assert sorted(tuple(e) for e in misses.entries[:2].tolist()) == [(0, 3), (0, 5)]
    assert degraded.isfinite().all() and _rel_err(degraded, want) < TOLERANCE[dtype]
    assert not torch.equal(degraded, full)

    w2.slots[slot5], w2.slots[slot3] = real3, real5  # the fetch: bytes first, then the table
    w2.table[0, 3], w2.table[0, 5] = slot5, slot3
    misses = MissLog.allocate(4, DEVICE)
    assert torch.equal(_run(x, ids, wts, w2, f4, 0, misses), full)
    assert misses.counts.tolist() == [0, 0]
