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


def _run(x, ids, wts, w2, f4, layer, misses, limit=None, block_tokens=None, **ws_kw):
    ws = MoeWorkspace.allocate(x.shape[0], ids.shape[1], w2.table.shape[1], x.shape[1], w2.layout.inter, x.dtype, DEVICE,
                               block_tokens=block_tokens, **ws_kw)
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


# ---- v8: FP4 e2m1 -> bf16x2 by integer bit construction (`fp4_bf16x2`, default "ptx") ----

import struct  # noqa: E402

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tierstore.kernels._triton.decode import (FP4_SCALE_BIAS, _fp4_scale_pairs_asm, _fp4_word_dot_asm,  # noqa: E402
                                               bf16x2_halves, fp4_scale_pairs_ref, fp4_word_pairs)
from tierstore.kernels.layout import E2M1_MAGNITUDES  # noqa: E402


@triton.jit
def _store_pair(pairs_ptr, values_ptr, offs, m, I: tl.constexpr, p, s):
    tl.store(pairs_ptr + offs * 4 + I, p.to(tl.int32, bitcast=True), mask=m)
    v_lo, v_hi = bf16x2_halves(p)
    c_lo, c_hi = bf16x2_halves(s)
    tl.store(values_ptr + offs * 8 + 2 * I, v_lo * c_lo, mask=m)
    tl.store(values_ptr + offs * 8 + 2 * I + 1, v_hi * c_hi, mask=m)


