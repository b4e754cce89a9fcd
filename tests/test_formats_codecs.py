"""Checkpoint codecs (NVFP4, FP8 block, MXFP4): exact decode, documented-rounding encode, round trips.

References here are written independently of the library: e4m3 rounding searches the table of
all 256 e4m3 bytes, e2m1 snapping searches the 8 magnitudes, exactness is checked with Fractions.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore.errors import FormatError
from tierstore.formats import (
    E2M1_MAGNITUDES,
    dequantize_fp8_block,
    dequantize_mxfp4,
    dequantize_nvfp4,
    encode_fp8_block,
    encode_mxfp4,
    encode_nvfp4,
)

SETTINGS = settings(max_examples=40, deadline=None)
MAGS = np.array(E2M1_MAGNITUDES)


def e4m3_grid() -> tuple[np.ndarray, np.ndarray]:
    """Non-negative finite e4m3fn values and their byte codes, from the dtype itself."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # 0x7F is NaN
    return codes.view(torch.float8_e4m3fn).to(torch.float64).numpy(), codes.numpy()


E4M3_VALUES, E4M3_CODES = e4m3_grid()


def ref_round_e4m3(x: np.ndarray) -> np.ndarray:
    """Nearest e4m3 value by table search; ties to the even byte code; saturate at 448."""
    mag = np.minimum(np.abs(x), 448.0)
    dist = np.abs(mag[..., None] - E4M3_VALUES)  # [..., 127]
    best = dist.min(axis=-1, keepdims=True)
    tied = dist == best
    score = np.where(tied, E4M3_CODES % 2, 2)  # among tied candidates an even code (mantissa lsb 0) wins
    pick = np.argmin(score, axis=-1)
    return np.copysign(E4M3_VALUES[pick], x)


def ref_snap_e2m1(u: np.ndarray) -> np.ndarray:
    """Nibbles by grid search (first argmin over ascending magnitudes = ties to lower)."""
    idx = np.argmin(np.abs(np.abs(u)[..., None] - MAGS), axis=-1)
    return (idx | (np.signbit(u).astype(np.int64) << 3)).astype(np.uint8)


def ref_e2m1_value(nibbles: np.ndarray) -> np.ndarray:
    vals = MAGS[nibbles & 7]
    return np.where(nibbles & 8, -vals, vals)


def unpack(packed: torch.Tensor) -> np.ndarray:
    p = packed.numpy()
    out = np.empty((p.shape[0], p.shape[1] * 2), dtype=np.uint8)
    out[:, 0::2] = p & 15
    out[:, 1::2] = p >> 4
    return out


def pack(nibbles: np.ndarray) -> torch.Tensor:
    return torch.from_numpy((nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).astype(np.uint8))


def random_weight(seed: int, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    w = rng.standard_t(3, size=(n, k)) * np.exp2(rng.integers(-20, 5, size=(n, 1)))
    w[rng.random((n, k)) < 0.1] = 0.0
    w[rng.random((n, k)) < 0.05] = -0.0
    return torch.from_numpy(w).to(dtype)


DTYPES = st.sampled_from([torch.float64, torch.float32, torch.float16, torch.bfloat16])


# ---------------------------------------------------------------- NVFP4


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 6), kb=st.integers(1, 4), dtype=DTYPES,
       per_row=st.booleans())
