"""Pair order for the single-token CUDA kernels (W2_PAIR_ORDER, kernels/cuda/w2_gate_up.cu / w2_down.cu): block b is
routed pair b, its expert read from the router's topk ids instead of the route output, so `moe_mm` runs the routing
kernel beside them on the workspace's side stream (kernels/moe_mm.py `_route_beside`). The same bytes per pair as
the route-order kernels.

CPU: the define and its guard, the wrappers' arguments, `route_free`, the ids' checks, the workspace's expert count,
the builds (no spills, the route-order builds' SASS unchanged by the define's existence is covered by the tests of
each kernel). GPU: both kernels and the whole op (eager and replayed in a CUDA graph, route on its own branch) give
the route-order bytes and miss counts; an expert id outside the table is no block.
"""

from __future__ import annotations

import pytest
import torch

from tests.cuda_fixtures import needs_nvcc, ptxas_report, registers, replayed_once, run_whole, same_bytes, stub_builds
from tests.test_cuda_w2_decode_mad import EXPERTS, TOP_K, _routed, mad_case  # noqa: F401  (mad_case: a fixture)
from tierstore.kernels import MissLog, MoeWorkspace, moe_mm
from tierstore.kernels.cuda import w2_down, w2_gate_up
from tierstore.kernels.cuda.w2_down import W2DownCuda
from tierstore.kernels.cuda.w2_gate_up import W2GateUpCuda
from tierstore.kernels.cuda.w2_moe import SINGLE, W2MoeCuda

PAIR = SINGLE | {"pair_order": True}  # the default since 692b975 measured it
ROUTE = {k: v for k, v in SINGLE.items() if k != "pair_order"}  # the single-token options before it


def test_the_define_needs_the_early_prologue_and_is_off_by_default():
    assert "W2_PAIR_ORDER" not in w2_gate_up.build_defines(2, early=True)
    assert w2_gate_up.build_defines(2, early=True, pair_order=True)["W2_PAIR_ORDER"] == 1
    assert w2_down.build_defines(2, 1, early=True, pair_order=True)["W2_PAIR_ORDER"] == 1
    with pytest.raises(ValueError, match="pair_order needs early"):
        w2_gate_up.build_defines(2, pair_order=True)


@needs_nvcc
@pytest.mark.parametrize("source,defines", [
    (w2_gate_up.SOURCE, {"W2_AHEAD": 2, "W2_EARLY": 1, "W2_PDL": 1, "W2_DECODE_MAD": 1}),
    (w2_down.SOURCE, {"W2_AHEAD": 2, "W2_GROUPS": 1, "W2_EARLY": 1, "W2_PDL": 1, "W2_DECODE_MAD": 1}),
    (w2_down.SOURCE, {"W2_AHEAD": 2, "W2_GROUPS": 1, "W2_EARLY": 1, "W2_PDL": 1, "W2_DECODE_MAD": 1, "W2_WPS": 16})])
def test_pair_order_builds_compile_without_spills(tmp_path, source, defines):
    report = ptxas_report(source, tmp_path / "k.cubin", defines | {"W2_PAIR_ORDER": 1})
    assert "0 bytes spill stores" in report and registers(report) <= 128  # 4 blocks of 128 threads per SM


def test_wrappers_route_free_and_the_ids_checks(monkeypatch):
    built, _ = stub_builds(monkeypatch)
    W2GateUpCuda(ahead=2, device=0, early=True, pair_order=True)
    W2DownCuda(device=0, early=True, pair_order=True, wps=16)
    assert built[0][1]["W2_PAIR_ORDER"] == 1 and built[1][1]["W2_PAIR_ORDER"] == 1
    op = W2MoeCuda(device=0, gate_single=PAIR, down_single=PAIR)
    single = MoeWorkspace.allocate(2, TOP_K, EXPERTS, 1024, 512, torch.bfloat16, "cpu", block_tokens=1)
    multi = MoeWorkspace.allocate(2, TOP_K, EXPERTS, 1024, 512, torch.bfloat16, "cpu", block_tokens=16)
    assert op.route_free(single) and not op.route_free(multi)
    assert SINGLE["pair_order"] and W2MoeCuda(device=0).route_free(single)  # adopted: W2MoeCuda's default
    assert not W2MoeCuda(device=0, gate_single=ROUTE, down_single=ROUTE).route_free(single)
    with pytest.raises(ValueError, match="take pair_order together"):
        W2MoeCuda(device=0, gate_single=PAIR, down_single=ROUTE)
    assert single.experts.tolist() == [EXPERTS] and single.side_stream is None  # no side stream off CUDA
    ids = torch.zeros(2, TOP_K, dtype=torch.int32)
    w2_gate_up.check_topk_ids(ids, single)
    with pytest.raises(ValueError, match="reads the router's topk_ids: pass them"):
        w2_gate_up.check_topk_ids(None, single)
    with pytest.raises(ValueError, match=r"contiguous int32 with 4 ids"):
        w2_gate_up.check_topk_ids(ids.long(), single)
    with pytest.raises(ValueError, match=r"contiguous int32 with 4 ids"):
        w2_gate_up.check_topk_ids(torch.zeros(3, TOP_K, dtype=torch.int32), single)
    args = w2_gate_up.launch_args(torch.zeros(2, 1024, dtype=torch.bfloat16), TOP_K, *_pools_cpu(), 0, single,
                                  single.act, None, ids)
    assert args[11:14] == [ids.data_ptr(), ids.data_ptr(), single.experts.data_ptr()]


def _pools_cpu():
    from tierstore.kernels import fp4_tier, w2_tier

    return w2_tier(1024, 512, 1, 1, EXPERTS, "cpu"), fp4_tier(1024, 512, 1, 1, EXPERTS, "cpu")


