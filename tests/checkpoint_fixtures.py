"""Builders of tiny checkpoints in real on-disk layouts, for tests (import as `from checkpoint_fixtures import ...`).

- `tiny_hf_model` / `save_hf_checkpoint`: a seeded random-init transformers model (Mixtral,
  Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3) written with `save_pretrained`, in the classic
  per-expert layout or transformers' fused one.
- `expected_experts`: (w13, w2) per expert straight from a model's own parameters.
- `quantize_checkpoint`: rewrites a bf16 checkpoint's expert and shared-expert matrices as
  NVFP4 (modelopt), FP8 block or MXFP4, sharded with an index, using tierstore.formats encoders.
- `write_large_checkpoint`: a big bf16 checkpoint written one layer-shard at a time.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

_COMMON = dict(vocab_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               num_experts_per_tok=2, bos_token_id=0, eos_token_id=1, pad_token_id=2)
_DEEPSEEK = dict(kv_lora_rank=8, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                 num_key_value_heads=4, first_k_dense_replace=1, n_routed_experts=6)

# hidden / expert-intermediate sizes differ per model so both fused orientations are exercised
TINY_CONFIGS = {
    "mixtral": ("MixtralConfig", dict(hidden_size=32, intermediate_size=16, num_local_experts=4)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=24, num_experts=5,
                                         decoder_sparse_step=1, mlp_only_layers=[1])),
    "qwen3_moe": ("Qwen3MoeConfig", dict(hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                                         num_experts=4, head_dim=16, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", dict(hidden_size=32, intermediate_size=24, num_experts=4, num_key_value_heads=4)),
    "deepseek_v2": ("DeepseekV2Config", dict(_DEEPSEEK, hidden_size=32, intermediate_size=48,
                                             moe_intermediate_size=16, n_shared_experts=2)),
    "deepseek_v3": ("DeepseekV3Config", dict(_DEEPSEEK, hidden_size=64, intermediate_size=96,
                                             moe_intermediate_size=32, n_shared_experts=1, n_group=2,
                                             topk_group=1)),
}


def tiny_hf_model(model_type: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16):
    """A seeded random-init transformers causal LM of `model_type`, built from a config (no network)."""
    import transformers

    class_name, kwargs = TINY_CONFIGS[model_type]
    config = getattr(transformers, class_name)(**{**_COMMON, **kwargs})
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    return model.to(dtype).eval()


def save_hf_checkpoint(model, directory: Path, *, fused: bool = False) -> Path:
    """`save_pretrained` to `directory`: classic per-expert names, or (fused) transformers' stacked experts."""
    model.save_pretrained(directory, save_original_format=not fused)
    return directory


def expected_experts(state: dict[str, torch.Tensor], decoder_layer: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """[(w13 [2I, H], w2 [H, I]) float64] per expert, from a transformers model's fused in-memory parameters."""
    gate_up = state[f"model.layers.{decoder_layer}.mlp.experts.gate_up_proj"]  # [E, 2I, H], gate rows first
    down = state[f"model.layers.{decoder_layer}.mlp.experts.down_proj"]  # [E, H, I]
    return [(gate_up[e].double(), down[e].double()) for e in range(gate_up.shape[0])]


def transpose_fused_checkpoint(src: Path, dst: Path) -> Path:
    """Copy a fused checkpoint, storing gate_up_proj as [E, H, 2I] and down_proj as [E, I, H]."""
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_bytes((src / "config.json").read_bytes())
    tensors = {}
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        for name in f.keys():
            tensor = f.get_tensor(name)
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                tensor = tensor.transpose(1, 2).contiguous()
            tensors[name] = tensor
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


EXPERT_MATRIX = re.compile(r"\.(experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)"
                           r"|shared_experts?\.(gate_proj|up_proj|down_proj))\.weight$")


def _quantized(prefix: str, weight: torch.Tensor, fmt: str, fp8_block: tuple[int, int]) -> dict[str, torch.Tensor]:
    from tierstore.formats import encode_fp8_block, encode_mxfp4, encode_nvfp4

    if fmt == "nvfp4":  # modelopt names
        packed, scale, scale_2 = encode_nvfp4(weight)
        return {f"{prefix}.weight": packed, f"{prefix}.weight_scale": scale,
                f"{prefix}.weight_scale_2": scale_2, f"{prefix}.input_scale": torch.tensor(0.01)}
    if fmt == "fp8_block":
        values, scale_inv = encode_fp8_block(weight, fp8_block)
        return {f"{prefix}.weight": values, f"{prefix}.weight_scale_inv": scale_inv}
    packed, scale = encode_mxfp4(weight)
    return {f"{prefix}.weight": packed, f"{prefix}.weight_scale": scale}


QUANTIZATION_CONFIGS = {
    "nvfp4": lambda block: {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16},
    "fp8_block": lambda block: {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)},
    "mxfp4": lambda block: {"quant_method": "mxfp4"},
}


