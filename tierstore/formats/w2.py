"""The 2-bit base ("W2"): requantization to e2m1 nibbles, the {-4, -1, +1, +4} codes, and W2Tensor.

Per row and per block of 32 along K, the block gets one UE8M0 exponent and every weight one e2m1
nibble (the FP4 tier); the 2-bit code is a function of the nibble alone. See `quantize_w2`.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import torch

from tierstore.errors import FormatError
from tierstore.formats._checks import float_weight_to_f64, require_2d, require_dtype, require_multiple, require_shape
from tierstore.formats.fp_codecs import (
    E8M0_BIAS,
    E8M0_NAN,
    e2m1_values,
    e8m0_scales,
    e8m0_to_bytes,
    encode_e2m1,
    exact_pow2,
    floor_log2,
    pack_nibbles,
    unpack_nibbles,
)

W2_BLOCK = 32
W2_LEVELS = (-4.0, -1.0, 1.0, 4.0)
"""Unit-space level of 2-bit codes 0..3."""

W2_ABI_TAG = "tsym4-e8m0-rowk4le-v1"
"""Names the quantizer (sign-symmetric 4 levels, UE8M0 block-32 scales, round-to-nearest exponent)
and the packed layout (row-major; 4 codes per byte along K, k % 4 == 0 in bits 0-1; nibbles two
per byte, even k low; scales [N, K/32]). Any change to either bumps the version."""

REQUANT_ZERO_MODES = ("auto", "sign", "alt")
APPLIED_ZERO_MODES = ("sign", "alt", "verbatim")
ONE_SIGNED_ZERO_FRACTION = Fraction(1, 20)
"""`auto` alternates zero signs when the minority sign holds fewer than this share of exact zeros."""

# e2m1 nibble -> 2-bit code: magnitudes {0, .5, 1, 1.5, 2} -> +-1, {3, 4, 6} -> +-4; bit 3 = sign.
_NIBBLE_TO_CODE = (2, 2, 2, 2, 2, 3, 3, 3, 1, 1, 1, 1, 1, 0, 0, 0)
_SIGN_BIT = 0x8


def _smallest_double_above_6_sqrt2() -> float:
    candidate = math.sqrt(72.0)  # correctly rounded, so within one ulp of 6 * sqrt(2)
    if Fraction(candidate) ** 2 < 72:
        candidate = math.nextafter(candidate, math.inf)
    return candidate


_ROUNDING_THRESHOLD = _smallest_double_above_6_sqrt2()


def w2_block_exponents(w: torch.Tensor) -> torch.Tensor:
    """int64 [N, K/32] block exponents of a finite float64 [N, K]: round(log2(amax / 6)) in [-127, 127].

    `round` is to the nearest integer of the real-valued log2. It never ties: a tie would need
    amax = 6 * 2^(n + 1/2), which is irrational. It is computed exactly: with p = floor(log2(amax))
    the answer is p - 3 or p - 2, and it is p - 2 exactly when amax > 6 * sqrt(2) * 2^(p - 3), i.e.
    when amax >= (smallest float64 above 6 * sqrt(2)) * 2^(p - 3). All-zero blocks get -127.
    """
    n, k = w.shape
    amax = w.abs().reshape(n, k // W2_BLOCK, W2_BLOCK).amax(dim=2)  # [N, K/32]
    lower = (floor_log2(amax) - 3).clamp(-E8M0_BIAS - 1, E8M0_BIAS)  # zero -> -128
    rounds_up = amax >= _ROUNDING_THRESHOLD * exact_pow2(lower)
    return (lower + rounds_up.to(torch.int64)).clamp(-E8M0_BIAS, E8M0_BIAS)


def _check_zero_mode(zero_mode: str, allowed: tuple[str, ...]) -> None:
    if zero_mode not in allowed:
        raise FormatError(f"zero_mode must be one of {', '.join(allowed)}; got {zero_mode!r}")


def resolve_zero_mode(w: torch.Tensor, zero_mode: str, *, fast: bool = True) -> str:
    """`sign` or `alt` for float64 w: `auto` picks `alt` when w's exact zeros are one-signed."""
    _check_zero_mode(zero_mode, REQUANT_ZERO_MODES)
    if zero_mode != "auto":
        return zero_mode
    if fast and w.device.type == "cpu" and w.dtype in (torch.float64, torch.float32) and w.is_contiguous():
        from tierstore.formats._cpu_kernels import zero_counts_cpu

        num_zeros, num_negative = zero_counts_cpu(w.detach().numpy())
    else:
        zeros = w == 0
        num_zeros = int(zeros.sum())
        num_negative = int((zeros & torch.signbit(w)).sum())
    minority = min(num_negative, num_zeros - num_negative)
    is_one_signed = num_zeros > 0 and minority < ONE_SIGNED_ZERO_FRACTION * num_zeros
    return "alt" if is_one_signed else "sign"


