"""quantize_w2 / W2Tensor against an independent float64 reference written here.

The reference finds each block exponent with exact rational arithmetic (no log2 rounding),
snaps by explicit grid search, and derives codes from levels rather than a nibble table.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from tierstore.errors import FormatError
from tierstore.formats import (
    E2M1_MAGNITUDES,
    W2_ABI_TAG,
    W2_LEVELS,
    W2Tensor,
    dequantize_mxfp4,
    quantize_w2,
    w2_from_mxfp4,
)

SETTINGS = settings(max_examples=60, deadline=None)
MAGS = np.array(E2M1_MAGNITUDES)


def ref_exponent(amax: float) -> int:
    """Integer e nearest to log2(amax / 6), found by exact comparison (amax/6)^2 vs 2^(2e +- 1)."""
    if amax == 0:
        return -127
    r2 = (Fraction(amax) / 6) ** 2
    e = math.floor(math.log2(amax)) - 3
    while r2 > Fraction(2) ** (2 * e + 1):
        e += 1
    while r2 < Fraction(2) ** (2 * e - 1):
        e -= 1
    return max(-127, min(127, e))


def ref_quantize(x: np.ndarray, zero_mode: str):
    """(nibbles, scale bytes, codes, applied mode) of float64 x [N, K] per the W2 rule."""
    n, k = x.shape
    nibbles = np.zeros((n, k), dtype=np.uint8)
    scale_bytes = np.zeros((n, k // 32), dtype=np.uint8)
    for i in range(n):
        for b in range(k // 32):
            block = x[i, 32 * b:32 * (b + 1)]
            e = ref_exponent(float(np.abs(block).max()))
            scale_bytes[i, b] = e + 127
            u = np.ldexp(block, -e)
            saturated = np.minimum(np.abs(u), 8.0)  # beyond 8 the float distances to the grid all round equal
            magnitude_index = np.argmin(np.abs(saturated[:, None] - MAGS), axis=1)  # first min = lower
            nibbles[i, 32 * b:32 * (b + 1)] = magnitude_index + 8 * np.signbit(u)
    zeros = x == 0
    negative_zeros = int(np.sum(zeros & np.signbit(x)))
    positive_zeros = int(np.sum(zeros)) - negative_zeros
    applied = zero_mode
    if zero_mode == "auto":
        one_signed = (positive_zeros + negative_zeros) > 0 and 20 * min(positive_zeros, negative_zeros) < (
            positive_zeros + negative_zeros
        )
        applied = "alt" if one_signed else "sign"
    if applied == "alt":
        column_sign = (np.arange(k) % 2 == 1).astype(np.uint8) * 8
        nibbles = np.where(zeros, np.broadcast_to(column_sign, (n, k)), nibbles).astype(np.uint8)
    magnitude = MAGS[nibbles & 7]
    level = np.where(magnitude > 2.5, 4.0, 1.0) * np.where(nibbles >= 8, -1.0, 1.0)
    codes = np.array([W2_LEVELS.index(v) for v in level.ravel()], dtype=np.uint8).reshape(n, k)
    return nibbles, scale_bytes, codes, applied


def assert_matches_reference(weight: torch.Tensor, zero_mode: str) -> W2Tensor:
    x = weight.to(torch.float64).numpy()
    q = quantize_w2(weight, zero_mode=zero_mode)
    nibbles, scale_bytes, codes, applied = ref_quantize(x, zero_mode)
    assert q.zero_mode == applied
    assert np.array_equal(q.nibbles().numpy(), nibbles)
    assert np.array_equal(q.scale_bytes().numpy(), scale_bytes)
    assert np.array_equal(q.unpacked_codes().numpy(), codes)
    block_scale = np.exp2(np.repeat(scale_bytes.astype(np.float64) - 127, 32, axis=1))
    levels = np.array(W2_LEVELS)[codes]
    assert np.array_equal(q.dequantize().numpy(), levels * block_scale)
    fp4 = MAGS[nibbles & 7] * np.where(nibbles >= 8, -1.0, 1.0)
    assert np.array_equal(q.dequantize_fp4().numpy(), fp4 * block_scale)
    return q


ZERO_MODES = st.sampled_from(["auto", "sign", "alt"])
SHAPES = st.tuples(st.integers(1, 3), st.integers(1, 3).map(lambda b: 32 * b))


@SETTINGS
@given(data=st.data(), shape=SHAPES, width=st.sampled_from([16, 32, 64]), zero_mode=ZERO_MODES)
def test_arbitrary_floats_match_reference(data, shape, width, zero_mode):
    """Any finite float: +-0, subnormals, values near the dtype's max, in fp16/fp32/fp64."""
    dtype = {16: np.float16, 32: np.float32, 64: np.float64}[width]
    x = data.draw(arrays(dtype, shape, elements=st.floats(width=width, allow_nan=False, allow_infinity=False)))
    assert_matches_reference(torch.from_numpy(x), zero_mode)


