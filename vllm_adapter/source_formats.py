"""Checkpoint expert formats the adapter loads: which parameters vLLM's loader fills for each, and
how one expert's loaded bytes become W2 (exact float64 dequantization, then requantization).

Parameter names follow vLLM's FusedMoE convention (`w13_*` holds gate rows [0, I) then up rows
[I, 2I); `w2_*` holds down), so vLLM's own weight loader routes checkpoint tensors into them and
splits them for tensor parallelism. This module does not import vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tierstore.errors import ConfigError
from tierstore.formats import (
    W2Tensor,
    dequantize_fp8_block,
    dequantize_mxfp4,
    dequantize_nvfp4,
    quantize_w2,
    w2_from_mxfp4,
)

SOURCE_FORMATS = ("bf16", "fp8_block", "nvfp4", "mxfp4")
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32
W2_BLOCK = 32


@dataclass(frozen=True)
class SourceFormat:
    """The checkpoint's expert format, as declared by its quantization config."""

    name: str
    fp8_block: tuple[int, int] = (128, 128)

    def __post_init__(self) -> None:
        if self.name not in SOURCE_FORMATS:
            raise ConfigError(f"unsupported expert format {self.name!r}; supported: {', '.join(SOURCE_FORMATS)}")


def source_format_from_quant_config(quant_config: dict | None) -> SourceFormat:
    """Read the format from a checkpoint's `quantization_config` (None or {} = plain bf16/fp16).

    A tierstore-native config names it directly: {"quant_method": "tierstore", "source_format": ...}.
    """
    if not quant_config:
        return SourceFormat("bf16")
    method = str(quant_config.get("quant_method", "")).lower()
    if method == "tierstore":
        block = quant_config.get("weight_block_size", (128, 128))
        return SourceFormat(str(quant_config.get("source_format", "bf16")), tuple(int(b) for b in block))
    if method == "modelopt":
        algo = quant_config.get("quant_algo") or quant_config.get("quantization", {}).get("quant_algo")
        if str(algo).upper() != "NVFP4":
            raise ConfigError(f"modelopt checkpoint with quant_algo {algo!r}: only NVFP4 experts are supported")
        return SourceFormat("nvfp4")
    if method == "fp8":
        block = quant_config.get("weight_block_size")
        if not block or len(block) != 2:
            raise ConfigError("fp8 checkpoint without a 2-D weight_block_size: only block-quantized FP8 is supported")
        return SourceFormat("fp8_block", (int(block[0]), int(block[1])))
    if method == "mxfp4":
        return SourceFormat("mxfp4")
    raise ConfigError(f"checkpoint quant_method {method!r} is not an expert format tierstore reads; "
                      f"supported: bf16 (no quantization_config), fp8 (block), modelopt (NVFP4), mxfp4")


