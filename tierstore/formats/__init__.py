"""The quantizer ABI: checkpoint formats in, the 2-bit base ("W2") and its FP4 tier out."""

from tierstore.formats.block_formats import (
    dequantize_fp8_block,
    dequantize_mxfp4,
    dequantize_nvfp4,
    encode_fp8_block,
    encode_mxfp4,
    encode_nvfp4,
)
from tierstore.formats.codebook import (
    codebook_report,
    codebook_report_from_histogram,
    nibble_histogram,
    summarise_codebook_reports,
)
from tierstore.formats.fp_codecs import E2M1_MAGNITUDES
from tierstore.formats.w2 import (
    W2_ABI_TAG,
    W2_BLOCK,
    W2_LEVELS,
    W2Tensor,
    quantize_w2,
    w2_block_exponents,
    w2_from_mxfp4,
)

__all__ = [
    "E2M1_MAGNITUDES",
    "W2_ABI_TAG",
    "W2_BLOCK",
    "W2_LEVELS",
    "W2Tensor",
    "codebook_report",
    "codebook_report_from_histogram",
    "dequantize_fp8_block",
    "dequantize_mxfp4",
    "dequantize_nvfp4",
    "encode_fp8_block",
    "encode_mxfp4",
    "encode_nvfp4",
    "nibble_histogram",
    "quantize_w2",
    "summarise_codebook_reports",
    "w2_block_exponents",
    "w2_from_mxfp4",
]