@triton.jit
def _fp4_decode_probe(words_ptr, scale_words_ptr, pairs_ptr, values_ptr, n, WPS: tl.constexpr, BLOCK: tl.constexpr):
    """Words and their tile's scale words -> the twin's bf16x2 pairs and the scaled weights (float32)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    w = tl.load(words_ptr + offs, mask=m, other=0)
    q0 = tl.load(scale_words_ptr + 2 * offs, mask=m, other=0)
    q1 = tl.load(scale_words_ptr + 2 * offs + 1, mask=m, other=0)
    p0, p1, p2, p3 = fp4_word_pairs(w)
    s0, s1, s2, s3 = fp4_scale_pairs_ref(q0, q1, WPS)
    _store_pair(pairs_ptr, values_ptr, offs, m, 0, p0, s0)
    _store_pair(pairs_ptr, values_ptr, offs, m, 1, p1, s1)
    _store_pair(pairs_ptr, values_ptr, offs, m, 2, p2, s2)
    _store_pair(pairs_ptr, values_ptr, offs, m, 3, p3, s3)


def _e2m1(nibbles: torch.Tensor) -> torch.Tensor:
    mag = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)[(nibbles & 7).long()]
    return torch.where(nibbles >= 8, -mag, mag)


def _decode_cases(wps: int, seed: int):
    """Words covering every nibble in every slot at every scale byte 0..240 (one scale per word), plus random
    words with a random scale byte per block; returns (nibbles [N, 8], block bytes [N, 8 blocks of the tile])."""
    gen = torch.Generator().manual_seed(seed)
    rot = (torch.arange(16)[:, None] + torch.arange(8)[None, :]) % 16  # [16, 8]: nibble (n + j) % 16 in slot j
    scales = torch.arange(0, 241)
    nib = rot.repeat(len(scales), 1)
    byte = scales.repeat_interleave(16)[:, None].expand(-1, 8)
    rnd_nib = torch.randint(0, 16, (2048, 8), generator=gen)
    rnd_byte = torch.randint(0, 241, (2048, 8), generator=gen)
    nib, byte = torch.cat([nib, rnd_nib]), torch.cat([byte, rnd_byte])
    slot_block = torch.arange(8) if wps == 32 else torch.arange(8) // 2  # block of slot j within the tile
    return nib, byte, slot_block


def _pack_probe(nib, byte):
    words = (nib.to(torch.int64) << (4 * torch.arange(8))).sum(1)
    words = (words - ((words >> 31) << 32)).to(torch.int32)
    q = (byte.to(torch.int64) << (8 * (torch.arange(8) % 4))).view(-1, 2, 4).sum(2)
    q = (q - ((q >> 31) << 32)).to(torch.int32)
    return words, q.reshape(-1)


@pytest.mark.parametrize("wps", [32, 16])
def test_fp4_bf16x2_decode_is_byte_exact_for_every_nibble_and_scale(wps):
    """The twin's integer construction (the PTX's, instruction for instruction) gives the bf16 bits of every
    e2m1 value, and times the bf16 scale pair the exact value * 2^(byte - 127 + FP4_SCALE_BIAS), for every
    scale byte 0..240 the layout admits (without the bias, bytes 0 and 1 would leave the normal range)."""
    nib, byte, slot_block = _decode_cases(wps, seed=wps)
    words, q = _pack_probe(nib, byte)
    n = words.numel()
    pairs = torch.full((n, 4), 0x7FC07FC0, dtype=torch.int32, device=DEVICE)  # poisoned (NaN pairs)
    values = torch.full((n, 8), float("nan"), device=DEVICE)
    _fp4_decode_probe[(triton.cdiv(n, 256),)](words.to(DEVICE), q.to(DEVICE), pairs, values, n, WPS=wps, BLOCK=256)
    pairs, values = pairs.cpu(), values.cpu()
    ref = _e2m1(nib)  # [N, 8], slot order
    bits = ref.float().to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    assert torch.equal(ref.float().to(torch.bfloat16).double(), ref)  # every e2m1 value is an exact bf16
    want_pairs = bits[:, 0::2] | (bits[:, 1::2] << 16)
    assert torch.equal(pairs.to(torch.int64) & 0xFFFFFFFF, want_pairs)
    slot_byte = byte[:, slot_block]  # [N, 8] scale byte of each slot's block
    want = ref * torch.exp2(slot_byte.double() - 127 + FP4_SCALE_BIAS)  # [N, 8]
    assert torch.equal(want.to(torch.bfloat16).double(), want)  # exact bf16 products ...
    assert ((want == 0) | (want.abs() >= 2.0**-126)).all()  # ... zero or normal (no subnormal step)
    unbiased = want / 2**FP4_SCALE_BIAS
    assert ((unbiased != 0) & (unbiased.abs() < 2.0**-126)).any()  # without the bias: subnormal (bytes 0, 1)
    assert torch.equal(values.view(torch.int32), want.float().view(torch.int32))  # sign of zero included


# A minimal interpreter of the instructions the FP4 PTX uses, to run the PTX text itself on the CPU.

def _bf16_value(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", (bits & 0xFFFF) << 16))[0]


def _bf16_bits_exact(x: float) -> int:
    f32 = struct.unpack("<I", struct.pack("<f", x))[0]
    assert struct.unpack("<f", struct.pack("<I", f32))[0] == x and f32 & 0xFFFF == 0, f"{x} is not an exact bf16"
    return f32 >> 16


def _prmt(a: int, b: int, c: int) -> int:
    src = a | (b << 32)
    out = 0
    for j in range(4):
        sel = (c >> (4 * j)) & 0xF
        byte = (src >> (8 * (sel & 7))) & 0xFF
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * j)
    return out


def _run_ptx(asm: str, operands: dict[int, int]) -> dict:
    regs = {f"${k}": v for k, v in operands.items()}

    def val(tok: str) -> int:
        return regs[tok] if tok in regs else int(tok, 0) & 0xFFFFFFFF

    for line in asm.splitlines():
        line = line.strip()
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, rest = line.rstrip(";").split(" ", 1)
        args = [a.strip() for a in rest.split(",")]
        d, src = args[0], [val(a) for a in args[1:]]
        if op == "mov.b32":
            r = src[0]
        elif op == "add.s32":
            r = (src[0] + src[1]) & 0xFFFFFFFF
        elif op == "and.b32":
            r = src[0] & src[1]
        elif op == "or.b32":
            r = src[0] | src[1]
        elif op == "shl.b32":
            r = (src[0] << src[1]) & 0xFFFFFFFF
        elif op == "shr.b32":
            r = src[0] >> src[1]
        elif op == "prmt.b32":
            r = _prmt(*src)
        elif op in ("mul.rn.bf16x2", "fma.rn.bf16x2"):  # exact cases only (asserted)
            r = 0
            for half in (0, 16):
                x = _bf16_value(src[0] >> half) * _bf16_value(src[1] >> half)
                if op.startswith("fma"):
                    x += _bf16_value(src[2] >> half)
                r |= _bf16_bits_exact(x) << half
        elif op == "add.f32":
            f = [struct.unpack("<f", struct.pack("<I", s))[0] for s in src]
            r = struct.unpack("<I", struct.pack("<f", f[0] + f[1]))[0]
        else:
            raise AssertionError(f"unexpected PTX instruction {op}")
        regs[d] = r
    return regs


@pytest.mark.parametrize("wps", [32, 16])
def test_fp4_ptx_text_decodes_every_nibble_exactly(wps):
    """Runs the inline-PTX text (scale pairs + word dot) in a Python model of its instructions: with a one-hot
    activation pair the word dot returns exactly e2m1 * 2^(byte - 127 + FP4_SCALE_BIAS) for every nibble in
    every slot, every scale byte 0..240 (products asserted exact)."""
    nib, byte, slot_block = _decode_cases(wps, seed=100 + wps)
    keep = torch.arange(nib.shape[0]) % 3 == 0  # every third word of the cases keeps the run short
    keep[: 16 * 241: 241] = True
    nib, byte = nib[keep], byte[keep]
    words, q = _pack_probe(nib, byte)
    ref = _e2m1(nib) * torch.exp2(byte[:, slot_block].double() - 127 + FP4_SCALE_BIAS)
    one = _bf16_bits_exact(1.0)
    dot_asm, scale_asm = _fp4_word_dot_asm(), _fp4_scale_pairs_asm(wps)
    for r in range(words.numel()):
        sregs = _run_ptx(scale_asm, {4: int(q[2 * r]) & 0xFFFFFFFF, 5: int(q[2 * r + 1]) & 0xFFFFFFFF})
        scales = {6 + i: sregs[f"${i}"] for i in range(4)}
        for j in range(8):
            x = {2 + i: (one << (16 * (j % 2)) if i == j // 2 else 0) for i in range(4)}
            regs = _run_ptx(dot_asm, {1: int(words[r]) & 0xFFFFFFFF, **x, **scales})
            out = struct.unpack("<f", struct.pack("<I", regs["$0"]))[0]
            assert out == float(ref[r, j]), (r, j, out, float(ref[r, j]))


def test_fp4_ptx_structure():
    """The FP4 word dot: 17 integer instructions of decode per word (plus 4 table movs), one packed multiply by
    the scale per pair and one packed mul/FMA per pair; no exponent add, no cvt, no float op on the integer
    side, so no step depends on subnormals (the decode builds normal bf16 bits directly)."""
    body = [line for line in _fp4_word_dot_asm().splitlines()[3:-1]]
    ops = [line.split(" ", 1)[0] for line in body]
    decode = ops[: ops.index("mul.rn.bf16x2")]
    assert decode.count("mov.b32") == 4 and len(decode) - 4 == 17
    assert set(decode) == {"mov.b32", "and.b32", "shr.b32", "shl.b32", "prmt.b32", "or.b32"}
    assert ops.count("mul.rn.bf16x2") == 5 and ops.count("fma.rn.bf16x2") == 3
    assert not any(op.startswith(("add.s32", "cvt", "sub")) for op in ops)
    scales = [f"mul.rn.bf16x2 p{i}, p{i}, ${6 + i};" for i in range(4)]
    assert all(line in body for line in scales)
    for wps, words in ((32, 2), (16, 1)):  # the scale bias: one add per scale word, then prmt + shl per pair
        ops = [line.split(" ", 1)[0] for line in _fp4_scale_pairs_asm(wps).splitlines()[3:-1]]
        assert ops == ["add.s32"] * words + ["prmt.b32", "shl.b32"] * 4


def _fp4_run(x, ids, wts, w2, f4, misses, mode, limit=None):
    ws = MoeWorkspace.allocate(x.shape[0], ids.shape[1], w2.table.shape[1], x.shape[1], w2.layout.inter, x.dtype, DEVICE,
                               block_tokens=1, fp4_bf16x2=mode)
    ws.act.fill_(float("nan"))
    ws.y.fill_(float("nan"))
    out = torch.full_like(x, float("nan"))
    moe_mm(x, ids, wts, w2, f4, 0, misses, ws, out=out, swiglu_limit=limit)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp4_bf16x2_fused_matches_reference_with_mixed_residency_and_misses(dtype):
    """fp4_bf16x2 = "ptx" (inline PTX on the GPU with bf16, the plain twin here) and "triton" through the fused
    op: FP4, W2 and missing experts, the SwiGLU clamp, a down matrix with padded K (WPS 16). The twin equals
    the default FP4 decode bit for bit (same products, exact, same order); miss counts and lists as the reference."""
    hidden, inter, experts, top_k, tokens = 256, 96, 8, 3, 5
    gen, w2, f4 = _setup(hidden, inter, experts, 1, 31, w2_slots=4, fp4_slots=3)
    w2.table[0, :4] = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    f4.table[0, 1] = 2
    f4.table[0, 3] = 0
    f4.table[0, 6] = 1  # FP4 only; 4, 5, 7 missing
    ids, wts = random_routing(tokens, top_k, experts, gen, DEVICE)
    x = (3 * torch.randn(tokens, hidden, generator=gen)).to(DEVICE, dtype)
    ref, missing_pairs, missing = moe_mm_ref(x, ids, wts, w2, f4, 0, swiglu_limit=6.0, act_dtype=dtype)
    outs = {}
    for mode in ("off", "triton", "ptx"):
        misses = MissLog.allocate(8, DEVICE)
        outs[mode] = _fp4_run(x, ids, wts, w2, f4, misses, mode, limit=6.0)
        assert not outs[mode].isnan().any()
        assert misses.counts.tolist() == [missing_pairs, len(missing)]
        assert sorted(tuple(e) for e in misses.entries[: len(missing)].tolist()) == missing
        assert _rel_err(outs[mode], ref) < (1e-2 if mode == "ptx" and ON_GPU else TOLERANCE[dtype])
    used = set(ids.reshape(-1).tolist())
    assert used & {1, 3, 6} and used & {0, 2} and used & {4, 5, 7}  # all three kinds of pair ran
    if not ON_GPU:
        assert torch.equal(outs["triton"], outs["off"]) and torch.equal(outs["ptx"], outs["off"])


def test_fp4_bf16x2_is_exact_for_scale_bytes_0_and_1():
    """FP4 down matrices whose real blocks all have scale byte 0 or 1 (weights ~2^-127; the unbiased bf16x2
    construction gives byte 0 a zero scale) match the reference through every decode mode."""
    hidden, inter, experts, top_k, tokens = 256, 96, 4, 2, 3
    gen, w2, f4 = _setup(hidden, inter, experts, 1, 41, w2_slots=1, fp4_slots=2)
    m, lay = f4.layout.w2, f4.layout
    scales = f4.slots[:, lay.w2_scales_offset: lay.w2_scales_offset + m.scale_bytes].view(-1, m.n, m.blocks_per_row)
    scales[:, :, : m.k // 32] = torch.randint(0, 2, (scales.shape[0], m.n, m.k // 32), generator=gen,
                                              dtype=torch.uint8).to(DEVICE)
    f4.table[0, :2] = torch.tensor([0, 1], dtype=torch.int32)  # experts 2, 3 missing
    ids = torch.tensor([[0, 1], [1, 2], [0, 3]], dtype=torch.int32, device=DEVICE)
    wts = torch.rand(tokens, top_k, generator=gen).to(DEVICE)
    dtype = torch.bfloat16 if ON_GPU else torch.float32  # fp16 outputs cannot hold ~2^-120
    x = (3 * torch.randn(tokens, hidden, generator=gen)).to(DEVICE, dtype)
    ref, _, _ = moe_mm_ref(x, ids, wts, w2, f4, 0, act_dtype=dtype)
    assert 2.0**-126 < float(ref.abs().max()) < 2.0**-100
    for mode in ("off", "triton", "ptx"):
        out = _fp4_run(x, ids, wts, w2, f4, MissLog.allocate(4, DEVICE), mode)
        assert _rel_err(out.float() * 2.0**120, ref * 2.0**120) < (1e-2 if ON_GPU else 1e-4), mode  # exact rescale


def test_fp4_bf16x2_options():
    assert MoeWorkspace.allocate(2, 2, 4, 256, 64, torch.float32, DEVICE).fp4_bf16x2 == "ptx"  # the default
    with pytest.raises(ValueError):
        MoeWorkspace.allocate(2, 2, 4, 256, 64, torch.float32, DEVICE, block_tokens=2)
    with pytest.raises(ValueError):
        MoeWorkspace.allocate(2, 2, 4, 256, 64, torch.float32, DEVICE, fp4_bf16x2="fast")


# ---- v9: the down launch (32 rows / 4 warps from 64 BT = 1 pairs up, else the gate_up's 64 / 8) ----


@pytest.mark.parametrize("inter", [96, 1280])  # down K: one padded tile (WPS 16); five tiles
@pytest.mark.parametrize("dtype", DTYPES)
def test_down_launch_does_not_change_the_bytes(dtype, inter):
    """The fused op (W2, FP4 and missing experts, the SwiGLU clamp) gives the same bytes and miss log with the
    down GEMM launched as 64 rows / 8 warps and as 32 rows / 4 warps (the adopted choice from 64 pairs up)."""
    hidden, experts, top_k, tokens = 256, 6, 2, 3
    gen, w2, f4 = _setup(hidden, inter, experts, 1, 51, w2_slots=4, fp4_slots=1)
    w2.table[0, :4] = torch.tensor([1, 3, 0, 2], dtype=torch.int32)
    f4.table[0, 4] = 0  # expert 4 reads FP4, 5 is missing
    ids = torch.tensor([[0, 1], [2, 4], [5, 0]], dtype=torch.int32, device=DEVICE)
    wts = torch.rand(tokens, top_k, generator=gen).to(DEVICE)
    x = (3 * torch.randn(tokens, hidden, generator=gen)).to(DEVICE, dtype)
    ref, missing_pairs, missing = moe_mm_ref(x, ids, wts, w2, f4, 0, swiglu_limit=6.0, act_dtype=dtype)
    assert [missing_pairs, len(missing)] == [1, 1]
    outs = []
    for launch in (dict(down_block_n=64, down_num_warps=8), dict(down_block_n=32, down_num_warps=4)):
        misses = MissLog.allocate(4, DEVICE)
        outs.append(_run(x, ids, wts, w2, f4, 0, misses, limit=6.0, block_tokens=1, block_n=64, num_warps=8, **launch))
        assert not outs[-1].isnan().any() and misses.counts.tolist() == [1, 1], launch
        assert misses.entries[0].tolist() == [0, 5]
        assert _rel_err(outs[-1], ref) < TOLERANCE[dtype], launch
    assert torch.equal(outs[0], outs[1])


def test_default_block_size_by_pairs_per_expert():
    from tierstore.kernels.moe_mm import BT1_MAX_PAIRS_PER_EXPERT, default_block_tokens

    assert BT1_MAX_PAIRS_PER_EXPERT == 4
    # deepseek-v3 (E = 256, top-8) T = 1 / 32 / 64 / 128 / 129 / 512 / 513
    assert [default_block_tokens(8 * t, 256) for t in (1, 32, 64, 128, 129, 512, 513)] == [1, 1, 1, 1, 16, 16, 64]
    # mixtral-8x7b (E = 8, top-2) T = 8 / 16 / 17 / 64 / 65
    assert [default_block_tokens(2 * t, 8) for t in (8, 16, 17, 64, 65)] == [1, 1, 16, 16, 64]
    for pairs in (1, 31, 32, 33, 100, 128, 129, 5000):
        ws = MoeWorkspace.allocate(pairs, 1, 8, 256, 64, torch.float32, DEVICE)
        assert ws.block_tokens == default_block_tokens(pairs, 8)


def test_down_launch_choice():
    def launch(tokens, top_k, experts, **kw):
        ws = MoeWorkspace.allocate(tokens, top_k, experts, 256, 64, torch.float32, DEVICE, **kw)
        return ws.block_n, ws.num_warps, ws.down_block_n, ws.down_num_warps

    assert launch(1, 8, 256) == (64, 8, 64, 8)  # DeepSeek-V3 T = 1: 8 pairs
    assert launch(7, 8, 256) == (64, 8, 64, 8)  # 56 pairs
    assert launch(8, 8, 256) == (64, 8, 32, 4)  # T = 8: 64 pairs
    assert launch(32, 8, 256) == (64, 8, 32, 4)  # T = 32: 256 pairs, still BT = 1
    assert launch(128, 8, 256) == (64, 8, 32, 4)  # T = 128: 4 pairs per expert, still BT = 1
    assert launch(129, 8, 256) == (64, 4, 64, 4)  # BT = 16: the gate_up's launch
    assert launch(8, 8, 256, block_tokens=16) == (64, 4, 64, 4)
    assert launch(8, 8, 256, down_block_n=64, down_num_warps=8) == (64, 8, 64, 8)  # explicit wins
    assert launch(1, 8, 256, block_n=128, num_warps=4) == (128, 4, 128, 4)