def _alternate_zero_signs(nibbles: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Exact zeros get sign bit = k parity (odd k negative); other nibbles are unchanged."""
    odd_k = (torch.arange(nibbles.shape[1], device=nibbles.device) % 2).to(torch.uint8)  # [K]
    parity_zero = (odd_k * _SIGN_BIT).expand_as(nibbles)
    return torch.where(zeros, parity_zero, nibbles)


def quantize_w2(weight: torch.Tensor, *, zero_mode: str = "auto") -> "W2Tensor":
    """Requantize a float [N, K] weight (float64, or bf16/fp16/fp32 upcast exactly) to W2.

    K must be a multiple of 32; NaN/Inf are rejected. Per row and 32-block along K:
    exponent e = `w2_block_exponents`; u = w / 2^e (exact); nibble magnitude = nearest of
    {0, .5, 1, 1.5, 2, 3, 4, 6} (midpoints [.25, .75, 1.25, 1.75, 2.5, 3.5, 5], ties to the lower
    magnitude, above 6 -> 6); nibble sign = sign bit of u. Exact zeros (w == 0) then get their sign
    by `zero_mode`: `sign` keeps it, `alt` makes odd k negative, `auto` uses `alt` only when the
    minority sign of the tensor's exact zeros is < 5% of them. The W2Tensor records the mode
    applied (`sign` or `alt`).

    CPU tensors take a fused numba kernel (`_cpu_kernels`), other devices the torch ops of
    `_quantize_w2_torch`; both give the same bytes (tests/test_requant_cpu_fast.py).
    """
    _check_zero_mode(zero_mode, REQUANT_ZERO_MODES)
    fast = _quantize_w2_cpu(weight, zero_mode)
    if fast is not None:
        return fast
    return _quantize_w2_torch(weight, zero_mode=zero_mode)


def _quantize_w2_cpu(weight: torch.Tensor, zero_mode: str) -> "W2Tensor | None":
    """The numba path of `quantize_w2` for CPU tensors (byte-identical to `_quantize_w2_torch`);
    None when it does not apply (another device or dtype, bad shape, NaN/Inf), so the torch path
    runs and raises its errors."""
    if not isinstance(weight, torch.Tensor) or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if weight.dtype in (torch.float16, torch.bfloat16):
        weight = weight.to(torch.float32)  # exact, and float32 -> float64 inside the kernel is exact
    if weight.dtype not in (torch.float64, torch.float32) or weight.shape[1] % W2_BLOCK or weight.numel() == 0:
        return None
    from tierstore.formats._cpu_kernels import quantize_w2_cpu

    x = weight.detach().contiguous()
    applied = resolve_zero_mode(x, zero_mode)
    result = quantize_w2_cpu(x.numpy(), applied == "alt")
    if result is None:
        return None
    nibbles, scale_bytes = result
    return W2Tensor(torch.from_numpy(nibbles), torch.from_numpy(scale_bytes), applied)


def _quantize_w2_torch(weight: torch.Tensor, *, zero_mode: str = "auto") -> "W2Tensor":
    """`quantize_w2` in element-wise torch ops (any device; the CUDA path and the reference of
    the CPU kernels)."""
    _check_zero_mode(zero_mode, REQUANT_ZERO_MODES)
    w = float_weight_to_f64(weight, "weight")  # [N, K]
    require_multiple(w.shape[1], W2_BLOCK, "K (weight.shape[1])")
    exponent = w2_block_exponents(w)  # [N, K/32]
    unit = w / exact_pow2(exponent).repeat_interleave(W2_BLOCK, dim=1)  # [N, K]
    nibbles = encode_e2m1(unit)
    applied = resolve_zero_mode(w, zero_mode, fast=False)
    if applied == "alt":
        nibbles = _alternate_zero_signs(nibbles, w == 0)
    return W2Tensor(nibbles, (exponent + E8M0_BIAS).to(torch.uint8), applied)


def w2_from_mxfp4(packed: torch.Tensor, scale_e8m0: torch.Tensor) -> "W2Tensor":
    """W2 from an MXFP4 tensor, keeping its nibbles and scale bytes verbatim (no requantization)."""
    require_dtype(packed, torch.uint8, "packed")
    require_2d(packed, "packed")
    return W2Tensor.from_packed(packed, e8m0_to_bytes(scale_e8m0, "scale_e8m0"), "verbatim")


class W2Tensor:
    """Immutable W2 weight: e2m1 nibbles uint8 [N, K], UE8M0 scale bytes uint8 [N, K/32], zero mode.

    The 2-bit codes are derived from the nibbles, so one object serves both the base and the FP4
    tier. Accessors return the held tensors (or tensors derived from them), not defensive copies:
    do not modify them in place.
    """

    __slots__ = ("_nibbles", "_scale_bytes", "_zero_mode")

    def __init__(self, nibbles: torch.Tensor, scale_bytes: torch.Tensor, zero_mode: str) -> None:
        require_dtype(nibbles, torch.uint8, "nibbles")
        n, k = require_2d(nibbles, "nibbles")
        require_multiple(k, W2_BLOCK, "K (nibbles.shape[1])")
        require_dtype(scale_bytes, torch.uint8, "scale_bytes")
        require_shape(scale_bytes, (n, k // W2_BLOCK), "scale_bytes")
        _check_zero_mode(zero_mode, APPLIED_ZERO_MODES)
        if scale_bytes.device != nibbles.device:
            raise FormatError(f"nibbles on {nibbles.device} but scale_bytes on {scale_bytes.device}")
        if nibbles.numel() and int(nibbles.max()) > 0xF:
            raise FormatError(f"nibbles: values must be 0..15, got max {int(nibbles.max())}")
        num_nan = int((scale_bytes == E8M0_NAN).sum())
        if num_nan:
            raise FormatError(f"scale_bytes: {num_nan} bytes are 255 (UE8M0 NaN)")
        object.__setattr__(self, "_nibbles", nibbles)
        object.__setattr__(self, "_scale_bytes", scale_bytes)
        object.__setattr__(self, "_zero_mode", zero_mode)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"W2Tensor is immutable (tried to set {name!r})")

    def __repr__(self) -> str:
        n, k = self.shape
        return f"W2Tensor(shape=({n}, {k}), zero_mode={self._zero_mode!r}, device={self.device})"

    @classmethod
    def from_packed(cls, packed_nibbles: torch.Tensor, scale_bytes: torch.Tensor, zero_mode: str) -> "W2Tensor":
        """Rebuild from `packed_nibbles()` uint8 [N, K/2] and `scale_bytes()` uint8 [N, K/32]."""
        require_dtype(packed_nibbles, torch.uint8, "packed_nibbles")
        require_2d(packed_nibbles, "packed_nibbles")
        return cls(unpack_nibbles(packed_nibbles), scale_bytes, zero_mode)

    @property
    def shape(self) -> tuple[int, int]:
        return int(self._nibbles.shape[0]), int(self._nibbles.shape[1])

    @property
    def device(self) -> torch.device:
        return self._nibbles.device

    @property
    def zero_mode(self) -> str:
        """Zero-sign rule applied: `sign`, `alt`, or `verbatim` (MXFP4 nibbles kept as they were)."""
        return self._zero_mode

    @property
    def abi_tag(self) -> str:
        return W2_ABI_TAG

    def to(self, device: torch.device | str) -> "W2Tensor":
        return W2Tensor(self._nibbles.to(device), self._scale_bytes.to(device), self._zero_mode)

    def nibbles(self) -> torch.Tensor:
        """uint8 [N, K] e2m1 nibbles (bit 3 = sign): the FP4 tier."""
        return self._nibbles

    def scale_bytes(self) -> torch.Tensor:
        """uint8 [N, K/32] UE8M0 bytes (bias 127) shared by the base and the FP4 tier."""
        return self._scale_bytes

    def unpacked_codes(self) -> torch.Tensor:
        """uint8 [N, K] 2-bit codes 0..3 meaning -4, -1, +1, +4."""
        if self.device.type == "cpu":  # numpy indexes with the uint8 nibbles directly (no int64 copy)
            return torch.from_numpy(np.asarray(_NIBBLE_TO_CODE, dtype=np.uint8)[self._nibbles.numpy()])
        table = torch.tensor(_NIBBLE_TO_CODE, dtype=torch.uint8, device=self.device)
        return table[self._nibbles.long()]

    def packed_codes(self) -> torch.Tensor:
        """uint8 [N, K/4]: 4 codes per byte along K, little-endian (k % 4 == 0 in bits 0-1)."""
        n, k = self.shape
        codes = self.unpacked_codes().reshape(n, k // 4, 4)  # [N, K/4, 4]
        return codes[..., 0] | (codes[..., 1] << 2) | (codes[..., 2] << 4) | (codes[..., 3] << 6)

    def packed_nibbles(self) -> torch.Tensor:
        """uint8 [N, K/2]: two nibbles per byte, even k in the low nibble."""
        return pack_nibbles(self._nibbles)

    def _block_scales(self) -> torch.Tensor:
        return e8m0_scales(self._scale_bytes, "scale_bytes").repeat_interleave(W2_BLOCK, dim=1)  # [N, K]

    def dequantize(self) -> torch.Tensor:
        """float64 [N, K]: level(code) * 2^(byte - 127), the 2-bit base as served."""
        levels = torch.tensor(W2_LEVELS, dtype=torch.float64, device=self.device)
        return levels[self.unpacked_codes().long()] * self._block_scales()

    def dequantize_fp4(self) -> torch.Tensor:
        """float64 [N, K]: e2m1(nibble) * 2^(byte - 127), the FP4 tier as served."""
        return e2m1_values(self._nibbles) * self._block_scales()
