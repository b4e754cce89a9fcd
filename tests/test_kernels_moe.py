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


@pytest.mark.parametrize("block_tokens", [1, 2, 16])
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


@pytest.mark.parametrize("dtype", DTYPES)
def test_two_pair_blocks_equal_one_pair_blocks_bit_for_bit(dtype):
    """block_tokens = 2 (two pairs of one expert share each decoded tile) gives the BT = 1 bytes: W2 and
    FP4 experts with 1..4 pairs each (blocks of two and of one), a miss, the SwiGLU clamp."""
    hidden, inter, experts, top_k, tokens = 256, 64, 5, 3, 6
    gen, w2, f4 = _setup(hidden, inter, experts, 1, 23, w2_slots=4, fp4_slots=2)
    w2.table[0, :4] = torch.tensor([3, 0, 2, 1], dtype=torch.int32)
    f4.table[0, 1] = 1
    f4.table[0, 2] = 0  # experts 1, 2 read FP4; 0, 3 read W2; 4 is missing
    ids, wts = random_routing(tokens, top_k, experts, gen, DEVICE)
    x = (3 * torch.randn(tokens, hidden, generator=gen)).to(DEVICE, dtype)
    outs, logs = [], []
    for block_tokens in (1, 2):
        misses = MissLog.allocate(4, DEVICE)
        outs.append(_run(x, ids, wts, w2, f4, 0, misses, limit=6.0, block_tokens=block_tokens))
        logs.append((misses.counts.tolist(), misses.entries.tolist()))
    counts = torch.bincount(ids.reshape(-1).long().cpu(), minlength=experts)
    assert int(counts[:4].max()) >= 2 and int((counts[:4] % 2).sum()) >= 1  # both block kinds ran
    assert not outs[1].isnan().any()
    assert torch.equal(outs[0], outs[1])
    assert logs[0] == logs[1]
    ref, missing_pairs, missing = moe_mm_ref(x, ids, wts, w2, f4, 0, swiglu_limit=6.0, act_dtype=dtype)
    assert _rel_err(outs[1], ref) < TOLERANCE[dtype]
    assert logs[1][0] == [missing_pairs, len(missing)]


def test_two_lane_ptx_runs_each_lane_as_the_single_lane_ptx():
    """The GPU-only two-lane asm (not runnable here) is the single-lane asm per lane, operands renamed:
    word $1 -> $2, activations $2+i -> $3+i (lane a) / $11+i (lane b), scales $10+i -> $19+i."""
    import re

    from tierstore.kernels._triton.decode import _w2_word_dot2_asm, _w2_word_dot_asm

    single = _w2_word_dot_asm().splitlines()[2:-1]
    dual = _w2_word_dot2_asm().splitlines()[2:-1]

    def lane(out: str, acc: str, x_base: int) -> list[str]:
        def operand(m):
            n = int(m.group(1))
            if n == 0:
                return out
            if n == 1:
                return "$2"
            return f"${x_base + n - 2}" if n < 10 else f"${19 + n - 10}"
        return [re.sub(r"\$(\d+)", operand, line).replace("acc", acc) for line in single]

    for out, acc, x_base in (("$0", "acca", 3), ("$1", "accb", 11)):
        expected = lane(out, acc, x_base)
        shared = [line for line in expected if "acc" not in line and " lo" not in line and " hi" not in line
                  and not line.startswith("add.f32")]
        # every instruction of this lane appears in the dual asm, in the same order
        it = iter(dual)
        assert all(any(line == d for d in it) for line in expected), (out, expected)
        assert all(line in dual for line in shared)
    assert sum(line.startswith("fma.rn.bf16x2") for line in dual) == 14
    assert sum(line.startswith("shf.l.wrap") for line in dual) == 7  # the decode is not repeated per lane
