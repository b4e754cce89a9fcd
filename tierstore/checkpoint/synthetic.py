"""Write small synthetic MoE checkpoints in the real on-disk naming (torch + safetensors only).

Weights are Laplace distributed: peaked and heavy-tailed like real expert weights, so codebook
reports on them behave like on real checkpoints (the L2-optimal 4-level set comes out
sign-asymmetric, as it does on real experts; lighter tails such as Student-t(4) do not show it). Only the MoE-relevant tensors are
written (routers, routed and shared experts, dense MLPs of non-MoE layers); attention and
embeddings are not, since tierstore never reads them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from tierstore.checkpoint.config import SUPPORTED_MODEL_TYPES
from tierstore.checkpoint.files import INDEX_FILE, SINGLE_FILE
from tierstore.checkpoint.layout import DEFAULT_PROJECTIONS, classic_expert_prefixes
from tierstore.errors import CheckpointError
from tierstore.formats import encode_fp8_block, encode_mxfp4, encode_nvfp4

SYNTHETIC_FORMATS = ("bf16", "nvfp4", "fp8_block", "mxfp4")
WEIGHT_STD = 0.02
NVFP4_INPUT_SCALE = 1.0 / 448.0  # a plausible activation amax / (6 * 448) stand-in

_ARCHITECTURES = {
    "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM",
}


def laplace(shape: tuple[int, ...], generator: torch.Generator, std: float = WEIGHT_STD) -> torch.Tensor:
    """float32 Laplace samples scaled to standard deviation `std`: the difference of two Exp(1)
    variables is Laplace(0, 1), whose standard deviation is sqrt(2)."""
    uniforms = torch.rand((2, *shape), generator=generator).clamp_min_(1e-12)
    exp_pair = -uniforms.log()
    return (exp_pair[0] - exp_pair[1]) * (std / math.sqrt(2.0))


def synthetic_config(arch: str, *, num_layers: int, num_experts: int, top_k: int, hidden: int,
                     expert_inter: int, num_shared_experts: int, dense_layers: int, fmt: str,
                     fp8_block: tuple[int, int], swiglu_limit: float | None) -> dict:
    """config.json contents for `arch` in that family's own key names."""
    config = {"architectures": [_ARCHITECTURES[arch]], "model_type": arch, "hidden_size": hidden,
              "num_hidden_layers": num_layers, "num_experts_per_tok": top_k, "hidden_act": "silu",
              "vocab_size": 256, "num_attention_heads": max(1, hidden // 64), "torch_dtype": "bfloat16"}
    if arch in ("mixtral", "olmoe"):
        config.update(intermediate_size=expert_inter)
        config["num_local_experts" if arch == "mixtral" else "num_experts"] = num_experts
    elif arch in ("qwen2_moe", "qwen3_moe"):
        config.update(num_experts=num_experts, moe_intermediate_size=expert_inter,
                      intermediate_size=4 * expert_inter, decoder_sparse_step=1,
                      mlp_only_layers=list(range(dense_layers)), norm_topk_prob=arch == "qwen3_moe")
        if arch == "qwen2_moe":
            config["shared_expert_intermediate_size"] = num_shared_experts * expert_inter
    else:
        config.update(n_routed_experts=num_experts, moe_intermediate_size=expert_inter,
                      intermediate_size=4 * expert_inter, n_shared_experts=num_shared_experts,
                      first_k_dense_replace=dense_layers, moe_layer_freq=1,
                      scoring_func="sigmoid" if arch == "deepseek_v3" else "softmax",
                      norm_topk_prob=arch == "deepseek_v3")
    if swiglu_limit is not None:
        config["swiglu_limit"] = swiglu_limit
    if fmt == "nvfp4":
        config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16}
    elif fmt == "fp8_block":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": list(fp8_block)}
    elif fmt == "mxfp4":
        config["quantization_config"] = {"quant_method": "mxfp4"}
    return config


def encode_matrix(prefix: str, weight: torch.Tensor, fmt: str, fp8_block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The tensors that store float `weight` [N, K] under `prefix` in format `fmt`."""
    if fmt == "bf16":
        return {f"{prefix}.weight": weight.to(torch.bfloat16)}
    if fmt == "nvfp4":
        packed, scale, scale_2 = encode_nvfp4(weight)
        return {f"{prefix}.weight": packed, f"{prefix}.weight_scale": scale,
                f"{prefix}.weight_scale_2": scale_2.reshape(()),
                f"{prefix}.input_scale": torch.tensor(NVFP4_INPUT_SCALE, dtype=torch.float32)}
    if fmt == "fp8_block":
        values, scale_inv = encode_fp8_block(weight, fp8_block)
        return {f"{prefix}.weight": values, f"{prefix}.weight_scale_inv": scale_inv}
    packed, scale = encode_mxfp4(weight)
    return {f"{prefix}.weight": packed, f"{prefix}.weight_scale": scale}


def _mlp(prefixes, inter: int, hidden: int, gen: torch.Generator, fmt: str, fp8_block) -> dict[str, torch.Tensor]:
    gate, up, down = prefixes
    tensors = {}
    for prefix, shape in ((gate, (inter, hidden)), (up, (inter, hidden)), (down, (hidden, inter))):
        tensors.update(encode_matrix(prefix, laplace(shape, gen), fmt, fp8_block))
    return tensors


def _layer_tensors(arch: str, layer: int, moe: bool, config: dict, gen: torch.Generator, fmt: str,
                   fp8_block: tuple[int, int]) -> dict[str, torch.Tensor]:
    hidden, inter = config["hidden_size"], config.get("moe_intermediate_size", config["intermediate_size"])
    if not moe:  # a dense layer's plain MLP (DeepSeek first_k_dense_replace / Qwen mlp_only_layers)
        base = f"model.layers.{layer}.mlp"
        return _mlp([f"{base}.{p}" for p in DEFAULT_PROJECTIONS], config["intermediate_size"], hidden, gen,
                    "bf16", fp8_block)
    num_experts = config.get("n_routed_experts") or config.get("num_experts") or config["num_local_experts"]
    block = classic_expert_prefixes(arch, layer, 0)[0].rsplit(".experts.", 1)[0]
    tensors = {f"{block}.gate.weight": laplace((num_experts, hidden), gen).to(torch.bfloat16)}
    for expert in range(num_experts):
        tensors.update(_mlp(classic_expert_prefixes(arch, layer, expert), inter, hidden, gen, fmt, fp8_block))
    if arch == "deepseek_v3":
        tensors[f"{block}.gate.e_score_correction_bias"] = laplace((num_experts,), gen)
    shared_inter = config.get("shared_expert_intermediate_size") or inter * (config.get("n_shared_experts") or 0)
    if shared_inter:
        name = "shared_expert" if arch == "qwen2_moe" else "shared_experts"
        tensors.update(_mlp([f"{block}.{name}.{p}" for p in DEFAULT_PROJECTIONS], shared_inter, hidden, gen,
                            fmt, fp8_block))
        if arch == "qwen2_moe":
            tensors[f"{block}.shared_expert_gate.weight"] = laplace((1, hidden), gen).to(torch.bfloat16)
    return tensors


def write_synthetic_checkpoint(path: str | Path, *, arch: str = "qwen3_moe", num_layers: int = 4,
                               num_experts: int = 16, top_k: int = 4, hidden: int = 256, expert_inter: int = 128,
                               fmt: str = "bf16", seed: int = 0, num_shards: int = 1,
                               num_shared_experts: int = 0, dense_layers: int = 0,
                               fp8_block: tuple[int, int] = (128, 128),
                               swiglu_limit: float | None = None) -> Path:
    """Write config.json and safetensors (one file, or `num_shards` shards plus an index) to `path`.

    `num_layers` counts decoder layers, the first `dense_layers` of which are dense (DeepSeek /
    Qwen families only). Shared experts exist for qwen2_moe and the DeepSeek families. Shards
    are written one at a time, so memory holds one shard's tensors at most. Returns `path`.
    """
    if arch not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(f"unsupported synthetic arch {arch!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if fmt not in SYNTHETIC_FORMATS:
        raise CheckpointError(f"unsupported synthetic format {fmt!r}; supported: {', '.join(SYNTHETIC_FORMATS)}")
    if num_shared_experts and arch not in ("qwen2_moe", "deepseek_v2", "deepseek_v3"):
        raise CheckpointError(f"{arch} has no shared experts")
    if dense_layers and arch in ("mixtral", "olmoe"):
        raise CheckpointError(f"{arch} has no dense layers")
    if not 0 <= dense_layers < num_layers or not 1 <= num_shards <= num_layers:
        raise CheckpointError(f"need 0 <= dense_layers < num_layers and 1 <= num_shards <= num_layers, got "
                              f"dense_layers={dense_layers}, num_layers={num_layers}, num_shards={num_shards}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = synthetic_config(arch, num_layers=num_layers, num_experts=num_experts, top_k=top_k, hidden=hidden,
                              expert_inter=expert_inter, num_shared_experts=num_shared_experts,
                              dense_layers=dense_layers, fmt=fmt, fp8_block=fp8_block, swiglu_limit=swiglu_limit)
    (path / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    gen = torch.Generator().manual_seed(seed)
    shards = [range(num_layers * s // num_shards, num_layers * (s + 1) // num_shards) for s in range(num_shards)]
    weight_map = {}
    for number, layers in enumerate(shards, start=1):
        tensors = {}
        for layer in layers:
            tensors.update(_layer_tensors(arch, layer, layer >= dense_layers, config, gen, fmt, fp8_block))
        name = SINGLE_FILE if num_shards == 1 else f"model-{number:05d}-of-{num_shards:05d}.safetensors"
        save_file(tensors, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    if num_shards > 1:
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (path / INDEX_FILE).write_text(json.dumps(index, indent=2), encoding="utf-8")
    return path