# ---- on a GPU --------------------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_pair_order_kernels_give_the_route_order_bytes(mad_case, tokens):  # noqa: F811
    ids, ws = _routed(mad_case, tokens)  # route order: moe_route ran; ids include an FP4 and a missing expert
    x = torch.randn(tokens, mad_case["hidden"], generator=mad_case["gen"]).to(torch.bfloat16).cuda()
    w2, f4 = mad_case["w2"], mad_case["f4"]
    route = W2GateUpCuda(ahead=2, **ROUTE)
    pair = W2GateUpCuda(ahead=2, **PAIR)

    def gate_up(kernel, **kw):
        out = torch.full_like(ws.act, float("nan"))
        kernel(x, TOP_K, w2, f4, 0, ws, out=out, **kw)
        torch.cuda.synchronize()
        return out

    base = gate_up(route)
    assert base.isfinite().any() and base.isnan().any()
    assert same_bytes(gate_up(pair, topk_ids=ids), base) and same_bytes(gate_up(pair, topk_ids=ids), base)

    ws.act.copy_(torch.randn(ws.act.shape, generator=mad_case["gen"]).to(torch.bfloat16))

    def down(kernel, **kw):
        out = torch.full_like(ws.y, -7.0)
        kernel(w2, f4, 0, ws, out=out, **kw)
        torch.cuda.synchronize()
        return out

    base = down(W2DownCuda(wps=mad_case["wps"], **ROUTE))
    pair_down = W2DownCuda(wps=mad_case["wps"], **PAIR)
    assert same_bytes(down(pair_down, topk_ids=ids), base) and same_bytes(down(pair_down, topk_ids=ids), base)

    bad = ids.clone()
    bad[0, 0] = EXPERTS  # not an expert of the table: no block, its rows left as they were
    rows = down(pair_down, topk_ids=bad)
    assert (rows[0] == -7.0).all() and same_bytes(rows[1:], base[1:])


@pytest.mark.gpu
@needs_nvcc
@pytest.mark.parametrize("tokens", [1, 4])
def test_whole_op_routes_beside_the_pair_order_kernels(mad_case, tokens):  # noqa: F811
    """moe_mm with a route-free W2MoeCuda (the route on the workspace's side stream): the route-order op's bytes and
    miss counts, eager and replayed in a CUDA graph (the fork and join captured as two branches)."""
    ids, _ = _routed(mad_case, tokens)
    ids[0] = torch.tensor([0, 6], dtype=torch.int32)  # a W2 pair and a missing one
    x = torch.randn(tokens, mad_case["hidden"], generator=mad_case["gen"]).to(torch.bfloat16).cuda()
    weights = (torch.rand(tokens, TOP_K, generator=mad_case["gen"]) + 0.05).cuda()
    run = lambda moe: run_whole(x, ids, weights, mad_case["w2"], mad_case["f4_none"], moe, mad_case["inter"],
                                EXPERTS, 4)
    base, base_counts, base_entries = run(W2MoeCuda(wps=mad_case["wps"], gate_single=ROUTE, down_single=ROUTE))
    assert not base.isnan().any() and base_counts[0] > 0
    op = W2MoeCuda(wps=mad_case["wps"], gate_single=PAIR, down_single=PAIR)
    out, counts, entries = run(op)
    assert same_bytes(out, base) and counts == base_counts and entries == base_entries

    ws = MoeWorkspace.allocate(tokens, TOP_K, EXPERTS, mad_case["hidden"], mad_case["inter"], torch.bfloat16, "cuda",
                               block_tokens=1)
    assert ws.side_stream is not None and op.route_free(ws)
    misses = MissLog.allocate(4, "cuda")
    graph_out = torch.full_like(x, float("nan"))
    replayed_once(lambda: moe_mm(x, ids, weights, mad_case["w2"], mad_case["f4_none"], 0, misses, ws, out=graph_out,
                                 cuda_w2=op), misses, graph_out)
    assert same_bytes(graph_out, base) and misses.counts.tolist() == base_counts


@pytest.mark.gpu
@needs_nvcc
def test_routing_beside_reuses_the_workspaces_events(mad_case, monkeypatch):  # noqa: F811
    """Eager calls fork and join the route with the workspace's two events: none is made per call (torch's
    wait_stream makes one each time, two per MoE layer outside a graph); the bytes stay the route-order op's."""
    ids, _ = _routed(mad_case, 1)
    x = torch.randn(1, mad_case["hidden"], generator=mad_case["gen"]).to(torch.bfloat16).cuda()
    weights = (torch.rand(1, TOP_K, generator=mad_case["gen"]) + 0.05).cuda()
    base, _, _ = run_whole(x, ids, weights, mad_case["w2"], mad_case["f4_none"],
                           W2MoeCuda(wps=mad_case["wps"], gate_single=ROUTE, down_single=ROUTE), mad_case["inter"],
                           EXPERTS, 4)
    op = W2MoeCuda(wps=mad_case["wps"], gate_single=PAIR, down_single=PAIR)
    ws = MoeWorkspace.allocate(1, TOP_K, EXPERTS, mad_case["hidden"], mad_case["inter"], torch.bfloat16, "cuda",
                               block_tokens=1)

    def no_event_per_call(*args, **kwargs):
        raise AssertionError("an event was made for this call")
    monkeypatch.setattr(torch.cuda.Stream, "record_event", no_event_per_call)
    for _ in range(2):
        out = torch.full_like(x, float("nan"))
        moe_mm(x, ids, weights, mad_case["w2"], mad_case["f4_none"], 0, MissLog.allocate(4, "cuda"), ws, out=out,
               cuda_w2=op)
        torch.cuda.synchronize()
        assert same_bytes(out, base)
