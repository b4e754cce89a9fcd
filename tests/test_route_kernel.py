"""The routing kernel (kernels/_triton/route.py) against its plain-Python reference (`moe_route_ref`): blocks of one
resident expert (experts ascending, pairs ascending, up to block_tokens each), the miss counters and the miss list,
for both ways of counting pairs per expert and several chunk sizes (one chunk, several chunks). Runs in Triton's CPU
interpreter without a GPU; on a GPU (marker gpu) the same checks run on the device."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton

from tierstore.kernels import MissLog, MoeWorkspace, fp4_tier, moe_route, moe_route_ref, route_blocks, w2_tier
from tierstore.kernels._triton.route import route_kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POISON = -7


def _pools(experts: int, absent: list[int], fp4_only: list[int], layers: int = 2):
    w2 = w2_tier(512, 512, 1, layers, experts, DEVICE)
    f4 = fp4_tier(512, 512, 1, layers, experts, DEVICE)
    w2.table.fill_(0)
    for e in absent + fp4_only:
        w2.table[1, e] = -1
    for e in fp4_only:
        f4.table[1, e] = 0
    return w2, f4


def _ids(tokens: int, top_k: int, experts: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]
    return torch.stack(rows).to(torch.int32).contiguous().to(DEVICE)


def _route(ids, w2, f4, block_tokens, chunk, histogram, misses, stream=False):
    experts = w2.table.shape[1]
    ws = MoeWorkspace.allocate(ids.shape[0], ids.shape[1], experts, 512, 512, torch.float32, DEVICE,
                               block_tokens=block_tokens)
    for t in (ws.block_expert, ws.block_fill, ws.block_pairs, ws.num_blocks):
        t.fill_(POISON)
    route_kernel[(1,)](ids, ids.numel(), w2.table, f4.table, 1, experts, ws.block_expert, ws.block_fill,
                       ws.block_pairs, ws.num_blocks, misses.counts, misses.entries, misses.entries.shape[0],
                       w2.stream_at if stream else w2.slots, EP=triton.next_power_of_2(experts), CHUNK=chunk,
                       BT=block_tokens, HISTOGRAM=histogram, STREAM=stream, num_warps=4)
    return ws


CASES = [  # tokens, top_k, experts, block_tokens
    (1, 8, 64, 1), (3, 6, 64, 1), (8, 8, 256, 1), (20, 4, 16, 1), (20, 4, 16, 16), (40, 8, 60, 16), (5, 2, 8, 16)]


@pytest.mark.parametrize("histogram", [False, True])
@pytest.mark.parametrize("chunk", [32, 128])
@pytest.mark.parametrize("tokens,top_k,experts,block_tokens", CASES)
def test_route_matches_the_reference(tokens, top_k, experts, block_tokens, chunk, histogram):
    absent, fp4_only = [1, experts - 1], [2, experts // 2]
    w2, f4 = _pools(experts, absent, fp4_only)
    ids = _ids(tokens, top_k, experts, seed=tokens * experts)
    misses = MissLog.allocate(16, DEVICE)
    misses.counts.copy_(torch.tensor([4, 1], dtype=torch.int32))  # earlier layers of the step already missed
    misses.entries.fill_(POISON)
    misses.entries[0] = torch.tensor([0, 9], dtype=torch.int32)
    ws = _route(ids, w2, f4, block_tokens, chunk, histogram, misses)
    ref = moe_route_ref(ids, w2, f4, 1, block_tokens)
    assert route_blocks(ws) == ref["blocks"]
    assert misses.counts.tolist() == [4 + ref["missing_pairs"], 1 + len(ref["missing_experts"])]
    logged = misses.entries[1: 1 + len(ref["missing_experts"])].tolist()
    assert logged == [[1, e] for e in ref["missing_experts"]]  # appended after the earlier entry, ascending
    assert (misses.entries[1 + len(ref["missing_experts"]):] == POISON).all()


@pytest.mark.parametrize("histogram", [False, True])
def test_a_step_without_misses_leaves_the_miss_log_alone_and_overflow_is_counted(histogram):
    w2, f4 = _pools(32, [], [3])
    ids = _ids(6, 4, 32, seed=1)
    misses = MissLog.allocate(2, DEVICE)
    misses.entries.fill_(POISON)
    _route(ids, w2, f4, 1, 32, histogram, misses)
    assert misses.counts.tolist() == [0, 0] and (misses.entries == POISON).all()

    w2, f4 = _pools(32, [0, 5, 7, 9], [])
    ids = torch.tensor([[0, 5], [7, 9], [9, 1]], dtype=torch.int32, device=DEVICE)
    _route(ids, w2, f4, 1, 32, histogram, misses)
    assert misses.counts.tolist() == [5, 4]
    assert misses.entries.tolist() == [[1, 0], [1, 5]]  # (1, 7), (1, 9) past the capacity: counted, not written


def test_moe_route_uses_the_kernel_with_its_defaults():
    w2, f4 = _pools(64, [4], [])
    ids = _ids(4, 6, 64, seed=3)
    ws = MoeWorkspace.allocate(4, 6, 64, 512, 512, torch.float32, DEVICE, block_tokens=1)
    misses = MissLog.allocate(8, DEVICE)
    moe_route(ids, w2, f4, 1, misses, ws)
    ref = moe_route_ref(ids, w2, f4, 1, 1)
    assert route_blocks(ws) == ref["blocks"] and misses.counts.tolist()[0] == ref["missing_pairs"]


def _streaming(w2, streamed: list[int], layer: int = 1):
    """`w2` with a stream_at table giving `streamed` experts of `layer` an (arbitrary, nonzero) arena row."""
    experts = w2.table.shape[1]
    at = torch.zeros(w2.table.numel(), dtype=torch.int64, device=DEVICE)
    for e in streamed:
        at[layer * experts + e] = 4096 * (e + 1)
    return dataclasses.replace(w2, stream_at=at)


@pytest.mark.parametrize("histogram", [False, True])
@pytest.mark.parametrize("tokens,top_k,experts,block_tokens", [(1, 8, 64, 1), (3, 6, 64, 1), (20, 4, 16, 16)])
def test_streamed_experts_get_blocks_and_are_logged_but_add_no_missing_pair(tokens, top_k, experts, block_tokens,
                                                                            histogram):
    absent = [0, 1, 2, 3, 5, 8, experts - 1]
    w2, f4 = _pools(experts, absent, [])
    w2 = _streaming(w2, [1, 3, 8])  # streamed; 0, 2, 5 and the last stay missing
    ids = torch.tensor([[(t * top_k + j) % experts for j in range(top_k)] for t in range(tokens)], dtype=torch.int32,
                       device=DEVICE)
    misses = MissLog.allocate(16, DEVICE)
    misses.entries.fill_(POISON)
    ws = _route(ids, w2, f4, block_tokens, 32, histogram, misses, stream=True)
    ref = moe_route_ref(ids, w2, f4, 1, block_tokens, stream=True)
    routed = set(ids.reshape(-1).tolist())
    assert {1, 3} <= routed and {e for e, _ in ref["blocks"]} >= {1, 3}  # the reference streams them
    assert route_blocks(ws) == ref["blocks"]
    truly_missing = [e for e in (0, 2, 5, experts - 1) if e in routed]
    assert ref["missing_pairs"] == sum(int((ids == e).sum()) for e in truly_missing)
    assert misses.counts.tolist() == [ref["missing_pairs"], len(ref["missing_experts"])]
    assert ref["missing_experts"] == sorted(e for e in absent if e in routed)  # streamed ones are logged too
    logged = misses.entries[:len(ref["missing_experts"])].tolist()
    assert logged == [[1, e] for e in ref["missing_experts"]]

    plain = MissLog.allocate(16, DEVICE)  # the same tier routed without STREAM: streamed experts are plain misses
    ws = _route(ids, w2, f4, block_tokens, 32, histogram, plain)
    assert route_blocks(ws) == moe_route_ref(ids, w2, f4, 1, block_tokens)["blocks"]
    assert plain.counts.tolist() == [sum(int((ids == e).sum()) for e in absent), len(ref["missing_experts"])]
