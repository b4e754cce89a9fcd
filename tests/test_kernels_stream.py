"""moe_mm's Triton stages streaming (`stream=True`): an expert without a W2 slot whose row lies in host memory
(`TierPool.stream_at`) is computed from that row, with the same result bit for bit as from a slot holding the same
bytes, and is logged without counting its pairs as missing; an expert with neither stays missing.

Without CUDA the kernels run in Triton's CPU interpreter (the rows in ordinary memory); with CUDA compiled in
bfloat16, the rows in pinned host memory read over the bus.
"""

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from tests.kernel_fixtures import fill_pool, random_routing  # noqa: E402
from tierstore.kernels import MissLog, MoeWorkspace, fp4_tier, moe_mm, w2_tier  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
LAYER = 1


def _pools(hidden: int, inter: int, experts: int, seed: int, streamed: list[int], missing: list[int]):
    """(resident pool: every expert but `missing` in a slot; streaming pool: the same slots, `streamed` experts
    without one but with their rows copied to host memory; the host rows (kept alive); fp4 tier with expert 0)."""
    gen = torch.Generator().manual_seed(seed)
    resident = w2_tier(hidden, inter, experts, 2, experts, DEVICE)
    fill_pool(resident, gen, fp4=False)
    f4 = fp4_tier(hidden, inter, 1, 2, experts, DEVICE)
    fill_pool(f4, gen, fp4=True)
    f4.table[LAYER, 0] = 0  # an FP4-resident expert beside the streamed ones
    order = torch.randperm(experts, generator=gen).to(torch.int32)  # expert e in slot order[e]
    resident.table[LAYER] = order.to(DEVICE)
    resident.table[LAYER, missing] = -1
    host = resident.slots.cpu().pin_memory() if ON_GPU else resident.slots.clone()  # [S, slot_bytes] host rows
    table = resident.table.clone()
    table[LAYER, streamed] = -1
    at = torch.zeros(table.numel(), dtype=torch.int64)
    for e in streamed:
        at[LAYER * experts + e] = host[int(order[e])].data_ptr() - resident.slots.data_ptr()
    streaming = dataclasses.replace(resident, table=table, stream_at=at.to(DEVICE))
    return resident, streaming, host, f4, gen


def _run(x, ids, wts, w2, f4, block_tokens: int, stream: bool, limit: float | None):
    ws = MoeWorkspace.allocate(x.shape[0], ids.shape[1], w2.table.shape[1], x.shape[1], w2.layout.inter, x.dtype,
                               DEVICE, block_tokens=block_tokens)
    ws.act.fill_(float("nan"))
    ws.y.fill_(float("nan"))
    out = torch.full_like(x, float("nan"))
    misses = MissLog.allocate(16, DEVICE)
    moe_mm(x, ids, wts, w2, f4, LAYER, misses, ws, out=out, swiglu_limit=limit, stream=stream)
    if ON_GPU:
        torch.cuda.synchronize()
    counts = misses.counts.tolist()
    return out, counts, sorted(misses.entries[:counts[1], 1].tolist())


@pytest.mark.parametrize("block_tokens", [1, 16])
def test_streamed_experts_equal_their_slots_and_add_no_missing_pair(block_tokens):
    hidden, inter, experts = 256, 96, 8  # the down matrix's K padded (inter 96: WPS 16)
    streamed, missing = [2, 3, 6], [5]
    resident, streaming, _host, f4, gen = _pools(hidden, inter, experts, 17 + block_tokens, streamed, missing)
    first = torch.tensor([[2, 0, 5], [6, 3, 1]], dtype=torch.int32, device=DEVICE)  # every kind of expert routed
    for trial, limit in enumerate((None, 1.5)):  # the given routing, then a fresh one with the SwiGLU clamp
        ids, wts = random_routing(2, 3, experts, gen, DEVICE)
        ids = first if trial == 0 else ids
        x = (torch.randn(2, hidden, generator=gen) * 2).to(DEVICE, DTYPES[0])
        want, want_counts, want_logged = _run(x, ids, wts, resident, f4, block_tokens, False, limit)
        got, got_counts, got_logged = _run(x, ids, wts, streaming, f4, block_tokens, True, limit)
        routed = set(ids.reshape(-1).tolist())
        missing_pairs = sum(int((ids == e).sum()) for e in missing)
        assert want_counts == [missing_pairs, len(routed & set(missing))]
        assert got_counts[0] == missing_pairs, "streamed pairs are not missing; the expert without a row is"
        assert got_logged == sorted(routed & set(streamed + missing)), "streamed experts are logged with the missing"
        assert not torch.isnan(got).any()
        assert torch.equal(got, want), f"trial {trial}: a streamed expert differs from its slot's result"
        if trial == 0:  # the same tier not streamed: its streamed experts miss
            _, plain_counts, plain_logged = _run(x, ids, wts, streaming, f4, block_tokens, False, limit)
            assert plain_counts == [4, 4] and plain_logged == [2, 3, 5, 6]