def test_nvfp4_encode_matches_documented_rounding(seed, n, kb, dtype, per_row):
    w = random_weight(seed, n, 16 * kb, dtype)
    x = w.to(torch.float64).numpy()
    if per_row:
        rng = np.random.default_rng(seed + 1)
        given_s2 = torch.from_numpy(np.exp2(rng.uniform(-20, -5, size=n))).to(torch.float32)
        packed, scale, scale_2 = encode_nvfp4(w, given_s2)
        assert torch.equal(scale_2, given_s2)
        s2 = given_s2.to(torch.float64).numpy()[:, None]
    else:
        packed, scale, scale_2 = encode_nvfp4(w)
        amax = np.abs(x).max()
        expected = np.float32(amax / 2688.0) if amax > 0 else np.float32(1.0)
        assert scale_2.dtype == torch.float32 and scale_2.dim() == 0
        assert float(scale_2) == float(expected)
        s2 = np.float64(expected)
    block_amax = np.abs(x).reshape(n, kb, 16).max(axis=2)
    ref_scale = ref_round_e4m3(block_amax / (6.0 * s2))
    assert np.array_equal(scale.to(torch.float64).numpy(), ref_scale)
    divisor = np.repeat(ref_scale * s2, 16, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(divisor > 0, x / divisor, 0.0 * x)
    assert np.array_equal(unpack(packed), ref_snap_e2m1(ratio))
    decoded = dequantize_nvfp4(packed, scale, scale_2).numpy()
    assert np.array_equal(decoded, ref_e2m1_value(ref_snap_e2m1(ratio)) * divisor)


def canonical_nvfp4(rng: np.random.Generator, n: int, k: int):
    """Random NVFP4 whose every block holds a +-6, so re-encoding must give the same bytes."""
    nibbles = rng.integers(0, 16, size=(n, k)).astype(np.uint8)
    blocks = nibbles.reshape(n, k // 16, 16)
    blocks[:, :, 0] = rng.choice([7, 15], size=(n, k // 16))
    scale_codes = rng.integers(1, 0x7F, size=(n, k // 16)).astype(np.uint8)  # positive, not NaN
    scale = torch.from_numpy(scale_codes).view(torch.float8_e4m3fn)
    return pack(nibbles), scale


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 6), kb=st.integers(1, 4), per_row=st.booleans())
def test_nvfp4_encode_of_decode_is_identity(seed, n, kb, per_row):
    rng = np.random.default_rng(seed)
    packed, scale = canonical_nvfp4(rng, n, 16 * kb)
    exps = rng.integers(-30, 10, size=n if per_row else ())
    scale_2 = torch.from_numpy(np.asarray(np.exp2(exps) * rng.uniform(1, 2, size=np.shape(exps)))).float()
    decoded = dequantize_nvfp4(packed, scale, scale_2)
    re_packed, re_scale, re_scale_2 = encode_nvfp4(decoded, scale_2)
    assert torch.equal(re_packed, packed)
    assert torch.equal(re_scale.view(torch.uint8), scale.view(torch.uint8))
    assert torch.equal(re_scale_2, scale_2)


def test_nvfp4_decode_is_exact_with_per_row_scale_2():
    rng = np.random.default_rng(7)
    packed, scale = canonical_nvfp4(rng, 4, 32)
    scale_2 = torch.tensor([1.0e-3, 3.7e-5, 1.5, 2.0**-120], dtype=torch.float32)
    decoded = dequantize_nvfp4(packed, scale, scale_2).numpy()
    nib = unpack(packed)
    sc = scale.to(torch.float32).tolist()
    s2 = scale_2.tolist()
    for i in range(4):
        for j in range(32):
            exact = Fraction(float(ref_e2m1_value(nib[i, j]))) * Fraction(sc[i][j // 16]) * Fraction(s2[i])
            assert Fraction(float(decoded[i, j])) == exact
    # per-tensor scale_2 given as 0-d and as 1 element agree
    one = dequantize_nvfp4(packed, scale, torch.tensor(0.25))
    assert torch.equal(one, dequantize_nvfp4(packed, scale, torch.tensor([0.25])))


def test_nvfp4_rejects_bad_inputs():
    packed, scale = canonical_nvfp4(np.random.default_rng(0), 2, 32)
    s2 = torch.tensor(1.0)
    with pytest.raises(FormatError, match="scale: expected shape"):
        dequantize_nvfp4(packed, scale[:, :1], s2)
    with pytest.raises(FormatError, match="float8_e4m3fn"):
        dequantize_nvfp4(packed, scale.to(torch.float32), s2)
    with pytest.raises(FormatError, match="scale_2"):
        dequantize_nvfp4(packed, scale, torch.ones(3))
    with pytest.raises(FormatError, match="scale_2: expected dtype"):
        dequantize_nvfp4(packed, scale, torch.tensor(1.0, dtype=torch.float64))
    with pytest.raises(FormatError, match="packed: expected dtype"):
        dequantize_nvfp4(packed.to(torch.int32), scale, s2)
    with pytest.raises(FormatError, match="not a multiple of 16"):
        dequantize_nvfp4(packed[:, :4], scale, s2)
    with pytest.raises(FormatError, match="scale_2 must be positive"):
        encode_nvfp4(torch.ones(2, 16), -1.0)
    with pytest.raises(FormatError, match="non-finite"):
        encode_nvfp4(torch.tensor([[float("nan")] * 16]))


# ---------------------------------------------------------------- FP8 block

BLOCKS = st.tuples(st.integers(1, 5), st.integers(1, 40))


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 9), k=st.integers(1, 70), block=BLOCKS, dtype=DTYPES)
def test_fp8_encode_matches_documented_rounding(seed, n, k, block, dtype):
    w = random_weight(seed, n, k, dtype)
    x = w.to(torch.float64).numpy()
    weight, scale_inv = encode_fp8_block(w, block)
    bn, bk = block
    assert tuple(scale_inv.shape) == (math.ceil(n / bn), math.ceil(k / bk))
    ref_scale = np.ones(scale_inv.shape, dtype=np.float32)
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            amax = np.abs(x[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk]).max()
            if amax > 0:
                ref_scale[i, j] = max(np.float32(amax / 448.0), np.float32(2.0**-149))
    assert np.array_equal(scale_inv.numpy(), ref_scale)
    divisor = np.repeat(np.repeat(ref_scale.astype(np.float64), bn, 0), bk, 1)[:n, :k]
    ref_weight = ref_round_e4m3(x / divisor)
    assert np.array_equal(weight.to(torch.float64).numpy(), ref_weight)
    assert np.array_equal(np.signbit(weight.to(torch.float64).numpy()), np.signbit(ref_weight))
    assert np.array_equal(dequantize_fp8_block(weight, scale_inv, block).numpy(), ref_weight * divisor)


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 9), k=st.integers(1, 70), block=BLOCKS)
def test_fp8_encode_of_decode_is_identity(seed, n, k, block):
    rng = np.random.default_rng(seed)
    bn, bk = block
    codes = rng.integers(0, 256, size=(n, k)).astype(np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0  # no NaN
    for i in range(0, n, bn):
        for j in range(0, k, bk):
            codes[i, j] = rng.choice([0x7E, 0xFE])  # +-448 in every block
    weight = torch.from_numpy(codes).view(torch.float8_e4m3fn)
    shape = (math.ceil(n / bn), math.ceil(k / bk))
    scale_inv = torch.from_numpy(np.exp2(rng.uniform(-140, 100, size=shape))).float()
    decoded = dequantize_fp8_block(weight, scale_inv, block)
    re_weight, re_scale = encode_fp8_block(decoded, block)
    assert torch.equal(re_weight.view(torch.uint8), weight.view(torch.uint8))
    assert torch.equal(re_scale, scale_inv)


def test_fp8_default_block_and_bad_scale_shapes():
    w = random_weight(3, 130, 260, torch.float32)
    weight, scale_inv = encode_fp8_block(w)
    assert tuple(scale_inv.shape) == (2, 3)
    assert dequantize_fp8_block(weight, scale_inv).shape == (130, 260)
    with pytest.raises(FormatError, match=r"expected shape \(2, 3\), got \(2, 2\)"):
        dequantize_fp8_block(weight, scale_inv[:, :2])
    with pytest.raises(FormatError, match=r"block \(64, 128\)"):
        dequantize_fp8_block(weight, scale_inv, (64, 128))
    with pytest.raises(FormatError, match="block must be"):
        encode_fp8_block(w, (0, 128))
    with pytest.raises(FormatError, match="scale_inv: expected dtype"):
        dequantize_fp8_block(weight, scale_inv.double())


# ---------------------------------------------------------------- MXFP4


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 6), kb=st.integers(1, 3), dtype=DTYPES)
def test_mxfp4_encode_matches_documented_rounding(seed, n, kb, dtype):
    w = random_weight(seed, n, 32 * kb, dtype)
    x = w.to(torch.float64).numpy()
    packed, scale = encode_mxfp4(w)
    ref_bytes = np.zeros((n, kb), dtype=np.uint8)
    ref_unit = np.empty_like(x)
    for i in range(n):
        for b in range(kb):
            block = x[i, 32 * b:32 * (b + 1)]
            amax = np.abs(block).max()
            e = -127 if amax == 0 else max(-127, min(127, math.frexp(amax)[1] - 1 - 2))
            ref_bytes[i, b] = e + 127
            ref_unit[i, 32 * b:32 * (b + 1)] = np.ldexp(block, -e)
    assert np.array_equal(scale.numpy(), ref_bytes)
    assert np.array_equal(unpack(packed), ref_snap_e2m1(ref_unit))


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 6), kb=st.integers(1, 3))
def test_mxfp4_encode_of_decode_is_identity(seed, n, kb):
    rng = np.random.default_rng(seed)
    nibbles = rng.integers(0, 16, size=(n, 32 * kb)).astype(np.uint8)
    blocks = nibbles.reshape(n, kb, 32)
    blocks[:, :, 5] = rng.choice([6, 7, 14, 15], size=(n, kb))  # magnitude 4 or 6 in every block
    scale = rng.integers(0, 255, size=(n, kb)).astype(np.uint8)
    scale[0, 0] = 0
    blocks[0, 0, :] = rng.choice([0, 8], size=32)  # an all-zero block (both zero signs)
    packed = pack(nibbles)
    decoded = dequantize_mxfp4(packed, torch.from_numpy(scale))
    re_packed, re_scale = encode_mxfp4(decoded)
    assert torch.equal(re_packed, packed)
    assert np.array_equal(re_scale.numpy(), scale)