@SETTINGS
@given(data=st.data(), shape=SHAPES, zero_mode=ZERO_MODES)
def test_bfloat16_inputs_match_reference(data, shape, zero_mode):
    x = data.draw(arrays(np.float32, shape, elements=st.floats(-(2.0**127), 2.0**127, width=32)))
    weight = torch.from_numpy(x).to(torch.bfloat16)
    assume(bool(torch.isfinite(weight).all()))
    assert_matches_reference(weight, zero_mode)


SMALLEST_ABOVE_6_SQRT2 = math.sqrt(72.0) if Fraction(math.sqrt(72.0)) ** 2 > 72 else math.nextafter(math.sqrt(72.0), 9)


@st.composite
def tricky_blocks(draw):
    """Blocks built to hit the rule's edges: exponent rounding thresholds, midpoint ties, u > 6,
    all-zero blocks, zeros of one or both signs, tiny and huge exponents."""
    rows, num_blocks = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    x = np.zeros((rows, 32 * num_blocks))
    for i in range(rows):
        for b in range(num_blocks):
            kind = draw(st.sampled_from(["threshold", "midpoints", "mixed", "zeros", "signed_zeros"]))
            e = draw(st.integers(-135, 130))
            block = np.zeros(32)
            if kind == "threshold":  # amax on either side of 6 * sqrt(2) * 2^e
                top = SMALLEST_ABOVE_6_SQRT2 if draw(st.booleans()) else math.nextafter(SMALLEST_ABOVE_6_SQRT2, 0)
                block = rng.uniform(-1, 1, 32) * top
                block[rng.integers(32)] = top * rng.choice([-1, 1])
            elif kind == "midpoints":  # amax = 6 * 2^e, others exactly on e2m1 midpoints
                block = rng.choice(np.concatenate([(MAGS[1:] + MAGS[:-1]) / 2, MAGS]), 32)
                block *= rng.choice([-1, 1], 32)
                block[rng.integers(32)] = 6.0
            elif kind == "mixed":
                block = rng.standard_t(2, 32)
                block[rng.random(32) < 0.3] = 0.0
            elif kind == "signed_zeros":
                block = rng.choice([0.0, -0.0], 32)
            x[i, 32 * b:32 * (b + 1)] = np.ldexp(block, e)
    one_signed = draw(st.sampled_from([None, 0.0, -0.0]))
    if one_signed is not None:
        x[x == 0] = one_signed
    return x


@SETTINGS
@given(x=tricky_blocks(), zero_mode=ZERO_MODES, dtype=st.sampled_from([torch.float64, torch.float32]))
def test_tricky_blocks_match_reference(x, zero_mode, dtype):
    weight = torch.from_numpy(x).to(dtype)
    assume(bool(torch.isfinite(weight).all()))
    assert_matches_reference(weight, zero_mode)


def test_exponent_rounds_at_six_root_two():
    """amax just above / below 6*sqrt(2)*2^e rounds up / down; 6*2^e gives exactly e."""
    above = SMALLEST_ABOVE_6_SQRT2
    below = math.nextafter(above, 0)
    x = torch.zeros(4, 32, dtype=torch.float64)
    x[0, 0], x[1, 0], x[2, 0], x[3, 0] = above, below, 6.0 * 2.0**-10, -(2.0**200)
    assert quantize_w2(x).scale_bytes()[:, 0].tolist() == [128, 127, 117, 254]


