"""GPU-only kernel tests: bf16 over the geometry presets and batch sizes, CUDA-graph replay = eager."""

import pytest
import torch

pytest.importorskip("triton")

from tests.kernel_fixtures import random_routing  # noqa: E402
from tierstore.geometry import PRESETS  # noqa: E402
from tierstore.kernels import MissLog, MoeWorkspace, fp4_tier, moe_mm, moe_mm_ref, w2_tier  # noqa: E402

pytestmark = pytest.mark.gpu

SLOTS = 6  # slots per tier; experts beyond the resident ones are misses


def _random_pool(pool, gen):
    pool.slots.random_(0, 256, generator=gen)
    lay = pool.layout
    for offset, m in ((lay.w13_scales_offset, lay.w13), (lay.w2_scales_offset, lay.w2)):
        pool.slots[:, offset: offset + m.scale_bytes].random_(118, 127, generator=gen)


def _tiers(geo, seed):
    h, i, e = geo.hidden, geo.expert_inter, geo.num_experts
    w2, f4 = w2_tier(h, i, SLOTS, 1, e, "cuda"), fp4_tier(h, i, 3, 1, e, "cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    _random_pool(w2, gen)
    _random_pool(f4, gen)
    return w2, f4


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("tokens", [1, 2, 3, 4, 8, 16, 32, 64, 333])
def test_presets_match_reference(name, tokens):
    geo = PRESETS[name]
    gen = torch.Generator().manual_seed(tokens)
    w2, f4 = _tiers(geo, tokens)
    experts = min(geo.num_experts, 3 * SLOTS)
    resident = torch.randperm(experts, generator=gen)[: SLOTS + 2]
    w2.table[0, resident[:SLOTS]] = torch.arange(SLOTS, dtype=torch.int32).cuda()
    f4.table[0, resident[SLOTS - 1:]] = torch.arange(3, dtype=torch.int32).cuda()[: len(resident[SLOTS - 1:])]
    ids, wts = random_routing(tokens, geo.top_k, experts, gen, "cuda")
    x = torch.randn(tokens, geo.hidden, generator=gen).cuda().to(torch.bfloat16)
    ws = MoeWorkspace.allocate(tokens, geo.top_k, geo.num_experts, geo.hidden, geo.expert_inter, x.dtype, "cuda")
    ws.act.fill_(float("nan"))
    ws.y.fill_(float("nan"))
    out = torch.full_like(x, float("nan"))
    misses = MissLog.allocate(64, "cuda")
    moe_mm(x, ids, wts, w2, f4, 0, misses, ws, out=out)
    ref, missing_pairs, missing = moe_mm_ref(x, ids, wts, w2, f4, 0, act_dtype=torch.bfloat16)
    assert not out.isnan().any()
    if ref.norm() > 0:
        assert float((out.float() - ref).norm() / ref.norm()) < 2e-2
    assert misses.counts.tolist() == [missing_pairs, len(missing)]
    assert sorted(tuple(e) for e in misses.entries[: len(missing)].tolist()) == missing


@pytest.mark.parametrize("name", ["deepseek-v3", "ds-v2-lite"])
@pytest.mark.parametrize("tokens", [1, 5])
def test_plain_and_ptx_w2_paths_match_reference(name, tokens):
    """The BT = 1 W2 path with (inline-PTX bf16x2) and without (plain Triton) the fast decode, all pairs W2."""
    geo = PRESETS[name]
    gen = torch.Generator().manual_seed(100 + tokens)
    w2, f4 = _tiers(geo, 100 + tokens)
    w2.table[0, :SLOTS] = torch.arange(SLOTS, dtype=torch.int32).cuda()
    ids, wts = random_routing(tokens, min(geo.top_k, SLOTS), SLOTS, gen, "cuda")
    x = torch.randn(tokens, geo.hidden, generator=gen).cuda().to(torch.bfloat16)
    ref, _, _ = moe_mm_ref(x, ids, wts, w2, f4, 0, act_dtype=torch.bfloat16)
    errors = {}
    for ptx in (False, True):
        ws = MoeWorkspace.allocate(tokens, ids.shape[1], geo.num_experts, geo.hidden, geo.expert_inter, x.dtype, "cuda",
                                   block_tokens=1, ptx_w2=ptx)
        out = torch.full_like(x, float("nan"))
        moe_mm(x, ids, wts, w2, f4, 0, MissLog.allocate(8, "cuda"), ws, out=out)
        assert not out.isnan().any()
        errors[ptx] = float((out.float() - ref).norm() / ref.norm())
    assert errors[False] < 5e-3
    assert errors[True] < 1e-2  # eight products per word summed in bf16x2


def test_graph_replay_equals_eager_and_tracks_table_changes():
    geo = PRESETS["olmoe-1b-7b"]
    gen = torch.Generator().manual_seed(1)
    w2, f4 = _tiers(geo, 1)
    tokens, top_k = 8, 4
    ids, wts = random_routing(tokens, top_k, SLOTS, gen, "cuda")
    x = torch.randn(tokens, geo.hidden, generator=gen).cuda().to(torch.bfloat16)
    ws = MoeWorkspace.allocate(tokens, top_k, geo.num_experts, geo.hidden, geo.expert_inter, x.dtype, "cuda")
    misses = MissLog.allocate(16, "cuda")
    out = torch.empty_like(x)
    w2.table[0, :SLOTS] = torch.arange(SLOTS, dtype=torch.int32).cuda()
    w2.table[0, 2] = -1
    eager_missing = moe_mm(x, ids, wts, w2, f4, 0, misses, ws, out=torch.empty_like(x)).clone()
    w2.table[0, 2] = 2
    eager_full = moe_mm(x, ids, wts, w2, f4, 0, misses, ws, out=torch.empty_like(x)).clone()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe_mm(x, ids, wts, w2, f4, 0, misses, ws, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        misses.reset()
        moe_mm(x, ids, wts, w2, f4, 0, misses, ws, out=out)
    w2.table[0, 2] = -1
    graph.replay()
    assert torch.equal(out, eager_missing)
    assert misses.counts[1].item() == int((ids == 2).any())
    w2.table[0, 2] = 2  # fetched between replays
    graph.replay()
    assert torch.equal(out, eager_full)
    assert misses.counts.tolist() == [0, 0]