def test_mxfp4_decode_exact_and_e8m0_dtype():
    rng = np.random.default_rng(11)
    nibbles = rng.integers(0, 16, size=(3, 64)).astype(np.uint8)
    scale = torch.tensor([[0, 254], [127, 1], [200, 60]], dtype=torch.uint8)
    decoded = dequantize_mxfp4(pack(nibbles), scale).numpy()
    expected = ref_e2m1_value(nibbles) * np.exp2(np.repeat(scale.numpy().astype(np.float64) - 127, 32, axis=1))
    assert np.array_equal(decoded, expected)
    if hasattr(torch, "float8_e8m0fnu"):
        as_e8m0 = dequantize_mxfp4(pack(nibbles), scale.view(torch.float8_e8m0fnu))
        assert np.array_equal(as_e8m0.numpy(), expected)


def test_mxfp4_rejects_bad_inputs():
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    with pytest.raises(FormatError, match="255"):
        dequantize_mxfp4(packed, torch.full((2, 1), 255, dtype=torch.uint8))
    with pytest.raises(FormatError, match="scale_e8m0: expected shape"):
        dequantize_mxfp4(packed, torch.zeros(2, 2, dtype=torch.uint8))
    with pytest.raises(FormatError, match="uint8 or float8_e8m0fnu"):
        dequantize_mxfp4(packed, torch.zeros(2, 1, dtype=torch.int8))
    with pytest.raises(FormatError, match="not a multiple of 32"):
        dequantize_mxfp4(packed[:, :8], torch.zeros(2, 1, dtype=torch.uint8))
    with pytest.raises(FormatError, match="not a multiple of 32"):
        encode_mxfp4(torch.ones(2, 48))


