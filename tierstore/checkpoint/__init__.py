"""Reading HF safetensors MoE checkpoints (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3) layer by layer.

    with open_checkpoint(path) as ckpt:
        ckpt.geometry        # MoEGeometry
        ckpt.source_format   # "bf16" | "fp16" | "fp32" | "nvfp4" | "fp8_block" | "mxfp4"
        for layer in ckpt.iter_layers(progress=True):
            for expert in layer.experts:
                expert.w13.dequantize()            # float64 [2I, H], gate rows then up rows
                expert.w2.dequantize()             # float64 [H, I]

Expert layouts: classic per-expert tensors (Hub checkpoints, `save_pretrained` default), the
stacked [E, 2I, H] / [E, H, I] tensors of transformers >= 5 (either orientation), and a
per-expert fused `gate_up_proj`; see layout.py. Layers are addressed by their dense MoE index
0..L-1; `MoELayer.decoder_layer` is the decoder-layer index. `write_synthetic_checkpoint`
builds small checkpoints in the classic naming.

Quantized per-expert tensors: NVFP4 (modelopt: `weight` uint8, `weight_scale` e4m3 block-16,
`weight_scale_2` fp32, `input_scale`), FP8 block (`weight` e4m3, `weight_scale_inv` fp32) and
MXFP4 (`weight` uint8 packed e2m1, low nibble = even k; `weight_scale` uint8 UE8M0 per 32 along K).
"""

from tierstore.checkpoint.config import SUPPORTED_MODEL_TYPES, geometry_from_config
from tierstore.checkpoint.layout import ExpertWeights, SharedExperts
from tierstore.checkpoint.matrices import SourceMatrix
from tierstore.checkpoint.reader import Checkpoint, MoELayer, open_checkpoint
from tierstore.checkpoint.synthetic import write_synthetic_checkpoint

__all__ = [
    "Checkpoint",
    "ExpertWeights",
    "MoELayer",
    "SUPPORTED_MODEL_TYPES",
    "SharedExperts",
    "SourceMatrix",
    "geometry_from_config",
    "open_checkpoint",
    "write_synthetic_checkpoint",
]
