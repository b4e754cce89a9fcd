"""The numba CPU path of quantize_w2 and of the slot word packing against the previous (torch)
implementation, byte for byte, on fresh random inputs and edge cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tierstore.errors import FormatError
from tierstore.formats import W2Tensor, quantize_w2
from tierstore.formats.w2 import _ROUNDING_THRESHOLD, _quantize_w2_torch, resolve_zero_mode
from tierstore.kernels import layout as L

MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def edge_matrix(rng: np.random.Generator, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """Random [n, k] with rows of edge cases, representable in `dtype`."""
    info = torch.finfo(dtype)
    span = 8 if dtype == torch.float16 else 30  # keep the random rows finite in `dtype`
    x = rng.standard_normal((n, k)) * np.exp2(rng.integers(-span, span, size=(n, 1)))
    tiny, big = float(info.smallest_normal), float(info.max)
    e = rng.integers(-span, span - 4, size=k)
    rows = [
        np.where(rng.random(k) < 0.5, 0.0, -0.0),  # zeros of both signs
        rng.standard_normal(k) * tiny * 2.0 ** -rng.integers(1, 8, size=k),  # subnormals
        big * (1 - rng.random(k) * 2.0 ** -10) * rng.choice([-1, 1], k),  # near max
        np.repeat(rng.standard_normal(k // 32), 32),  # all-equal blocks
        np.repeat(-np.abs(rng.standard_normal(k // 32)), 32),
        rng.choice(MIDPOINTS + (0.0, 0.5, 6.0, 7.0), k) * np.exp2(e) * rng.choice([-1, 1], k),  # ties
        _ROUNDING_THRESHOLD * np.exp2(e) * rng.choice([1.0, 1 - 2.0 ** -52, 1 + 2.0 ** -52], k),  # 6 * sqrt(2)
        np.where(rng.random(k) < 0.3, 0.0, rng.standard_normal(k)),  # sparse, + zeros
        rng.standard_normal(k) * 1e-300,  # float64 near-underflow
    ]
    for i, row in enumerate(rows[: n]):
        x[i] = row
    return torch.from_numpy(x).to(dtype)


def assert_same(weight: torch.Tensor, zero_mode: str) -> None:
    new, old = quantize_w2(weight, zero_mode=zero_mode), _quantize_w2_torch(weight, zero_mode=zero_mode)
    assert new.zero_mode == old.zero_mode
    assert torch.equal(new.nibbles(), old.nibbles())
    assert torch.equal(new.scale_bytes(), old.scale_bytes())
    assert new.nibbles().dtype == old.nibbles().dtype and new.scale_bytes().dtype == old.scale_bytes().dtype


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("zero_mode", ["auto", "sign", "alt"])
def test_quantize_w2_cpu_equals_torch(dtype, zero_mode):
    rng = np.random.default_rng([20261129, len(str(dtype)), len(zero_mode)])
    for n, k in ((12, 96), (9, 256), (3, 32)):
        assert_same(edge_matrix(rng, n, k, dtype), zero_mode)
    assert_same(torch.zeros(4, 64, dtype=dtype), zero_mode)
    assert_same(-torch.zeros(4, 64, dtype=dtype), zero_mode)


@pytest.mark.parametrize("negative_share", [0.0, 0.04, 0.05, 0.5, 1.0])
def test_auto_zero_mode_variants(negative_share):
    """auto resolves to alt (one-signed zeros) or sign (mixed) exactly as before."""
    rng = np.random.default_rng([7, int(100 * negative_share)])
    x = rng.standard_normal((16, 64))
    zeros = rng.random(x.shape) < 0.4
    negative = rng.random(x.shape) < negative_share
    x[zeros] = np.where(negative[zeros], -0.0, 0.0)
    weight = torch.from_numpy(x)
    assert resolve_zero_mode(weight, "auto") == resolve_zero_mode(weight, "auto", fast=False)
    for dtype in (torch.float64, torch.float32):
        assert_same(weight.to(dtype), "auto")


def test_non_contiguous_and_sliced_inputs():
    weight = edge_matrix(np.random.default_rng(3), 10, 192, torch.float64)
    assert_same(weight.t().contiguous().t()[:, :128], "auto")
    assert_same(weight[::2, 32:160], "alt")


def test_errors_are_unchanged():
    bad = torch.ones(2, 64, dtype=torch.float64)
    bad[1, 40] = math.nan
    with pytest.raises(FormatError, match="non-finite"):
        quantize_w2(bad)
    bad[1, 40] = -math.inf
    with pytest.raises(FormatError, match="non-finite"):
        quantize_w2(bad.to(torch.float32))
    with pytest.raises(FormatError, match="multiple of 32"):
        quantize_w2(torch.ones(2, 48))
    with pytest.raises(FormatError, match="dtype"):
        quantize_w2(torch.ones(2, 64, dtype=torch.int32))


@pytest.mark.parametrize("k", [32, 96, 256, 512, 1024, 2016])
def test_pack_words_cpu_equals_torch(k):
    rng = np.random.default_rng([11, k])
    n = 5
    scales = torch.from_numpy(rng.integers(0, 241, (n, k // 32), dtype=np.uint8))
    codes = torch.from_numpy(rng.integers(0, 4, (n, k), dtype=np.uint8))
    nibbles = torch.from_numpy(rng.integers(0, 16, (n, k), dtype=np.uint8))
    for values, vpw, fast, old in ((codes, 16, L.pack_w2_words, L._pack_w2_words_torch),
                                   (nibbles, 8, L.pack_fp4_words, L._pack_fp4_words_torch)):
        m = L.MatrixLayout(n, k, vpw)
        for v in (values, torch.zeros_like(values), torch.full_like(values, int(values.max()))):
            new, ref = fast(v, scales), old(v, m)
            assert new.dtype == ref.dtype == torch.int32 and torch.equal(new, ref)


@pytest.mark.parametrize("tag", ["base", "fp4"])
def test_slot_rows_equal_torch_path(tag, monkeypatch):
    from tierstore.slot_codec import KERNEL_SLOT_CODEC, slot_layout

    hidden, inter = 256, 96
    rng = np.random.default_rng([5, len(tag)])
    in_range = lambda x: x.clamp(-1e30, 1e30)  # noqa: E731  (slot scale bytes stop at 240)
    w13 = quantize_w2(in_range(edge_matrix(rng, 2 * inter, hidden, torch.float64)))
    w2 = quantize_w2(in_range(edge_matrix(rng, hidden, inter, torch.float64)))
    layout = slot_layout(tag, hidden, inter)
    values = (lambda t: t.unpacked_codes()) if tag == "base" else (lambda t: t.nibbles())
    new = L.pack_slot(layout, values(w13), w13.scale_bytes(), values(w2), w2.scale_bytes())
    monkeypatch.setattr(L, "_pack_words_cpu", lambda values, m: None)  # force the torch path
    old = L.pack_slot(layout, values(w13), w13.scale_bytes(), values(w2), w2.scale_bytes())
    assert torch.equal(new, old)
    assert KERNEL_SLOT_CODEC.abi_tag  # the layout's identity is unchanged by the CPU path


def test_unpacked_codes_cpu_equals_table():
    from tierstore.formats.w2 import _NIBBLE_TO_CODE

    w2 = quantize_w2(edge_matrix(np.random.default_rng(9), 12, 128, torch.float64))
    table = torch.tensor(_NIBBLE_TO_CODE, dtype=torch.uint8)
    assert torch.equal(w2.unpacked_codes(), table[w2.nibbles().long()])
    sliced = W2Tensor(w2.nibbles()[:, 32:96], w2.scale_bytes()[:, 1:3], w2.zero_mode)  # a strided view
    assert torch.equal(sliced.unpacked_codes(), table[sliced.nibbles().long()])


def test_rank_shard_of_world_one_is_the_whole_matrix():
    from tierstore.io.pack_build import RankShard

    x = torch.arange(64 * 3, dtype=torch.float64).reshape(64, 3)
    assert torch.equal(RankShard(32).w13_rows(x), x)
    assert torch.equal(RankShard(32, 0, 1).w13_rows(x), torch.cat((x[:32], x[32:])))


def test_row_chunks_on_threads_equal_one_call(monkeypatch):
    """Large inputs run in row chunks on threads; forced here with small chunks and 3 workers."""
    from tierstore.kernels import _cpu_pack

    rng = np.random.default_rng(13)
    weight = edge_matrix(rng, 37, 256, torch.float64)
    codes = torch.from_numpy(rng.integers(0, 4, (37, 512), dtype=np.uint8))
    scales = torch.zeros(37, 16, dtype=torch.uint8)
    one = (quantize_w2(weight, zero_mode="alt"), L.pack_w2_words(codes, scales))
    monkeypatch.setattr(_cpu_pack, "_MIN_CHUNK_VALUES", 32)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    chunked = (quantize_w2(weight, zero_mode="alt"), L.pack_w2_words(codes, scales))
    assert torch.equal(one[0].nibbles(), chunked[0].nibbles())
    assert torch.equal(one[0].scale_bytes(), chunked[0].scale_bytes())
    assert torch.equal(one[1], chunked[1]) and torch.equal(one[1], L._pack_w2_words_torch(codes, L.MatrixLayout(37, 512, 16)))
    assert_same(weight, "alt")
    bad = weight.clone()
    bad[30, 7] = math.inf  # a NaN/Inf in a later chunk still falls back and raises
    with pytest.raises(FormatError, match="non-finite"):
        quantize_w2(bad)