# ---------------------------------------------------------------- ties

E4M3_MIDPOINTS = (E4M3_VALUES[1:] + E4M3_VALUES[:-1]) / 2
E2M1_MIDPOINTS = (MAGS[1:] + MAGS[:-1]) / 2


@SETTINGS
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 4))
def test_encoders_on_exact_ties(seed, n):
    """Values exactly on e4m3 / e2m1 midpoints: the documented tie rules must decide."""
    rng = np.random.default_rng(seed)
    signs = rng.choice([-1.0, 1.0], size=(n, 32))
    # FP8: a +-448 fixes scale_inv = 1, every other entry sits on an e4m3 midpoint.
    x = rng.choice(E4M3_MIDPOINTS, size=(n, 32)) * signs
    x[:, 0] = 448.0
    weight, scale_inv = encode_fp8_block(torch.from_numpy(x), (n, 32))
    assert float(scale_inv) == 1.0
    assert np.array_equal(weight.to(torch.float64).numpy(), ref_round_e4m3(x))
    # NVFP4: block amax = 6 * (an e4m3 midpoint) ties the block scale; with a +-6 block the
    # scale is 1 and entries on e2m1 midpoints tie the nibbles.
    amax = 6.0 * rng.choice(E4M3_MIDPOINTS[E4M3_MIDPOINTS > 2.0**-6], size=(n, 1))
    tied_scale = np.concatenate([np.full((n, 1), 1.0) * amax, np.zeros((n, 15))], axis=1)
    tied_nibbles = rng.choice(E2M1_MIDPOINTS, size=(n, 16)) * signs[:, :16]
    tied_nibbles[:, 3] = 6.0
    w = torch.from_numpy(np.concatenate([tied_scale, tied_nibbles], axis=1))
    packed, scale, _ = encode_nvfp4(w, 1.0)
    assert np.array_equal(scale.to(torch.float64).numpy()[:, 0], ref_round_e4m3(amax[:, 0] / 6.0))
    assert np.array_equal(scale.to(torch.float64).numpy()[:, 1], np.ones(n))
    assert np.array_equal(unpack(packed)[:, 16:], ref_snap_e2m1(tied_nibbles))


@pytest.mark.gpu
def test_codecs_on_cuda_match_cpu_bit_for_bit():
    w = random_weight(9, 64, 256, torch.float32)
    for encode, decode in [
        (encode_nvfp4, dequantize_nvfp4),
        (lambda x: encode_fp8_block(x, (16, 96)), lambda q, s: dequantize_fp8_block(q, s, (16, 96))),
        (encode_mxfp4, dequantize_mxfp4),
    ]:
        cpu = encode(w)
        gpu = encode(w.cuda())
        for a, b in zip(cpu, gpu):
            assert b.device.type == "cuda"
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a, (
                b.view(torch.uint8) if b.element_size() == 1 else b).cpu())
        assert torch.equal(decode(*cpu), decode(*gpu).cpu())
