"""Element codecs shared by every format: e2m1 nibbles, e4m3 rounding, exact powers of two.

All arithmetic is float64 or integer and uses only element-wise torch ops, so results are
bit-identical on CPU and CUDA.
"""

from __future__ import annotations

import torch

from tierstore.errors import FormatError

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""e2m1 magnitude for nibble bits 0-2; bit 3 of a nibble is the sign."""

E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
"""Midpoints between consecutive e2m1 magnitudes; a value on a midpoint snaps to the lower one."""

E2M1_MAX = 6.0
E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 255

_F64_MANTISSA_BITS = 52
_F64_EXPONENT_BIAS = 1023
_F64_EXPONENT_MASK = 0x7FF
_SMALLEST_F32_SUBNORMAL = 2.0**-149


def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    """float64 [16]: the signed value of every nibble (8 = -0.0)."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64, device=device)
    return torch.cat([magnitudes, -magnitudes])


def e2m1_values(nibbles: torch.Tensor) -> torch.Tensor:
    """Decode uint8 nibbles (0..15) to float64 values of the same shape."""
    return e2m1_table(nibbles.device)[nibbles.long()]


def snap_e2m1_magnitude(magnitude: torch.Tensor) -> torch.Tensor:
    """Index (uint8, 0..7) of the nearest e2m1 magnitude to float64 `magnitude` >= 0.

    Ties go to the lower magnitude; anything above 5.0 (including values above 6) snaps to 6.
    """
    midpoints = torch.tensor(E2M1_MIDPOINTS, dtype=torch.float64, device=magnitude.device)
    # bucketize(right=False) counts the midpoints strictly below each value.
    return torch.bucketize(magnitude, midpoints, right=False).to(torch.uint8)


def encode_e2m1(value: torch.Tensor) -> torch.Tensor:
    """Nibbles (uint8) of float64 `value`: nearest magnitude (ties lower, saturating at 6), sign bit kept."""
    sign_bit = torch.signbit(value).to(torch.uint8) << 3
    return snap_e2m1_magnitude(value.abs()) | sign_bit


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> uint8 [N, K]; the low nibble of each byte is the even k."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], packed.shape[1] * 2)


def pack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] (values 0..15, K even) -> uint8 [N, K/2]; even k goes to the low nibble."""
    pairs = nibbles.reshape(nibbles.shape[0], nibbles.shape[1] // 2, 2)  # [N, K/2, 2]
    return pairs[..., 0] | (pairs[..., 1] << 4)


def exact_pow2(exponent: torch.Tensor) -> torch.Tensor:
    """float64 2**exponent, built from the bit pattern (exact); exponent must lie in [-1022, 1023]."""
    biased = exponent.to(torch.int64) + _F64_EXPONENT_BIAS
    return (biased << _F64_MANTISSA_BITS).view(torch.float64)


def floor_log2(x: torch.Tensor) -> torch.Tensor:
    """int64 floor(log2(x)) of float64 x > 0 read from the exponent bits.

    Exact for normal numbers; zero and subnormals give -1023, callers clamp far above that.
    """
    biased = (x.view(torch.int64) >> _F64_MANTISSA_BITS) & _F64_EXPONENT_MASK
    return biased - _F64_EXPONENT_BIAS


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """float64 x rounded to the nearest float8_e4m3fn value, ties to even, saturating at +-448.

    Returns float64 holding e4m3-representable values (sign of zero kept), so converting the
    result with `.to(torch.float8_e4m3fn)` is exact whatever path torch's conversion takes.
    """
    magnitude = x.abs().clamp(max=E4M3_MAX)
    # e4m3fn: 3 mantissa bits, smallest normal exponent -6, so the quantum is 2^(max(p, -6) - 3).
    quantum_exponent = floor_log2(magnitude).clamp(min=-6) - 3
    quantum = exact_pow2(quantum_exponent)
    rounded = torch.round(magnitude / quantum) * quantum  # torch.round is half-to-even
    return torch.copysign(rounded, x)


def round_to_f32_positive(x: torch.Tensor) -> torch.Tensor:
    """float32 RNE of float64 x >= 0, raised to the smallest positive float32 if it would be 0."""
    return x.to(torch.float32).clamp(min=_SMALLEST_F32_SUBNORMAL)


def e8m0_to_bytes(scale: torch.Tensor, name: str) -> torch.Tensor:
    """View a UE8M0 scale tensor (uint8, or torch.float8_e8m0fnu where torch has it) as uint8."""
    e8m0_dtype = getattr(torch, "float8_e8m0fnu", None)
    if e8m0_dtype is not None and scale.dtype == e8m0_dtype:
        return scale.view(torch.uint8)
    if scale.dtype != torch.uint8:
        raise FormatError(f"{name}: UE8M0 scales must be uint8 or float8_e8m0fnu, got {scale.dtype}")
    return scale


def e8m0_scales(scale_bytes: torch.Tensor, name: str) -> torch.Tensor:
    """float64 2**(byte - 127) of UE8M0 bytes; the NaN byte 255 is rejected."""
    num_nan = int((scale_bytes == E8M0_NAN).sum())
    if num_nan:
        raise FormatError(f"{name}: {num_nan} UE8M0 scale bytes are 255 (NaN)")
    return exact_pow2(scale_bytes.to(torch.int64) - E8M0_BIAS)
