"""Pair order for the single-token FP4 kernels (FP4_PAIR_ORDER, kernels/cuda/fp4_moe.cu), as W2_PAIR_ORDER for the W2
ones (tests/test_cuda_w2_pair_order.py): block b is routed pair b, its expert read from the router's topk ids, so that
with both tiers in pair order `TierMoeCuda` is route_free and `moe_mm` routes beside it. The same bytes per pair.
"""

from __future__ import annotations

import pytest
import torch

from tests.cuda_fixtures import launched_twice, needs_nvcc, replayed_once, run_whole, same_bytes, stub_builds
from tests.test_cuda_fp4_decode_mad import CASE_SHAPES, EXPERTS, FP4_SLOTS, TOP_K, _fp4_rows, _ids, _routed, build_case
from tierstore.kernels import MissLog, MoeWorkspace, moe_mm
from tierstore.kernels.cuda import fp4_stages, w2_down
from tierstore.kernels.cuda.w2_moe import SINGLE

W2_ROUTE = {k: v for k, v in SINGLE.items() if k != "pair_order"}  # the W2 single-token options in route order


def test_wrappers_and_the_tier_op_take_pair_order(monkeypatch):
    from tierstore.kernels.cuda.tier_moe import FP4_SINGLE, TierMoeCuda
    from tierstore.kernels.cuda.w2_moe import W2MoeCuda

    built, _ = stub_builds(monkeypatch)
    fp4_stages.Fp4GateUpCuda(device=0, pair_order=True)
    fp4_stages.Fp4DownCuda(device=0, wps=16, pair_order=True)
    assert built == [(fp4_stages.SOURCE.name, {"FP4_AHEAD": 2, "FP4_PAIR_ORDER": 1}),
                     (fp4_stages.SOURCE.name, {"FP4_AHEAD": 2, "FP4_WPS": 16, "FP4_PAIR_ORDER": 1})]
    single = MoeWorkspace.allocate(2, TOP_K, EXPERTS, 1024, 512, torch.bfloat16, "cpu", block_tokens=1)
    multi = MoeWorkspace.allocate(2, TOP_K, EXPERTS, 1024, 512, torch.bfloat16, "cpu", block_tokens=16)
    tier = TierMoeCuda(device=0)  # the defaults: both tiers' single-token kernels in pair order
    assert FP4_SINGLE["pair_order"] and tier.route_free(single) and not tier.route_free(multi)
    assert not TierMoeCuda(device=0, fp4_single={}).route_free(single)
    w2_route = W2MoeCuda(device=0, gate_single=W2_ROUTE, down_single=W2_ROUTE)
    assert not TierMoeCuda(w2=w2_route, device=0).route_free(single)
    ids = torch.zeros(2, TOP_K, dtype=torch.int32)
    args = fp4_stages.down_args(_pool_cpu(), 0, single, single.y, ids)  # act, stride, 8 slot words, then the route's
    assert args[10:13] == [ids.data_ptr(), ids.data_ptr(), single.experts.data_ptr()]


def _pool_cpu():
    from tierstore.kernels import fp4_tier

    return fp4_tier(1024, 512, 1, 1, EXPERTS, "cpu")


# ---- on a GPU --------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", params=CASE_SHAPES)
def pair_case(request):
    return build_case(*request.param)


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_pair_order_fp4_kernels_give_the_route_order_bytes(pair_case, tokens):
    case, f4, wps = pair_case, pair_case["f4"], pair_case["wps"]
    ids = _ids(case, tokens)
    rows = _fp4_rows(ids)
    ws = _routed(case, ids, 1)
    x = torch.randn(tokens, case["hidden"], generator=case["gen"]).to(torch.bfloat16).cuda()
    gate = launched_twice({"route": fp4_stages.Fp4GateUpCuda(), "pair": fp4_stages.Fp4GateUpCuda(pair_order=True)},
                          ws.act, float("nan"),
                          lambda k, out: k(x, TOP_K, f4, 0, ws, out=out, **({"topk_ids": ids} if k.pair_order else {})))
    base = gate["route"][0]
    assert not base[rows].isnan().any() and base[~rows].isnan().all()
    assert all(same_bytes(o, base) for o in gate["pair"] + gate["route"][1:])
    ws.act.copy_(torch.randn(ws.act.shape, generator=case["gen"]).to(torch.bfloat16))
    downs = {"route": fp4_stages.Fp4DownCuda(wps=wps), "pair": fp4_stages.Fp4DownCuda(wps=wps, pair_order=True)}
    down = launched_twice(downs, ws.y, -7.0,
                          lambda k, out: k(f4, 0, ws, out=out, **({"topk_ids": ids} if k.pair_order else {})))
    torch.cuda.synchronize()
    base = down["route"][0]
    assert not base[rows].isnan().any() and (base[~rows] == -7.0).all()
    assert all(same_bytes(o, base) for o in down["pair"])
    bad = ids.clone()
    bad[0, 0] = EXPERTS  # not an expert of the table: no block
    out = torch.full_like(ws.y, -7.0)
    downs["pair"](f4, 0, ws, out=out, topk_ids=bad)
    torch.cuda.synchronize()
    assert (out[0] == -7.0).all() and same_bytes(out[1:], base[1:])


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens", [1, 4])
def test_tier_op_routes_beside_its_pair_order_kernels(pair_case, tokens):
    """TierMoeCuda's defaults (both tiers in pair order, the route beside them) against both tiers in route order:
    same bytes and miss counts, eager and replayed in a CUDA graph."""
    from tierstore.kernels.cuda.tier_moe import TierMoeCuda
    from tierstore.kernels.cuda.w2_moe import W2MoeCuda

    case = pair_case
    ids = _ids(case, tokens)
    x = torch.randn(tokens, case["hidden"], generator=case["gen"]).to(torch.bfloat16).cuda()
    weights = (torch.rand(tokens, TOP_K, generator=case["gen"]) + 0.05).cuda()
    w2_wps = w2_down.wps_of(case["w2"].layout)
    route = TierMoeCuda(w2=W2MoeCuda(wps=w2_wps, gate_single=W2_ROUTE, down_single=W2_ROUTE), fp4_wps=case["wps"],
                        fp4_single={})
    pair = TierMoeCuda(w2=W2MoeCuda(wps=w2_wps), fp4_wps=case["wps"])
    run = lambda tier: run_whole(x, ids, weights, case["w2"], case["f4"], tier, case["inter"], EXPERTS, 4)
    base, base_counts, base_entries = run(route)
    assert not base.isnan().any() and base_counts[0] > 0 and any(e in FP4_SLOTS for e in ids.reshape(-1).tolist())
    out, counts, entries = run(pair)
    assert same_bytes(out, base) and counts == base_counts and entries == base_entries
    ws = MoeWorkspace.allocate(tokens, TOP_K, EXPERTS, case["hidden"], case["inter"], torch.bfloat16, "cuda",
                               block_tokens=1)
    assert pair.route_free(ws)
    misses = MissLog.allocate(4, "cuda")
    graph_out = torch.full_like(x, float("nan"))
    replayed_once(lambda: moe_mm(x, ids, weights, case["w2"], case["f4"], 0, misses, ws, out=graph_out, cuda_w2=pair),
                  misses, graph_out)
    assert same_bytes(graph_out, base) and misses.counts.tolist() == base_counts
