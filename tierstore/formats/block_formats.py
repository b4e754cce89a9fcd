"""Checkpoint weight formats: NVFP4 (modelopt), FP8 block-quant and MXFP4, decode and encode.

Decoders are exact: every value is a product of at most 2 + 4 + 24 significant bits, which
float64 (53 bits) holds without rounding. Encoders build quantized fixtures; each documents
its rounding, and decode(encode(x)) equals exactly that documented quantization of x.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tierstore.errors import FormatError
from tierstore.formats._checks import (
    float_weight_to_f64,
    require_2d,
    require_dtype,
    require_finite,
    require_multiple,
    require_shape,
)
from tierstore.formats.fp_codecs import (
    E2M1_MAX,
    E4M3_MAX,
    E8M0_BIAS,
    e2m1_values,
    e8m0_scales,
    e8m0_to_bytes,
    encode_e2m1,
    exact_pow2,
    floor_log2,
    pack_nibbles,
    round_to_e4m3,
    round_to_f32_positive,
    unpack_nibbles,
)

NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
DEFAULT_FP8_BLOCK = (128, 128)


def _expand_blocks(scale: torch.Tensor, block_rows: int, block_cols: int, n: int, k: int) -> torch.Tensor:
    """Repeat a per-block tensor [ceil(N/br), ceil(K/bc)] to [N, K] (edge blocks cropped)."""
    return scale.repeat_interleave(block_rows, dim=0)[:n].repeat_interleave(block_cols, dim=1)[:, :k]


def _scale_2_per_row(scale_2: torch.Tensor, n: int) -> torch.Tensor:
    """float64 [N, 1] from an NVFP4 scale_2 that is per tensor (0-d or 1 element) or per row [N]."""
    require_dtype(scale_2, torch.float32, "scale_2")
    if scale_2.numel() == 1 and scale_2.dim() <= 1:
        per_row = scale_2.reshape(1).expand(n)
    elif tuple(scale_2.shape) == (n,):
        per_row = scale_2
    else:
        raise FormatError(f"scale_2: expected a scalar or per-row shape ({n},), got {tuple(scale_2.shape)}")
    per_row = per_row.to(torch.float64)
    require_finite(per_row, "scale_2")
    return per_row.reshape(n, 1)


def _nibbles_from_packed(packed: torch.Tensor, block: int) -> tuple[torch.Tensor, int, int]:
    require_dtype(packed, torch.uint8, "packed")
    n, half_k = require_2d(packed, "packed")
    k = 2 * half_k
    require_multiple(k, block, "K (2 * packed.shape[1])")
    return unpack_nibbles(packed), n, k


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """modelopt NVFP4 -> float64 [N, K]: e2m1(nibble) * e4m3 block-16 scale * scale_2.

    packed: uint8 [N, K/2] (low nibble = even k); scale: float8_e4m3fn [N, K/16];
    scale_2: float32, per tensor (0-d or 1 element) or per row [N] (fused w13 halves).
    """
    nibbles, n, k = _nibbles_from_packed(packed, NVFP4_BLOCK)
    require_dtype(scale, torch.float8_e4m3fn, "scale")
    require_shape(scale, (n, k // NVFP4_BLOCK), "scale")
    block_scale = scale.to(torch.float64)  # [N, K/16]
    require_finite(block_scale, "scale")
    row_scale = _scale_2_per_row(scale_2, n)  # [N, 1]
    return e2m1_values(nibbles) * (block_scale * row_scale).repeat_interleave(NVFP4_BLOCK, dim=1)


def dequantize_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = DEFAULT_FP8_BLOCK
) -> torch.Tensor:
    """FP8 block-quant -> float64 [N, K]: e4m3 weight * float32 scale of its (block_n, block_k) block.

    scale_inv must have shape [ceil(N / block_n), ceil(K / block_k)]; edge blocks may be partial.
    """
    block_rows, block_cols = _check_block(block)
    require_dtype(weight, torch.float8_e4m3fn, "weight")
    n, k = require_2d(weight, "weight")
    require_dtype(scale_inv, torch.float32, "scale_inv")
    require_shape(scale_inv, (-(-n // block_rows), -(-k // block_cols)), f"scale_inv for block {block}")
    values = weight.to(torch.float64)  # [N, K]
    require_finite(values, "weight")
    block_scale = scale_inv.to(torch.float64)
    require_finite(block_scale, "scale_inv")
    return values * _expand_blocks(block_scale, block_rows, block_cols, n, k)


def dequantize_mxfp4(packed: torch.Tensor, scale_e8m0: torch.Tensor) -> torch.Tensor:
    """MXFP4 -> float64 [N, K]: e2m1(nibble) * 2**(byte - 127) per block of 32 along K.

    packed: uint8 [N, K/2] (low nibble = even k); scale_e8m0: uint8 (or float8_e8m0fnu) [N, K/32].
    """
    nibbles, n, k = _nibbles_from_packed(packed, MXFP4_BLOCK)
    scale_bytes = e8m0_to_bytes(scale_e8m0, "scale_e8m0")
    require_shape(scale_bytes, (n, k // MXFP4_BLOCK), "scale_e8m0")
    block_scale = e8m0_scales(scale_bytes, "scale_e8m0")  # [N, K/32]
    return e2m1_values(nibbles) * block_scale.repeat_interleave(MXFP4_BLOCK, dim=1)


def _check_block(block: tuple[int, int]) -> tuple[int, int]:
    if len(block) != 2 or any(int(b) != b or b <= 0 for b in block):
        raise FormatError(f"block must be two positive integers (block_n, block_k), got {block}")
    return int(block[0]), int(block[1])


def _block_amax(w: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """float64 [ceil(N/br), ceil(K/bc)] max |w| per block (edge blocks padded with zeros)."""
    n, k = w.shape
    padded = F.pad(w.abs(), (0, -k % block_cols, 0, -n % block_rows))
    rows, cols = padded.shape
    return padded.reshape(rows // block_rows, block_rows, cols // block_cols, block_cols).amax(dim=(1, 3))


def encode_nvfp4(
    w: torch.Tensor, scale_2: torch.Tensor | float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a float [N, K] (K % 16 == 0) to modelopt NVFP4 -> (packed, scale, scale_2).

    Rounding, in order (all in float64 unless stated):
    - scale_2 (if not given) = float32 RNE of amax(|w|) / 2688 (6 * 448), raised to the smallest
      positive float32 if that is 0 (an all-zero tensor gives 1.0). A given scale_2 may be a
      Python float, a scalar tensor or a per-row [N] tensor; it is used as float32.
    - block scale = e4m3 RNE (ties to even, saturating at 448) of amax(|w_block16|) / (6 * scale_2).
    - nibble = nearest e2m1 of w / (block scale * scale_2) (one float64 rounding for the division),
      ties to the lower magnitude, above 6 saturating to 6, sign bit = sign bit of w. A block whose
      scale is 0 gets magnitude 0 (signed zero).
    """
    x = float_weight_to_f64(w, "w")
    n, k = x.shape
    require_multiple(k, NVFP4_BLOCK, "K")
    scale_2_f32 = _resolve_scale_2(x, scale_2, n)
    row_scale = _scale_2_per_row(scale_2_f32, n)  # [N, 1]
    block_amax = x.abs().reshape(n, k // NVFP4_BLOCK, NVFP4_BLOCK).amax(dim=2)  # [N, K/16]
    block_scale = round_to_e4m3(block_amax / (E2M1_MAX * row_scale))  # [N, K/16]
    divisor = (block_scale * row_scale).repeat_interleave(NVFP4_BLOCK, dim=1)  # [N, K]
    ratio = torch.where(divisor > 0, x / torch.where(divisor > 0, divisor, 1.0), 0.0 * x)
    return pack_nibbles(encode_e2m1(ratio)), block_scale.to(torch.float8_e4m3fn), scale_2_f32


def _resolve_scale_2(x: torch.Tensor, scale_2: torch.Tensor | float | None, n: int) -> torch.Tensor:
    if scale_2 is None:
        amax = x.abs().amax() if x.numel() else x.new_zeros(())
        if amax == 0:
            return torch.ones((), dtype=torch.float32, device=x.device)
        return round_to_f32_positive(amax / (E2M1_MAX * E4M3_MAX))
    given = torch.as_tensor(scale_2, dtype=torch.float32, device=x.device)
    if not bool(torch.all(given > 0)) or not bool(torch.all(torch.isfinite(given))):
        raise FormatError(f"scale_2 must be positive and finite, got {given.tolist()}")
    _scale_2_per_row(given, n)
    return given


def encode_fp8_block(
    w: torch.Tensor, block: tuple[int, int] = DEFAULT_FP8_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float [N, K] to FP8 block-quant -> (weight float8_e4m3fn [N, K], scale_inv float32).

    Rounding: scale_inv per (block_n, block_k) block = float32 RNE of amax(|w_block|) / 448, raised to
    the smallest positive float32 if that is 0 (all-zero blocks get 1.0); weight = e4m3 RNE (ties
    to even, saturating at 448) of the float64 quotient w / scale_inv.
    """
    block_rows, block_cols = _check_block(block)
    x = float_weight_to_f64(w, "w")
    n, k = x.shape
    amax = _block_amax(x, block_rows, block_cols)  # [ceil(N/bn), ceil(K/bk)]
    scale_inv = torch.where(amax > 0, round_to_f32_positive(amax / E4M3_MAX), 1.0).to(torch.float32)
    divisor = _expand_blocks(scale_inv.to(torch.float64), block_rows, block_cols, n, k)  # [N, K]
    return round_to_e4m3(x / divisor).to(torch.float8_e4m3fn), scale_inv


def encode_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float [N, K] (K % 32 == 0) to MXFP4 -> (packed uint8 [N, K/2], scale uint8 [N, K/32]).

    Rounding (the OCP MX rule): block exponent = floor(log2(amax(|w_block32|))) - 2, clamped to
    [-127, 127], all-zero blocks -127 (byte 0); byte = exponent + 127; nibble = nearest e2m1 of
    w / 2**exponent (exact), ties to the lower magnitude, above 6 saturating to 6, sign bit kept.
    """
    x = float_weight_to_f64(w, "w")
    n, k = x.shape
    require_multiple(k, MXFP4_BLOCK, "K")
    block_amax = x.abs().reshape(n, k // MXFP4_BLOCK, MXFP4_BLOCK).amax(dim=2)  # [N, K/32]
    exponent = (floor_log2(block_amax) - 2).clamp(-E8M0_BIAS, E8M0_BIAS)  # zero/subnormal -> -127
    unit = x / exact_pow2(exponent).repeat_interleave(MXFP4_BLOCK, dim=1)  # [N, K]
    return pack_nibbles(encode_e2m1(unit)), (exponent + E8M0_BIAS).to(torch.uint8)