def quantize_checkpoint(src: Path, dst: Path, fmt: str, *, num_shards: int = 2,
                        fp8_block: tuple[int, int] = (128, 128)) -> dict[str, torch.Tensor]:
    """Write `src` (classic layout, one file) to `dst` with expert matrices in `fmt`; returns every tensor written.

    Each matrix is scaled by its own factor first, so the halves of a w13 get different NVFP4 scale_2.
    """
    dst.mkdir(parents=True, exist_ok=True)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIGS[fmt](fp8_block)
    (dst / "config.json").write_text(json.dumps(config))
    written = {}
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        for position, name in enumerate(sorted(f.keys())):
            tensor = f.get_tensor(name)
            if EXPERT_MATRIX.search(name):
                weight = tensor.float() * (1 + position % 7)
                written.update(_quantized(name.removesuffix(".weight"), weight, fmt, fp8_block))
            else:
                written[name] = tensor
    names = sorted(written)
    weight_map = {}
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[len(names) * shard // num_shards: len(names) * (shard + 1) // num_shards]
        save_file({n: written[n] for n in part}, str(dst / file))
        weight_map.update(dict.fromkeys(part, file))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return written


def large_expert_value(layer: int, expert: int) -> float:
    """The constant (exact in bf16) that fills expert `expert` of layer `layer` in write_large_checkpoint."""
    return ((layer * 31 + expert) % 64 + 1) / 64


def write_large_checkpoint(path: Path, *, num_layers: int, num_experts: int, hidden: int, inter: int) -> int:
    """A qwen3_moe bf16 checkpoint, one shard per layer, built one shard at a time; returns expert bytes."""
    from tierstore.checkpoint.synthetic import synthetic_config

    path.mkdir(parents=True, exist_ok=True)
    config = synthetic_config("qwen3_moe", num_layers=num_layers, num_experts=num_experts, top_k=2, hidden=hidden,
                              expert_inter=inter, num_shared_experts=0, dense_layers=0, fmt="bf16",
                              fp8_block=(128, 128), swiglu_limit=None)
    (path / "config.json").write_text(json.dumps(config))
    weight_map = {}
    for layer in range(num_layers):
        block = f"model.layers.{layer}.mlp"
        tensors = {f"{block}.gate.weight": torch.zeros(num_experts, hidden, dtype=torch.bfloat16)}
        for e in range(num_experts):
            value = large_expert_value(layer, e)
            for proj, shape in (("gate_proj", (inter, hidden)), ("up_proj", (inter, hidden)),
                                ("down_proj", (hidden, inter))):
                tensors[f"{block}.experts.{e}.{proj}.weight"] = torch.full(shape, value, dtype=torch.bfloat16)
        file = f"model-{layer + 1:05d}-of-{num_layers:05d}.safetensors"
        save_file(tensors, str(path / file))
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return num_layers * num_experts * 3 * hidden * inter * 2