@dataclass(frozen=True)
class ParamSpec:
    """One parameter to register on the MoE layer; `quant_method` is what vLLM's loader reads to
    pick the loading rule for a scale ("tensor", "channel", "group" or "block")."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    quant_method: str | None = None


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def check_shard_geometry(fmt: SourceFormat, hidden: int, inter_local: int, tp_size: int) -> None:
    """Refuse geometries whose per-rank shard would cut a quantization block or a W2 block."""
    if hidden % W2_BLOCK or inter_local % W2_BLOCK:
        raise ConfigError(f"W2 needs hidden ({hidden}) and the per-rank intermediate size ({inter_local}, "
                          f"TP {tp_size}) to be multiples of {W2_BLOCK}")
    if fmt.name == "fp8_block" and tp_size > 1:
        block_n, block_k = fmt.fp8_block
        if inter_local % block_n or inter_local % block_k:
            raise ConfigError(f"FP8 block {fmt.fp8_block} does not divide the per-rank intermediate size "
                              f"{inter_local} (TP {tp_size}): the shard would cut a scale block")


def param_specs(fmt: SourceFormat, experts: int, hidden: int, inter: int, params_dtype: torch.dtype) -> list[ParamSpec]:
    """Parameters (local experts, per-rank intermediate size `inter`) that hold the checkpoint's
    expert tensors as stored, for vLLM's loader to fill."""
    if fmt.name == "bf16":
        return [ParamSpec("w13_weight", (experts, 2 * inter, hidden), params_dtype),
                ParamSpec("w2_weight", (experts, hidden, inter), params_dtype)]
    if fmt.name == "fp8_block":
        bn, bk = fmt.fp8_block
        return [ParamSpec("w13_weight", (experts, 2 * inter, hidden), torch.float8_e4m3fn),
                ParamSpec("w2_weight", (experts, hidden, inter), torch.float8_e4m3fn),
                ParamSpec("w13_weight_scale_inv", (experts, 2 * _ceil_div(inter, bn), _ceil_div(hidden, bk)),
                          torch.float32, "block"),
                ParamSpec("w2_weight_scale_inv", (experts, _ceil_div(hidden, bn), _ceil_div(inter, bk)),
                          torch.float32, "block")]
    if fmt.name == "nvfp4":
        return [ParamSpec("w13_weight", (experts, 2 * inter, hidden // 2), torch.uint8),
                ParamSpec("w2_weight", (experts, hidden, inter // 2), torch.uint8),
                ParamSpec("w13_weight_scale", (experts, 2 * inter, hidden // NVFP4_BLOCK), torch.float8_e4m3fn, "block"),
                ParamSpec("w2_weight_scale", (experts, hidden, inter // NVFP4_BLOCK), torch.float8_e4m3fn, "block"),
                ParamSpec("w13_weight_scale_2", (experts, 2), torch.float32, "tensor"),
                ParamSpec("w2_weight_scale_2", (experts,), torch.float32, "tensor"),
                ParamSpec("w13_input_scale", (experts, 2), torch.float32, "tensor"),
                ParamSpec("w2_input_scale", (experts,), torch.float32, "tensor")]
    return [ParamSpec("w13_weight", (experts, 2 * inter, hidden // 2), torch.uint8),
            ParamSpec("w2_weight", (experts, hidden, inter // 2), torch.uint8),
            ParamSpec("w13_weight_scale", (experts, 2 * inter, hidden // MXFP4_BLOCK), torch.uint8, "group"),
            ParamSpec("w2_weight_scale", (experts, hidden, inter // MXFP4_BLOCK), torch.uint8, "group")]


def _dequantize(fmt: SourceFormat, params: dict[str, torch.Tensor], which: str, expert: int) -> torch.Tensor:
    """float64 [N, K] of one expert's `which` matrix ("w13" or "w2"), exactly."""
    weight = params[f"{which}_weight"][expert]
    if fmt.name == "bf16":
        return weight.to(torch.float64)
    if fmt.name == "fp8_block":
        scale = params[f"{which}_weight_scale_inv"][expert]
        if which == "w2":
            return dequantize_fp8_block(weight, scale, fmt.fp8_block)
        inter, half = weight.shape[0] // 2, scale.shape[0] // 2  # gate and up carry their own block rows
        return torch.cat([dequantize_fp8_block(weight[:inter], scale[:half], fmt.fp8_block),
                          dequantize_fp8_block(weight[inter:], scale[half:], fmt.fp8_block)])
    if fmt.name == "nvfp4":
        scale = params[f"{which}_weight_scale"][expert]
        scale_2 = params[f"{which}_weight_scale_2"][expert]  # w13: [2] (gate, up); w2: []
        if which == "w13":
            scale_2 = scale_2.repeat_interleave(weight.shape[0] // 2)  # per row [2I]
        return dequantize_nvfp4(weight, scale, scale_2)
    return dequantize_mxfp4(weight, params[f"{which}_weight_scale"][expert])


def requantize_expert(fmt: SourceFormat, params: dict[str, torch.Tensor], expert: int,
                      zero_mode: str) -> tuple[W2Tensor, W2Tensor]:
    """(w13 [2I, H], w2 [H, I]) of local expert `expert` as W2. MXFP4 keeps its nibbles verbatim."""
    if fmt.name == "mxfp4":
        return tuple(w2_from_mxfp4(params[f"{m}_weight"][expert], params[f"{m}_weight_scale"][expert])
                     for m in ("w13", "w2"))
    return tuple(quantize_w2(_dequantize(fmt, params, m, expert), zero_mode=zero_mode) for m in ("w13", "w2"))


def dequantize_expert(fmt: SourceFormat, params: dict[str, torch.Tensor], expert: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [2I, H], w2 [H, I]) float64 of the checkpoint values as loaded (for tests and checks)."""
    return tuple(_dequantize(fmt, params, m, expert) for m in ("w13", "w2"))
