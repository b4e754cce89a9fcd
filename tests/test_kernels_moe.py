"""moe_mm against its plain-torch reference: tiers, misses, SwiGLU clamp, determinism, refetch, graphs.

Without CUDA the kernels run in Triton's CPU interpreter (fp32/fp16 activations, tiny shapes);
with CUDA the same tests run compiled in bf16, plus the `gpu`-marked ones.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from tests.kernel_fixtures import fill_pool, random_routing  # noqa: E402
from tierstore.kernels import MissLog, MoeWorkspace, fp4_tier, moe_mm, moe_mm_ref, w2_tier  # noqa: E402

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.bfloat16] if ON_GPU else [torch.float32, torch.float16]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _setup(hidden, inter, experts, layers, seed, w2_slots, fp4_slots):
    gen = torch.Generator().manual_seed(seed)
    w2 = w2_tier(hidden, inter, w2_slots, layers, experts, DEVICE)
    f4 = fp4_tier(hidden, inter, fp4_slots, layers, experts, DEVICE)
    fill_pool(w2, gen, fp4=False)
    fill_pool(f4, gen, fp4=True)
    return gen, w2, f4


def _run(x, ids, wts, w2, f4, layer, misses, limit=None, block_tokens=None):
    ws = MoeWorkspace.allocate(x.shape[0], ids.shape[1], w2.table.shape[1], x.shape[1], w2.layout.inter, x.dtype, DEVICE,
                               block_tokens=block_tokens)
    ws.act.fill_(float("nan"))
    ws.y.fill_(float("nan"))
    out = torch.full_like(x, float("nan"))
    moe_mm(x, ids, wts, w2, f4, layer, misses, ws, out=out, swiglu_limit=limit)
    return out


def _rel_err(out, ref):
    return float((out.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("block_tokens", [1, 16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_residency_matches_reference_and_logs_misses(dtype, block_tokens):
    hidden, inter, experts, layers, top_k, tokens = 256, 96, 8, 2, 3, 5
    gen, w2, f4 = _setup(hidden, inter, experts, layers, 11, w2_slots=5, fp4_slots=2)
    w2.table[1, :5] = torch.tensor([4, 0, 1, 2, 3], dtype=torch.int32)
    f4.table[1, 1] = 1
    f4.table[1, 6] = 0  # FP4 only
    ids, wts = random_routing(tokens, top_k, experts, gen, DEVICE)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE, dtype)
    misses = MissLog.allocate(8, DEVICE)
    out = _run(x, ids, wts, w2, f4, 1, misses, block_tokens=block_tokens)
    ref, missing_pairs, missing = moe_mm_ref(x, ids, wts, w2, f4, 1, act_dtype=dtype)
    assert not out.isnan().any()
    assert _rel_err(out, ref) < TOLERANCE[dtype]
    assert misses.counts.tolist() == [missing_pairs, len(missing)]
    logged = sorted(tuple(e) for e in misses.entries[: len(missing)].tolist())
    assert logged == missing


def test_miss_list_overflow_is_counted_not_written():
    hidden, inter, experts = 256, 64, 8
    gen, w2, f4 = _setup(hidden, inter, experts, 1, 3, w2_slots=1, fp4_slots=1)
    w2.table[0, 0] = 0
    ids = torch.tensor([[0, 3], [5, 7]], dtype=torch.int32, device=DEVICE)
    wts = torch.ones(2, 2, device=DEVICE)
    x = torch.randn(2, hidden, generator=gen).to(DEVICE, DTYPES[0])
    misses = MissLog.allocate(2, DEVICE)
    misses.counts.copy_(torch.tensor([4, 1], dtype=torch.int32))  # earlier layers of the step already missed
    misses.entries[0] = torch.tensor([9, 9], dtype=torch.int32)
    out = _run(x, ids, wts, w2, f4, 0, misses)
    assert misses.counts.tolist() == [4 + 3, 1 + 3]
    assert misses.entries.tolist() == [[9, 9], [0, 3]]  # (0, 5) and (0, 7) overflowed
    ref, _, _ = moe_mm_ref(x, ids, wts, w2, f4, 0, act_dtype=x.dtype)
    assert torch.equal(out[1].float(), torch.zeros(hidden, device=DEVICE))
    assert _rel_err(out, ref) < TOLERANCE[x.dtype]


def test_swiglu_limit_repeat_determinism_and_refetch_exactness():
    dtype = DTYPES[0]
    hidden, inter, experts, top_k, tokens = 512, 64, 6, 2, 4
    gen, w2, f4 = _setup(hidden, inter, experts, 1, 5, w2_slots=6, fp4_slots=1)
    ids, wts = random_routing(tokens, top_k, experts, gen, DEVICE)
    x = (4 * torch.randn(tokens, hidden, generator=gen)).to(DEVICE, dtype)
    all_resident = torch.arange(experts, dtype=torch.int32, device=DEVICE)
    w2.table[0] = all_resident
    f4.table[0, int(ids[0, 0])] = 0
    full = _run(x, ids, wts, w2, f4, 0, MissLog.allocate(4, DEVICE), limit=7.0)
    ref, _, _ = moe_mm_ref(x, ids, wts, w2, f4, 0, swiglu_limit=7.0, act_dtype=dtype)
    assert _rel_err(full, ref) < TOLERANCE[dtype]
    assert torch.equal(full, _run(x, ids, wts, w2, f4, 0, MissLog.allocate(4, DEVICE), limit=7.0))

    absent = int(ids[1, 1])
    w2.table[0, absent] = -1
    misses = MissLog.allocate(4, DEVICE)
    degraded = _run(x, ids, wts, w2, f4, 0, misses, limit=7.0)
    assert misses.counts[1].item() == 1 and misses.entries[0].tolist() == [0, absent]
    assert not torch.equal(degraded, full)
    w2.table[0, absent] = absent  # "fetched" back into its slot
    assert torch.equal(_run(x, ids, wts, w2, f4, 0, MissLog.allocate(4, DEVICE), limit=7.0), full)
