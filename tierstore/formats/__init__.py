"""The quantizer ABI: checkpoint formats in, the 2-bit base ("W2") and its FP4 tier out."""

from tierstore.formats.block_formats import (
    dequantize_fp8_block,
    dequantize_mxfp4,
    dequantize_nvfp4,
    encode_fp8_block,
    encode_mxfp4,
    encode_nvfp4,
)
from tierstore.formats.fp_codecs import E2M1_MAGNITUDES

__all__ = [
    "E2M1_MAGNITUDES",
    "dequantize_fp8_block",
    "dequantize_mxfp4",
    "dequantize_nvfp4",
    "encode_fp8_block",
    "encode_mxfp4",
    "encode_nvfp4",
]