def test_zero_modes():
    base = torch.randn(4, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    zero_mask = torch.rand(4, 64, generator=torch.Generator().manual_seed(1)) < 0.25
    positive = torch.where(zero_mask, 0.0, base)
    odd = torch.arange(64) % 2 == 1
    q_auto = quantize_w2(positive)
    assert q_auto.zero_mode == "alt"
    nibbles = q_auto.nibbles()
    assert torch.equal(nibbles[zero_mask & odd], torch.full_like(nibbles[zero_mask & odd], 8))
    assert torch.equal(nibbles[zero_mask & ~odd], torch.zeros_like(nibbles[zero_mask & ~odd]))
    assert torch.equal(nibbles[~zero_mask], quantize_w2(positive, zero_mode="sign").nibbles()[~zero_mask])
    assert bool((quantize_w2(positive, zero_mode="sign").nibbles()[zero_mask] == 0).all())
    mixed = torch.where(zero_mask & (torch.arange(64) < 32), -0.0, positive)
    assert quantize_w2(mixed).zero_mode == "sign"
    assert quantize_w2(mixed, zero_mode="alt").zero_mode == "alt"
    assert quantize_w2(base).zero_mode == "sign"  # no exact zeros


def test_auto_threshold_is_five_percent_exact():
    x = torch.ones(1, 128, dtype=torch.float64)
    x[0, :100] = 0.0
    x[0, :4] = -0.0  # 4 of 100 negative: minority < 5% -> alt
    assert quantize_w2(x).zero_mode == "alt"
    x[0, 4] = -0.0  # 5 of 100: not below 5% -> sign
    assert quantize_w2(x).zero_mode == "sign"


def test_packed_layouts_are_consistent():
    w = torch.randn(3, 96, generator=torch.Generator().manual_seed(2))
    q = quantize_w2(w)
    codes = q.unpacked_codes()
    packed = q.packed_codes()
    assert packed.shape == (3, 24) and packed.dtype == torch.uint8
    for j in range(4):
        assert torch.equal((packed >> (2 * j)) & 3, codes[:, j::4])
    packed_nibbles = q.packed_nibbles()
    assert packed_nibbles.shape == (3, 48)
    assert torch.equal(packed_nibbles & 15, q.nibbles()[:, 0::2])
    assert torch.equal(packed_nibbles >> 4, q.nibbles()[:, 1::2])
    rebuilt = W2Tensor.from_packed(packed_nibbles, q.scale_bytes(), q.zero_mode)
    assert torch.equal(rebuilt.nibbles(), q.nibbles()) and torch.equal(rebuilt.scale_bytes(), q.scale_bytes())
    assert rebuilt.zero_mode == q.zero_mode and rebuilt.shape == (3, 96)
    assert q.abi_tag == W2_ABI_TAG
    assert torch.equal(q.to("cpu").dequantize(), q.dequantize())


def test_w2_from_mxfp4_is_verbatim():
    rng = np.random.default_rng(5)
    nibbles = rng.integers(0, 16, size=(2, 64)).astype(np.uint8)
    packed = torch.from_numpy(nibbles[:, 0::2] | (nibbles[:, 1::2] << 4))
    scale = torch.from_numpy(rng.integers(0, 255, size=(2, 2)).astype(np.uint8))
    q = w2_from_mxfp4(packed, scale)
    assert q.zero_mode == "verbatim"
    assert np.array_equal(q.nibbles().numpy(), nibbles)
    assert torch.equal(q.scale_bytes(), scale)
    assert torch.equal(q.packed_nibbles(), packed)
    assert torch.equal(q.dequantize_fp4(), dequantize_mxfp4(packed, scale))


def test_rejects_bad_input():
    w = torch.randn(2, 64)
    w[1, 5] = float("nan")
    w[0, 7] = float("inf")
    w[1, 9] = float("-inf")
    with pytest.raises(FormatError, match=r"3 non-finite values.*first at index \[0, 7\]"):
        quantize_w2(w)
    with pytest.raises(FormatError, match="not a multiple of 32"):
        quantize_w2(torch.randn(2, 48))
    with pytest.raises(FormatError, match="2-D"):
        quantize_w2(torch.randn(64))
    with pytest.raises(FormatError, match="dtype torch.int32"):
        quantize_w2(torch.ones(2, 32, dtype=torch.int32))
    with pytest.raises(FormatError, match="zero_mode must be one of"):
        quantize_w2(torch.randn(2, 32), zero_mode="balanced")
    with pytest.raises(FormatError, match="scale_bytes: expected shape"):
        W2Tensor(torch.zeros(2, 64, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8), "sign")
    with pytest.raises(FormatError, match="values must be 0..15"):
        W2Tensor(torch.full((1, 32), 16, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.uint8), "sign")
    with pytest.raises(FormatError, match="255"):
        W2Tensor(torch.zeros(1, 32, dtype=torch.uint8), torch.full((1, 1), 255, dtype=torch.uint8), "sign")
    with pytest.raises(FormatError, match="zero_mode"):
        W2Tensor(torch.zeros(1, 32, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.uint8), "auto")
    q = quantize_w2(torch.randn(1, 32))
    with pytest.raises(AttributeError, match="immutable"):
        q.zero_mode = "alt"


@pytest.mark.gpu
def test_cuda_matches_cpu_bit_for_bit():
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    w[w.abs() < 0.05] = 0.0
    cpu = quantize_w2(w)
    gpu = quantize_w2(w.cuda())
    assert gpu.device.type == "cuda"
    assert torch.equal(gpu.nibbles().cpu(), cpu.nibbles())
    assert torch.equal(gpu.scale_bytes().cpu(), cpu.scale_bytes())
    assert torch.equal(gpu.packed_codes().cpu(), cpu.packed_codes())
    assert torch.equal(gpu.dequantize().cpu(), cpu.dequantize())
